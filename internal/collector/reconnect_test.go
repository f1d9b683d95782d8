package collector

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
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
