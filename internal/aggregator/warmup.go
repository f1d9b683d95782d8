package aggregator

import (
	"context"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// warmup lets one stream at a time bring a cold pool (a new leader's: the
// follower held no node's rules) its first state, while the other streams
// that named content the pool lacks wait for it. After a leader change the
// whole fleet reconnects at once, each naming its state by one hash; with
// nothing held, every stream was asked for every bucket's frontends and
// then their content (~0.6 MB and ~3 MB of JSON a node at the anchors),
// and decoding the same content from hundreds of nodes at once took the
// new leader's CPU for tens of seconds. Most of one node's state is every
// node's: the streams that waited ask only for what differs.
type warmup struct {
	mu    sync.Mutex
	warm  bool
	owner *conn
	ready chan struct{} // closed when the owner is done
	// onWait, when set (tests), is called as a stream begins to wait.
	onWait func()
}

// warmupWait bounds how long a stream waits for another to warm the pool.
const warmupWait = 5 * time.Second

// wait says whether c waited for another stream to warm the pool (its
// report should be resolved again). A warm pool, or no other stream
// warming it, does not wait: c then warms it. A warming stream that never
// answers holds the others warmupWait at a time, until its stream ends or
// another stream's state warms the pool.
func (w *warmup) wait(ctx context.Context, c *conn, clk clock.Clock) bool {
	w.mu.Lock()
	if w.warm || w.owner == nil || w.owner == c {
		if !w.warm && w.owner == nil {
			w.owner, w.ready = c, make(chan struct{})
		}
		w.mu.Unlock()
		return false
	}
	ready, onWait := w.ready, w.onWait
	w.mu.Unlock()
	// The timer exists before onWait says the stream waits: a test that
	// steps a fake clock on hearing it must not step past a timer not yet
	// made (seen under -race at nice 19: the stream then never woke).
	t := clk.NewTimer(warmupWait)
	defer t.Stop()
	if onWait != nil {
		onWait()
	}
	select {
	case <-ready:
	case <-t.C():
	case <-ctx.Done():
	}
	return true
}

// done says c applied a whole state (warmed: the pool is warm, whoever
// was warming it) or ended; either ends c's warm-up if it was warming.
func (w *warmup) done(c *conn, warmed bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.warm = w.warm || warmed
	if w.owner != nil && (w.owner == c || warmed) {
		close(w.ready)
		w.owner, w.ready = nil, nil
	}
}

// reset makes the pool count as cold again (a new leadership: what it
// held of the last one's nodes has gone with them).
func (w *warmup) reset() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.warm = false
}
