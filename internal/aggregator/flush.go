package aggregator

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// flushWait bounds how long a flush waits for the collector's answer: a
// dump and the deletes of a big table take seconds.
const flushWait = 40 * time.Second

// flushes pairs the collectors' answers with the requests waiting for
// them.
type flushes struct {
	mu      sync.Mutex
	next    uint64
	waiting map[uint64]flushWaiter
}

// flushWaiter is a flush sent on stream c, waiting on ch for its answer
// (nil: the stream ended first).
type flushWaiter struct {
	c  *conn
	ch chan *stream.Flushed
}

// Flush asks the node's collector, over its stream, to delete the
// conntrack entries of pairs, and returns what became of each (the
// collector decides: see collector.Flusher). With shards, a node whose
// stream is on another replica is flushed by that replica. It fails when
// the node's collector cannot be reached or does not answer in time.
func (a *Aggregator) Flush(ctx context.Context, node string, pairs []remediate.StalePair) ([]remediate.FlushResult, error) {
	return a.flushVia(ctx, node, pairs, true)
}

// flushVia is Flush; onHolder: ask the node's holder when the stream is not
// here (never for a request that came from another replica: two replicas
// that each believe the other holds the node would pass it back and forth).
func (a *Aggregator) flushVia(ctx context.Context, node string, pairs []remediate.StalePair, onHolder bool) ([]remediate.FlushResult, error) {
	a.mu.Lock()
	var c *conn
	if n := a.fleet.nodes[node]; n != nil {
		c = n.conn
	}
	a.mu.Unlock()
	if c == nil && onHolder && a.sharded() && a.holderOf(node) != a.cfg.Self {
		// The leader acts; the shard's holder has the stream.
		return a.flushOnHolder(ctx, node, pairs)
	}
	if c == nil {
		return nil, fmt.Errorf("no collector of node %s is streaming to this replica (its collector pod is down or reconnecting: check the DaemonSet pod on the node; the flush is tried again when the node's cooldown ends)", node)
	}
	req := &stream.Flush{Pairs: make([]stream.FlushPair, len(pairs))}
	for i, p := range pairs {
		req.Pairs[i] = stream.FlushPair{Frontend: p.Frontend, Dest: p.Dest, TCP: p.Protocol == "TCP"}
	}
	if err := req.Check(); err != nil {
		return nil, err
	}
	ch := make(chan *stream.Flushed, 1)
	a.flush.mu.Lock()
	a.flush.next++
	req.ID = a.flush.next
	if a.flush.waiting == nil {
		a.flush.waiting = map[uint64]flushWaiter{}
	}
	a.flush.waiting[req.ID] = flushWaiter{c: c, ch: ch}
	a.flush.mu.Unlock()
	defer func() {
		a.flush.mu.Lock()
		delete(a.flush.waiting, req.ID)
		a.flush.mu.Unlock()
	}()
	// The timer starts before the send: whoever hears the flush (a test
	// stepping a fake clock) cannot step past a timer not yet made.
	timer := a.cfg.Clock.NewTimer(flushWait)
	defer timer.Stop()
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeFlush).Inc()
	if _, err := c.send(&stream.Message{Type: stream.TypeFlush, Flush: req}); err != nil {
		return nil, fmt.Errorf("sending the flush to node %s: %w", node, err)
	}
	var got *stream.Flushed
	select {
	case got = <-ch:
		if got == nil {
			return nil, fmt.Errorf("node %s's stream ended before its collector answered the flush (whether it deleted anything is unknown: the collector's next counts say)", node)
		}
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-timer.C():
		return nil, fmt.Errorf("node %s's collector did not answer the flush in %s", node, flushWait)
	}
	out := make([]remediate.FlushResult, len(pairs))
	for i := range out {
		if i < len(got.Results) {
			out[i] = remediate.FlushResult{Deleted: got.Results[i].Deleted, Refused: safetext.Clean(got.Results[i].Refused, 200)}
		}
	}
	if got.Error != "" {
		return out, errors.New("the collector: " + safetext.Clean(got.Error, 300))
	}
	return out, nil
}

// flushed hands a collector's answer, read on stream c, to the flush
// waiting for it; an answer nobody waits for on that stream (another
// node's flush included: a collector speaks for its own node only) or
// that does not match what was asked is an error the stream ends on.
func (a *Aggregator) flushed(c *conn, f *stream.Flushed) error {
	if len(f.Results) > stream.MaxFlushPairs {
		return fmt.Errorf("a flush answer of %d results", len(f.Results))
	}
	for _, r := range f.Results {
		if r.Deleted < 0 {
			return fmt.Errorf("a flush answer with %d entries deleted", r.Deleted)
		}
	}
	a.flush.mu.Lock()
	w, ok := a.flush.waiting[f.ID]
	if ok && w.c == c {
		delete(a.flush.waiting, f.ID)
	}
	a.flush.mu.Unlock()
	if !ok || w.c != c {
		return fmt.Errorf("an answer to flush %d, which nobody asked this stream for", f.ID)
	}
	w.ch <- f
	return nil
}

// flushesEnd releases the flushes waiting on stream c, which has ended.
func (a *Aggregator) flushesEnd(c *conn) {
	a.flush.mu.Lock()
	defer a.flush.mu.Unlock()
	for id, w := range a.flush.waiting {
		if w.c == c {
			delete(a.flush.waiting, id)
			w.ch <- nil
		}
	}
}
