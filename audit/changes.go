package audit

// Changes is what changed in a node's rules since the last read of a
// reader that follows changes (a collector's ChangeReader): applied to
// the last read's frontends they give what the node shows now.
type Changes struct {
	// Whole, when set, is a whole read: the rest is empty.
	Whole *Observed
	// Frontends are the frontends that changed or appeared, sorted by
	// key; Removed the keys of those that are gone.
	Frontends []ObservedFrontend
	Removed   []FrontendKey
	// The node-wide facts after the changes.
	Mode     Mode
	Families []int
	NoRules  bool
	// Through is the change signal's generation (its token) up to which
	// the read holds every commit's changes, when the reader learns the
	// changes from the signal's notifications (0: unknown). It can lag
	// the token taken before the read: that commit's notifications were
	// still on the way, and its NEWGEN must cause another read.
	Through uint64
}
