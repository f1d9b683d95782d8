// Package testkit holds what the tests of every package share: one poller
// with one error format. It imports only the standard library, so unit
// tests of any package may use it.
package testkit

import (
	"fmt"
	"time"
)

// TB is the part of testing.TB a poller needs.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// Eventually calls cond until it holds, first every 5 ms and then less
// often (doubling up to every 500 ms: a cond may ask an API server), and
// fails t with "after LIMIT, still waiting for WHAT" when limit passes
// first. It returns how long cond took to hold.
func Eventually(t TB, limit time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	took, err := Poll(limit, cond)
	if err != nil {
		t.Fatalf("%s", Waiting(limit, what, ""))
	}
	return took
}

// Await is Eventually that says what it saw: when limit passes first, t
// fails with Waiting's message and seen's account below it (the last
// findings, a node's state, the logs). seen is called only then, so it may
// be costly.
func Await(t TB, limit time.Duration, what string, cond func() bool, seen func() string) time.Duration {
	t.Helper()
	took, err := Poll(limit, cond)
	if err != nil {
		t.Fatalf("%s", Waiting(limit, what, seen()))
	}
	return took
}

// Poll is Eventually without a test: an error once limit passes.
func Poll(limit time.Duration, cond func() bool) (time.Duration, error) {
	start := time.Now()
	for every := 5 * time.Millisecond; !cond(); every = min(2*every, 500*time.Millisecond) {
		if time.Since(start) > limit {
			return time.Since(start), fmt.Errorf("after %s, still not", limit)
		}
		time.Sleep(every)
	}
	return time.Since(start), nil
}

// Waiting is the one message of a wait that ran out: what was awaited,
// how long, and what was seen last (optional, on lines of its own).
func Waiting(limit time.Duration, what, seen string) string {
	msg := fmt.Sprintf("after %s, still waiting for %s", limit, what)
	if seen != "" {
		msg += "; last seen:\n" + seen
	}
	return msg
}
