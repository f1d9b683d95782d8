package collector

import (
	"context"
	"time"
)

// FlushProbe is a reader that can tell, cheaply and between reads, that
// the node's rules were flushed since its last read: the dispatch every
// service is reached through (iptables' KUBE-SERVICES, the nftables
// services chain, IPVS's virtual servers) emptied or cut to half, or its
// table deleted. Such a change breaks every service through the node,
// and the read that shows it is cheap (the table is empty): it is made at
// once, whatever the read budget or the gap between reads holds. Reads of
// kube-proxy's own syncs, which rewrite the dispatch whole in one commit,
// never trip it.
//
// Flushed is called from the collector's loop, never during a read; it
// may ask the kernel (a first part of one dump, a getsockopt), never read
// a table.
type FlushProbe interface {
	Flushed(ctx context.Context) bool
}

// flushWatch follows, from the change signal's notifications, how many
// rules each family's dispatch chain holds, and trips when a commit
// leaves one with at most half of what the last read saw, or deletes its
// table. It counts at commits' ends (NEWGEN): kube-proxy's sync deletes
// every rule of KUBE-SERVICES and adds them again in one commit, which
// must not look like a flush halfway through; a flush followed by
// kube-proxy's next sync is two commits, and the first trips.
//
// Its owner holds the lock of the notes it is part of.
type flushWatch struct {
	base   [2]int // the dispatch's rules at the last read, by family
	net    [2]int // rules added less rules deleted since that read began
	atTake [2]int // net when the last read took the notes
	// tripped: a commit since the last take left a dispatch at half or
	// less (or deleted its table).
	tripped bool
}

// rule counts one rule added to (+1) or deleted from (-1) family i's
// dispatch.
func (w *flushWatch) rule(i, delta int) { w.net[i] += delta }

// tableGone: family i's table was deleted with its dispatch.
func (w *flushWatch) tableGone(i int) { w.net[i] = -w.base[i] }

// commit ends a commit: did it leave a dispatch at half or less?
func (w *flushWatch) commit() {
	for i := range w.base {
		if w.base[i] > 0 && 2*(w.base[i]+w.net[i]) <= w.base[i] {
			w.tripped = true
		}
	}
}

// take: a read takes the notes; what it reads shows the commits so far.
func (w *flushWatch) take() {
	w.atTake, w.tripped = w.net, false
}

// rebase: family i's dispatch held n rules at the read that last took
// the notes; what was counted since that take stays counted.
func (w *flushWatch) rebase(i, n int) {
	w.base[i], w.net[i], w.atTake[i] = n, w.net[i]-w.atTake[i], 0
}

// peekRate spaces the dumps a FlushProbe makes when notifications were
// lost and only the kernel can say: at most one a second.
type peekRate struct{ last time.Time }

func (p *peekRate) allow(now time.Time) bool {
	if now.Sub(p.last) < time.Second {
		return false
	}
	p.last = now
	return true
}
