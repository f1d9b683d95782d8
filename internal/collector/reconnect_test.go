package collector

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// A follower that still names a dead leader (the Lease has not moved)
// must not bounce a collector between the two as fast as it can dial: the
// second redirect to the leader just tried waits like a failure.
func TestRedirectToAnUnreachableLeaderWaits(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	var mu sync.Mutex
	var calls []string
	ended := make(chan error, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go Reconnect(ctx, clk, func(_ context.Context, preferred string) (string, bool, error) {
		mu.Lock()
		calls = append(calls, preferred)
		mu.Unlock()
		// The dead leader refuses; the follower names it again.
		return "10.0.0.1:9443", false, nil
	}, func(err error, wait time.Duration) {
		if wait < 500*time.Millisecond {
			t.Errorf("waits %s after a failed redirect, want at least half a second", wait)
		}
		ended <- err
	})
	select {
	case err := <-ended:
		if err == nil || !strings.Contains(err.Error(), "did not answer") {
			t.Errorf("ended with %v, want it to say the leader did not answer", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Reconnect never waited")
	}
	mu.Lock()
	got := append([]string(nil), calls...)
	mu.Unlock()
	if len(got) != 2 || got[0] != "" || got[1] != "10.0.0.1:9443" {
		t.Errorf("sessions before the first wait: %q, want the first without a preference, then the leader once", got)
	}
}

// A busy refusal is a slot: kept with at most 10 % jitter, and without
// growing the backoff.
func TestBusyRefusalKeepsTheSlot(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Now())
	waits := make(chan time.Duration, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	go Reconnect(ctx, clk, func(context.Context, string) (string, bool, error) {
		n++
		if n == 1 {
			return "", false, errors.New("connection refused")
		}
		return "", false, &comeBack{after: 4 * time.Second, reason: "busy"}
	}, func(_ error, wait time.Duration) { waits <- wait })
	first := <-waits
	if first < 500*time.Millisecond || first > time.Second {
		t.Errorf("first failure waits %s, want 0.5–1 s", first)
	}
	for !clk.HasWaiters() {
		time.Sleep(time.Millisecond)
	}
	clk.Step(first)
	if w := <-waits; w < 4*time.Second || w > 4*time.Second+500*time.Millisecond {
		t.Errorf("busy refusal waits %s, want its 4 s slot plus at most 10 %% jitter", w)
	}
}

// retries runs Reconnect over a session that fails as failed says, stepping
// the fake clock through each wait, and returns the waits until the clock
// has moved by d.
func retries(t *testing.T, d time.Duration, failed func(n int) (welcomed bool)) []time.Duration {
	t.Helper()
	refused := errors.New("dial tcp 10.96.0.10:9443: connect: connection refused")
	return retriesWith(t, d, func(n int) (bool, error) { return failed(n), refused })
}

// retriesWith is retries with the session's error of the caller's.
func retriesWith(t *testing.T, d time.Duration, failed func(n int) (welcomed bool, err error)) []time.Duration {
	t.Helper()
	clk := clocktesting.NewFakeClock(time.Now())
	start := clk.Now()
	waits := make(chan time.Duration)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	n := 0
	go Reconnect(ctx, clk, func(context.Context, string) (string, bool, error) {
		n++
		welcomed, err := failed(n)
		return "", welcomed, err
	}, func(_ error, wait time.Duration) { waits <- wait })
	var got []time.Duration
	for clk.Since(start) < d {
		w := <-waits
		got = append(got, w)
		for !clk.HasWaiters() {
			time.Sleep(time.Millisecond)
		}
		clk.Step(w)
	}
	return got
}

// At install the collectors start before the aggregator: a collector that
// has never been welcomed retries every few seconds for its first two
// minutes (one node was unheard 30–100 s after the others were in sync
// while its backoff grew to 30 s), then backs off as before; one that was
// welcomed once backs off to 30 s as before.
func TestFirstContactRetriesOften(t *testing.T) {
	var elapsed time.Duration
	for i, w := range retries(t, 4*time.Minute, func(int) bool { return false }) {
		if elapsed < 2*time.Minute && w > 4*time.Second {
			t.Errorf("retry %d, %s after start, never welcomed: waits %s, want at most 4 s", i, elapsed, w)
		}
		elapsed += w
		if elapsed > 3*time.Minute && w <= 4*time.Second {
			t.Errorf("retry %d, %s after start: still waits only %s; want the backoff to grow past first contact", i, elapsed, w)
		}
	}
	var longest time.Duration
	for _, w := range retries(t, time.Minute, func(n int) bool { return n == 1 }) {
		longest = max(longest, w)
	}
	if longest <= 8*time.Second {
		t.Errorf("a collector welcomed once waits at most %s within a minute of failures; want its backoff to grow toward 30 s", longest)
	}
}

// After an API server restart no replica leads for a while: a collector
// welcomed before is refused with when to come back (2–5 s) and comes
// back then, however long it lasts, instead of backing off toward 30 s
// and arriving after the new leader's allowance ran out (every node was
// CollectorMissing ~22 s after the API server restarted during the soak).
func TestNoLeaderRefusalComesBackWhenTold(t *testing.T) {
	refusal, err := HelloOutcome(&stream.Message{Type: stream.TypeReject, Reject: &stream.Reject{
		Reason: "this aggregator is not the leader and no leader is elected yet; retry shortly", RetryAfterSeconds: 3}})
	if refusal != "" || !IsBusy(err) {
		t.Fatalf("HelloOutcome of a refusal with a retry: %q, %v; want a come-back error", refusal, err)
	}
	var elapsed time.Duration
	ws := retriesWith(t, 2*time.Minute, func(n int) (bool, error) { return n == 1, err })
	for i, w := range ws {
		if i > 0 && (w < 3*time.Second || w > 3*time.Second+400*time.Millisecond) {
			t.Errorf("retry %d, %s after start: waits %s, want 3 s and a little jitter", i, elapsed, w)
		}
		elapsed += w
	}
	if len(ws) < 30 {
		t.Errorf("%d retries in two minutes, want one every ~3 s", len(ws))
	}
}
