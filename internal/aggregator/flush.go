package aggregator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// flushWait bounds how long a flush waits for the collector's answer: a
// dump and the deletes of a big table take seconds.
const flushWait = 40 * time.Second

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
	id, ch, done := a.flush.wait(c)
	defer done()
	req.ID = id
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
