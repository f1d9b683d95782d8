package aggregator

import (
	"context"

	"golang.org/x/sync/semaphore"
)

// decodeBudget bounds the bytes of large messages being decoded and applied at
// once across streams: a message decodes to about ten times its size, and
// after a leader change every collector sends its full snapshot (3 MB at
// 100k endpoints) at the same moment. Waiters are served in order and
// woken one at a time (a condition variable woke all 5,000 streams of a
// fleet at every release: a fifth of the leader's CPU while it was
// behind).
//
// Frames of largeFrame bytes or more (full snapshots) share at most half
// of it: eight collectors each trickling one large frame held the whole
// budget, and every other node's reports waited behind them for as long
// as they kept at it (trust review 4, item 9). Smaller frames (deltas,
// the common case) always have the other half.
type decodeBudget struct {
	all, large *semaphore.Weighted
	size       int
}

// largeFrame is the size from which a frame counts against the large
// frames' half.
const largeFrame = 1 << 20

// newDecodeBudget returns a budget of n bytes.
func newDecodeBudget(n int) *decodeBudget {
	return &decodeBudget{all: semaphore.NewWeighted(int64(n)), large: semaphore.NewWeighted(int64(max(1, n/2))), size: n}
}

// Take waits for n bytes of the budget (at most all of it, and at most
// half for a large frame of that size) and returns what it took.
func (b *decodeBudget) Take(n int) int {
	n = min(n, b.size)
	if n >= largeFrame {
		n = min(n, max(1, b.size/2))
		_ = b.large.Acquire(context.Background(), int64(n)) // no context: never fails
	}
	_ = b.all.Acquire(context.Background(), int64(n))
	return n
}

// Give returns what Take took.
func (b *decodeBudget) Give(n int) {
	b.all.Release(int64(n))
	if n >= largeFrame {
		b.large.Release(int64(n))
	}
}
