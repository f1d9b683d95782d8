package collector

import (
	"testing"
	"time"
)

// The read budget as a bucket: full at the start, a burst of reads spends
// it without waiting, then reads wait their cost divided by the share;
// the debt kept is at most an interval's earnings, so a quiet spell of an
// interval makes the next read immediate however much was spent before.
func TestReadCredit(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	b := newReadCredit(0.05, 3*time.Second, 10*time.Second) // 5 %, a minute's burst
	if w := b.wait(at(0)); w != 0 {
		t.Fatalf("a full bucket waits %s", w)
	}
	// The anchors' legacy reads: 0.9 s each, one right after the other.
	b.spend(at(1*time.Second), 900*time.Millisecond)
	b.spend(at(2*time.Second), 900*time.Millisecond)
	b.spend(at(3*time.Second), 900*time.Millisecond)
	if w := b.wait(at(3 * time.Second)); w != 0 {
		t.Fatalf("three reads of 0.9 s after a quiet spell wait %s; the burst covers them", w)
	}
	b.spend(at(4*time.Second), 900*time.Millisecond)
	// Credit: 3 - 3.6 + 0.05×3 s = -0.45 s: 9 s to earn.
	if w := b.wait(at(4 * time.Second)); w < 8900*time.Millisecond || w > 9100*time.Millisecond {
		t.Fatalf("in debt of 0.45 s at 5 %%, wait %s; want 9 s", w)
	}
	// Debt beyond an interval's earnings (0.5 s) is forgotten.
	for i := range 10 {
		b.spend(at(5*time.Second+time.Duration(i)*time.Millisecond), 2*time.Second)
	}
	if w := b.wait(at(6 * time.Second)); w > 10*time.Second {
		t.Fatalf("a debt of 20 s of CPU waits %s; more than an interval", w)
	}
	if w := b.wait(at(16 * time.Second)); w != 0 {
		t.Fatalf("an interval after, still %s to wait", w)
	}
	// Refills stop at the burst.
	b.wait(at(time.Hour))
	if b.credit != 3*time.Second {
		t.Fatalf("credit %s after an hour; want the burst, 3 s", b.credit)
	}
	// Sustained churn: every read waits its cost over the share.
	now := at(time.Hour)
	b.spend(now, 3*time.Second) // the burst spent
	for range 5 {
		b.spend(now, 200*time.Millisecond)
		w := b.wait(now)
		if w < 3900*time.Millisecond || w > 4100*time.Millisecond {
			t.Fatalf("a read of 0.2 s under churn waits %s; want 4 s", w)
		}
		now = now.Add(w)
	}
}
