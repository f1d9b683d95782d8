package nl

import (
	"sync"

	"golang.org/x/sys/unix"
)

// Notes is what the notification sinks that follow changes share:
// whether notifications flow, whether one was lost, and the generation
// of the last commit announced.
type Notes struct {
	sync.Mutex
	subscribed bool
	lost       bool
	// gen is the generation of the last commit announced (genKnown: one
	// was, since the subscription). A commit's NEWGEN comes after all
	// its other notifications, so the notes hold every change of the
	// commits up to gen, and perhaps some of the next.
	gen      uint32
	genKnown bool
	// flush follows the dispatch chain (see FlushWatch).
	Flush FlushWatch
}

// Family reads what a notification is: its message type and its family
// (index 0 for IPv4, 1 for IPv6). ok is false for what the sinks do not
// follow: another subsystem or family, and a commit's NEWGEN, whose
// generation it records.
func (b *Notes) Family(typ uint16, data []byte) (msg uint16, i int, ok bool) {
	if len(data) < 4 || typ>>8 != unix.NFNL_SUBSYS_NFTABLES {
		return 0, 0, false
	}
	if typ&0xff == unix.NFT_MSG_NEWGEN {
		b.Lock()
		if g, ok := GenID(data); ok {
			b.gen, b.genKnown = g, true
		}
		b.Flush.Commit()
		b.Unlock()
		return 0, 0, false
	}
	switch data[0] {
	case unix.NFPROTO_IPV4:
		return typ & 0xff, 0, true
	case unix.NFPROTO_IPV6:
		return typ & 0xff, 1, true
	}
	return 0, 0, false
}

// Lost: a notification was dropped; the next read is whole.
func (b *Notes) Lost() {
	b.Lock()
	b.lost = true
	b.Unlock()
}

// Subscribed says whether notifications flow: without them every read is
// whole.
func (b *Notes) Subscribed(on bool) {
	b.Lock()
	b.subscribed, b.lost, b.genKnown = on, true, false
	b.Unlock()
}

// Taken reports, for a take (b.mu held), whether the next read must be
// whole, and through which generation the notes taken hold every change
// (0: unknown), and starts afresh.
//
// A read of changes reflects the commits up to that generation, not
// those up to the kernel's generation when it started: some of a commit's
// notifications may be taken while the rest, and its NEWGEN, are still
// on the way. The reader's token must say so, or that NEWGEN would find
// the token already moved and the rest would wait for the next commit
// (on a quiet node, forever).
func (b *Notes) Taken() (lost bool, through uint64) {
	lost = b.lost || !b.subscribed
	b.lost = false
	b.Flush.Take()
	if b.genKnown {
		through = uint64(b.gen)
	}
	return lost, through
}

// Flushed says whether a commit since the last read flushed a dispatch
// (tripped), and whether the notes since then are incomplete (a
// notification lost, or none flowing), so that only the kernel can say.
func (b *Notes) Flushed() (tripped, incomplete bool) {
	b.Lock()
	defer b.Unlock()
	return b.Flush.Tripped, b.lost || !b.subscribed
}

// Rebase records the rules family i's dispatch held at the last read.
func (b *Notes) Rebase(i, n int) {
	b.Lock()
	b.Flush.Rebase(i, n)
	b.Unlock()
}

// CountDispatch counts a rule added to or deleted from family i's
// dispatch chain (see FlushWatch).
func (b *Notes) CountDispatch(i int, msg uint16) {
	delta := 0
	switch msg {
	case unix.NFT_MSG_NEWRULE:
		delta = 1
	case unix.NFT_MSG_DELRULE, MsgDestroyRule:
		delta = -1
	default:
		return
	}
	b.Lock()
	b.Flush.Rule(i, delta)
	b.Unlock()
}

// CaughtUp says whether the notes hold every change up to the commit of
// generation gen, or lost a notification on the way (then the next read
// is whole and need not wait: under load the socket's buffer can
// overflow and the NEWGEN itself be among the lost).
func (b *Notes) CaughtUp(gen uint64) bool {
	b.Lock()
	defer b.Unlock()
	return b.lost || uint64(b.gen) == gen
}
