package aggregator

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap/zaptest"
	"k8s.io/apimachinery/pkg/runtime"
	k8stesting "k8s.io/client-go/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// TestSlowRepairHoldsNoFinding: a remediation round waiting on the API
// (here its kube-proxy pod lookup hangs) must not hold back the verdict.
// Rounds once ran inside the evaluation: at 5,000 simulated nodes with 50
// stuck, one took 30 s and no finding of any node was published
// meanwhile. Once the API answers, the round goes on with the newest
// verdict, and rounds never overlap.
func TestSlowRepairHoldsNoFinding(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := fakeCluster()
		release := make(chan struct{})
		var lookups, inFlight, overlapped atomic.Int32
		client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
			lookups.Add(1)
			if inFlight.Add(1) > 1 {
				overlapped.Store(1)
			}
			defer inFlight.Add(-1)
			select { // bounded: a round run inside the evaluation would hang it
			case <-release:
			case <-time.After(10 * time.Second):
			}
			return false, nil, nil // the fake's own answer: no kube-proxy pod
		})
		h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
		defer close(release)
		rec := &notes{open: map[string]bool{}}
		ex := &effect.Executor{Client: client, Policy: remediate.DefaultPolicy(), Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t)}
		h.agg.cfg.Remediation = &Remediation{Policy: remediate.DefaultPolicy(), Executor: ex}
		ctx, cancel := context.WithCancel(h.ctx)
		defer cancel()

		var n2drifts atomic.Bool
		h.collector(ctx, "n1", func() *audit.Observed { return rules(t, 0) })
		h.collector(ctx, "n2", func() *audit.Observed {
			if n2drifts.Load() {
				return rules(t, 1)
			}
			return rules(t)
		})
		h.collector(ctx, "n3", func() *audit.Observed { return rules(t) })
		has := func(node string) bool {
			for _, f := range h.verdict().Findings {
				if f.Node == node {
					return true
				}
			}
			return false
		}
		h.until(20*time.Second, "n1's drift found and its repair round waiting on the API", func() bool {
			return has("n1") && inFlight.Load() == 1
		})
		// n2 drifts while n1's round waits: its finding must come at grace,
		// not when the API answers.
		n2drifts.Store(true)
		took := h.until(20*time.Second, "n2's drift found", func() bool { return has("n2") })
		if inFlight.Load() != 1 || lookups.Load() != 1 {
			t.Fatalf("the round was expected to still wait on its first lookup (in flight %d, lookups %d)", inFlight.Load(), lookups.Load())
		}
		t.Logf("n2's drift found %s (clock) after it began, while n1's round waited on the API", took)
		// The API answers: the rounds go on, with the newest verdict, and the
		// drifted nodes are handled (no kube-proxy pod: paged).
		for range 2 {
			release <- struct{}{}
		}
		h.until(20*time.Second, "both drifted nodes paged", func() bool {
			rec.mu.Lock()
			defer rec.mu.Unlock()
			return rec.open["n1"] && rec.open["n2"]
		})
		if overlapped.Load() != 0 {
			t.Fatal("two remediation rounds ran at once")
		}
	})
}
