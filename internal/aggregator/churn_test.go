package aggregator

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// notes records notices and forgotten nodes, as Slack would keep threads.
type notes struct {
	mu      sync.Mutex
	open    map[string]bool
	forgot  int
	noticed int
}

func (n *notes) Notify(x remediate.Notice) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.noticed++
	n.open[x.Node] = x.Kind != remediate.Resolve
}

func (n *notes) Forget(node string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.forgot++
	delete(n.open, node)
}

// Node churn (an autoscaler replacing nodes under unique names) leaves
// nothing behind: a node deleted and silent is dropped by the aggregator,
// the judge, the executor and the notifier, even one deleted in the middle
// of an incident.
func TestNodeChurnLeavesNothingBehind(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := fakeCluster()
		h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
		rec := &notes{open: map[string]bool{}}
		ex := &effect.Executor{Client: client, Policy: remediate.DefaultPolicy(), Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t)}
		h.agg.cfg.Remediation = &Remediation{Policy: remediate.DefaultPolicy(), Executor: ex}
		ctx := context.Background()
		const generations, size = 5, 30
		peak := 0
		for g := range generations {
			var names []string
			for i := range size {
				name := fmt.Sprintf("churn-%d-%d", g, i)
				names = append(names, name)
				if _, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			h.until(10*time.Second, "the new nodes in the view", func() bool {
				return len(h.agg.view.ExpectedNodes()) == 3+size
			})
			gctx, stop := context.WithCancel(h.ctx)
			for i, name := range names {
				// A third of them drift: an incident opens on each.
				var drop []int
				if i%3 == 0 {
					drop = []int{0}
				}
				h.collector(gctx, name, func() *audit.Observed { return rules(t, drop...) })
			}
			// Keep the streams reporting while grace passes.
			h.until(10*time.Second, "the drifted nodes' incidents", func() bool {
				rec.mu.Lock()
				defer rec.mu.Unlock()
				open := 0
				for _, o := range rec.open {
					if o {
						open++
					}
				}
				return open >= size/3
			})
			peak = max(peak, ex.Remembered())
			// The autoscaler removes them all, drifted or not.
			stop()
			for _, name := range names {
				if err := client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
			}
			h.until(10*time.Second, "the deleted nodes out of the view", func() bool {
				return len(h.agg.view.ExpectedNodes()) == 3
			})
			h.until(30*time.Second, "the deleted nodes forgotten", func() bool {
				h.agg.mu.Lock()
				defer h.agg.mu.Unlock()
				return len(h.agg.fleet.nodes) == 0
			})
		}
		if peak < size/3 {
			t.Fatalf("the executor remembered at most %d nodes: the test opened no incidents to forget", peak)
		}
		h.agg.Evaluate()
		judged := []string{}
		for _, s := range h.verdict().Nodes {
			judged = append(judged, s.Node)
		}
		if !slices.Equal(judged, []string{"n1", "n2", "n3"}) {
			t.Errorf("judged nodes after the churn: %v, want only the cluster's n1..n3", judged)
		}
		if n := ex.Remembered(); n != 0 {
			t.Errorf("the executor still remembers %d deleted nodes", n)
		}
		rec.mu.Lock()
		defer rec.mu.Unlock()
		if rec.forgot != generations*size || len(rec.open) != 0 {
			t.Errorf("notifier told to forget %d of %d nodes; %d threads left open: %v", rec.forgot, generations*size, len(rec.open), rec.open)
		}
	})
}
