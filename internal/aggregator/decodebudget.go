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
type decodeBudget struct {
	sem  *semaphore.Weighted
	size int
}

// newDecodeBudget returns a budget of n bytes.
func newDecodeBudget(n int) *decodeBudget {
	return &decodeBudget{sem: semaphore.NewWeighted(int64(n)), size: n}
}

// Take waits for n bytes of the budget (at most all of it) and returns
// what it took.
func (b *decodeBudget) Take(n int) int {
	n = min(n, b.size)
	_ = b.sem.Acquire(context.Background(), int64(n)) // no context: never fails
	return n
}

// Give returns what Take took.
func (b *decodeBudget) Give(n int) { b.sem.Release(int64(n)) }
