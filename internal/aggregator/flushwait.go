package aggregator

import (
	"fmt"
	"sync"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// flushes pairs the collectors' answers with the requests waiting for
// them.
type flushes struct {
	mu      sync.Mutex
	next    uint64
	pending map[uint64]flushWaiter
}

// flushWaiter is a flush sent on stream c, waiting on ch for its answer
// (nil: the stream ended first).
type flushWaiter struct {
	c  *conn
	ch chan *stream.Flushed
}

// wait registers a flush to be sent on stream c: its ID, where its
// answer comes (nil: the stream ended first), and done, to call once the
// flush no longer waits.
func (fs *flushes) wait(c *conn) (id uint64, answer <-chan *stream.Flushed, done func()) {
	ch := make(chan *stream.Flushed, 1)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	fs.next++
	id = fs.next
	if fs.pending == nil {
		fs.pending = map[uint64]flushWaiter{}
	}
	fs.pending[id] = flushWaiter{c: c, ch: ch}
	return id, ch, func() {
		fs.mu.Lock()
		delete(fs.pending, id)
		fs.mu.Unlock()
	}
}

// answer hands a collector's answer, read on stream c, to the flush
// waiting for it; an answer nobody waits for on that stream (another
// node's flush included: a collector speaks for its own node only) or
// that does not match what was asked is an error the stream ends on.
func (fs *flushes) answer(c *conn, f *stream.Flushed) error {
	if len(f.Results) > stream.MaxFlushPairs {
		return fmt.Errorf("a flush answer of %d results", len(f.Results))
	}
	for _, r := range f.Results {
		if r.Deleted < 0 {
			return fmt.Errorf("a flush answer with %d entries deleted", r.Deleted)
		}
	}
	fs.mu.Lock()
	w, ok := fs.pending[f.ID]
	if ok && w.c == c {
		delete(fs.pending, f.ID)
	}
	fs.mu.Unlock()
	if !ok || w.c != c {
		return fmt.Errorf("an answer to flush %d, which nobody asked this stream for", f.ID)
	}
	w.ch <- f
	return nil
}

// end releases the flushes waiting on stream c, which has ended.
func (fs *flushes) end(c *conn) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	for id, w := range fs.pending {
		if w.c == c {
			delete(fs.pending, id)
			w.ch <- nil
		}
	}
}
