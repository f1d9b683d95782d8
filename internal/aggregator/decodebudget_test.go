package aggregator

import (
	"testing"
	"time"
)

// A budget lets through what fits and holds the rest until it is given
// back; a message larger than the whole budget takes all of it.
func TestDecodeBudget(t *testing.T) {
	b := newDecodeBudget(10)
	if got := b.Take(25); got != 10 {
		t.Fatalf("took %d of a 10-byte budget", got)
	}
	done := make(chan int)
	go func() { done <- b.Take(4) }()
	select {
	case <-done:
		t.Fatal("took from an exhausted budget")
	case <-time.After(50 * time.Millisecond):
	}
	b.Give(10)
	if got := <-done; got != 4 {
		t.Fatalf("took %d", got)
	}
}
