package nl

import "time"

// FlushWatch follows, from the change signal's notifications, how many
// rules each family's dispatch chain holds, and trips when a commit
// leaves one with at most half of what the last read saw, or deletes its
// table. It counts at commits' ends (NEWGEN): kube-proxy's sync deletes
// every rule of KUBE-SERVICES and adds them again in one commit, which
// must not look like a flush halfway through; a flush followed by
// kube-proxy's next sync is two commits, and the first trips.
//
// Its owner holds the lock of the notes it is part of.
type FlushWatch struct {
	base   [2]int // the dispatch's rules at the last read, by family
	net    [2]int // rules added less rules deleted since that read began
	atTake [2]int // net when the last read took the notes
	// Tripped: a commit since the last take left a dispatch at half or
	// less (or deleted its table).
	Tripped bool
}

// Rule counts one rule added to (+1) or deleted from (-1) family i's
// dispatch.
func (w *FlushWatch) Rule(i, delta int) { w.net[i] += delta }

// TableGone: family i's table was deleted with its dispatch.
func (w *FlushWatch) TableGone(i int) { w.net[i] = -w.base[i] }

// Commit ends a commit: did it leave a dispatch at half or less?
func (w *FlushWatch) Commit() {
	for i := range w.base {
		if w.base[i] > 0 && 2*(w.base[i]+w.net[i]) <= w.base[i] {
			w.Tripped = true
		}
	}
}

// Take: a read takes the notes; what it reads shows the commits so far.
func (w *FlushWatch) Take() {
	w.atTake, w.Tripped = w.net, false
}

// Rebase: family i's dispatch held n rules at the read that last took
// the notes; what was counted since that take stays counted.
func (w *FlushWatch) Rebase(i, n int) {
	w.base[i], w.net[i], w.atTake[i] = n, w.net[i]-w.atTake[i], 0
}

// PeekRate spaces the dumps a FlushProbe makes when notifications were
// lost and only the kernel can say: at most one a second.
type PeekRate struct{ last time.Time }

func (p *PeekRate) Allow(now time.Time) bool {
	if now.Sub(p.last) < time.Second {
		return false
	}
	p.last = now
	return true
}
