package aggregator

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth/authtest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// A follower sends a collector to the leader without reviewing its token:
// the redirect carries nothing secret.
func TestFollowerRedirectsBeforeReviewing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		client := authtest.ReviewingAPI(&reviews)
		ta := &auth.TokenReviewAuth{Client: client, Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"},
			Clock: clocktesting.NewFakeClock(time.Now())}
		h := start(t, 2*time.Second, ta)
		h.agg.StoppedLeading()
		h.agg.NewLeader("198.18.1.2:9443")
		for range 20 {
			c := h.dial("")
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n1", IntervalSeconds: 1,
				Token: authtest.JWT("proxyaudit", "n1", time.Now().Add(time.Hour))}})
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			m, _, err := stream.Read(c, 1<<20)
			if err != nil || m.Type != stream.TypeRedirect || m.Redirect.Leader != "198.18.1.2:9443" {
				t.Fatalf("follower answered %+v, %v", m, err)
			}
		}
		if n := reviews.Load(); n != 0 {
			t.Fatalf("a follower asked for %d TokenReviews before redirecting", n)
		}
		// The leader reviews (once per token: the reconnect is cached).
		h.agg.StartedLeading()
		for range 2 {
			c := h.dial("")
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n1", IntervalSeconds: 1,
				Token: authtest.JWT("proxyaudit", "n1", time.Unix(4_000_000_000, 0))}})
			expect(t, c, stream.TypeWelcome, "")
		}
		if n := reviews.Load(); n != 1 {
			t.Fatalf("the leader asked for %d reviews of one token", n)
		}
	})
}

// A fleet reconnecting at once (the leader died) is admitted at the
// budget's rate: those the budget cannot take yet are told when to come
// back, which costs the API server nothing, and every token is reviewed
// exactly once.
func TestFleetReconnectPacedByBudget(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		const fleet, qps, burst = 60, 20, 5
		ta := &auth.TokenReviewAuth{Client: authtest.ReviewingAPI(&reviews), Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"},
			Clock: clocktesting.NewFakeClock(time.Now()), Budget: auth.NewBudget(qps, burst, 0, 0), BudgetWait: 100 * time.Millisecond}
		h := start(t, 2*time.Second, ta)
		start := time.Now()
		var (
			wg         sync.WaitGroup
			busy       atomic.Int32
			maxRetry   atomic.Int64
			admittedAt = make([]time.Duration, fleet)
		)
		for i := range fleet {
			wg.Add(1)
			go func() {
				defer wg.Done()
				node := fmt.Sprintf("n%d", i+1)
				token := authtest.JWT("proxyaudit", node, time.Now().Add(time.Hour))
				for attempt := 0; ; attempt++ {
					c := h.dial("")
					stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, IntervalSeconds: 1, Token: token}})
					c.SetReadDeadline(time.Now().Add(10 * time.Second))
					m, _, err := stream.Read(c, 1<<20)
					c.Close()
					switch {
					case err != nil:
						t.Errorf("%s: %v", node, err)
						return
					case m.Type == stream.TypeWelcome:
						admittedAt[i] = time.Since(start)
						return
					case m.Type == stream.TypeReject && m.Reject.RetryAfterSeconds > 0 && attempt < 50:
						busy.Add(1)
						after := time.Duration(m.Reject.RetryAfterSeconds * float64(time.Second))
						if int64(after) > maxRetry.Load() {
							maxRetry.Store(int64(after))
						}
						time.Sleep(after + time.Duration(rand.Int64N(int64(after)/10+int64(100*time.Millisecond)))) // as the collector does
					default:
						t.Errorf("%s: answered %+v", node, m.Reject)
						return
					}
				}
			}()
		}
		wg.Wait()
		took := slices.Max(admittedAt)
		t.Logf("%d collectors admitted in %s at %d reviews/s: %d busy refusals (longest retry-after %s), %d reviews",
			fleet, took.Round(10*time.Millisecond), qps, busy.Load(), time.Duration(maxRetry.Load()), reviews.Load())
		if n := reviews.Load(); n != fleet {
			t.Errorf("%d TokenReviews for %d collectors: a refusal must cost none, an admission one", n, fleet)
		}
		if busy.Load() == 0 {
			t.Errorf("no collector was told to come back: the budget did not bind")
		}
		// Each refused collector was given a slot of its own: it is refused
		// about once, not again and again with a herd that came back together.
		if n := busy.Load(); n > fleet {
			t.Errorf("%d busy refusals for %d collectors: the refused came back as a herd", n, fleet)
		}
		// The budget admits the burst at once, then qps a second; coming
		// back at the slot told (with the collector's jitter), the fleet is in
		// a little after that pace (and never faster than the budget).
		ideal := time.Duration(float64(fleet-burst) / qps * float64(time.Second))
		if took < ideal*8/10 || took > ideal*14/10+500*time.Millisecond {
			t.Errorf("fleet admitted in %s; the budget's pace is %s", took, ideal)
		}
	})
}
