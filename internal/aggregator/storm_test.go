package aggregator

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// kinds records every notice by node.
type kinds struct {
	mu  sync.Mutex
	all []remediate.Notice
}

func (k *kinds) Notify(n remediate.Notice) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.all = append(k.all, n)
}

func (k *kinds) count(node string, kind remediate.ActionKind) (same, others int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, n := range k.all {
		if n.Node == node && n.Kind == kind {
			same++
		} else {
			others++
		}
	}
	return same, others
}

// A storm (most nodes drifting at once: the API's or the aggregator's
// fault far more often than the nodes') is one page for the fleet, and no
// node is marked: before, 8 drifted nodes of 10 were 8 pages and 8
// KubeProxyRulesStale conditions, which NHC or draino could act on across
// the fleet. When it is over, one page says so.
func TestStormIsOnePageAndMarksNoNode(t *testing.T) {
	client := fakeCluster()
	h := startWith(t, 2*time.Second, InsecureNoAuth{}, client, nil)
	rec := &kinds{}
	ex := &effect.Executor{Client: client, Policy: remediate.DefaultPolicy(), Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t)}
	h.agg.cfg.Remediation = &Remediation{Policy: remediate.DefaultPolicy(), Executor: ex}
	ctx := context.Background()
	var names []string
	for i := range 7 {
		name := fmt.Sprintf("storm-%d", i)
		names = append(names, name)
		if _, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	h.until(10*time.Second, "the new nodes in the view", func() bool { return len(h.agg.view.ExpectedNodes()) == 10 })
	var drift atomic.Bool
	drift.Store(true)
	for i, name := range append([]string{"n1", "n2", "n3"}, names...) {
		h.collector(h.ctx, name, func() *audit.Observed {
			if i >= 2 && drift.Load() { // 8 of 10 drift
				return rules(t, 0)
			}
			return rules(t)
		})
	}
	h.until(20*time.Second, "the storm paged", func() bool {
		n, _ := rec.count(remediate.SelfNode, remediate.Storm)
		return n == 1
	})
	// Let the storm last: evaluations go on, nothing more is sent.
	h.advance(10*time.Second, nil)
	if n, others := rec.count(remediate.SelfNode, remediate.Storm); n != 1 || others != 0 {
		t.Fatalf("%d storm pages and %d other notices during the storm, want 1 and 0", n, others)
	}
	nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes.Items {
		for _, c := range n.Status.Conditions {
			if c.Type == remediate.ConditionType && c.Status == corev1.ConditionTrue {
				t.Errorf("node %s marked %s during the storm: %s", n.Name, c.Reason, c.Message)
			}
		}
		if _, ok := n.Annotations[remediate.AnnotationStage]; ok {
			t.Errorf("node %s has an incident during the storm: %v", n.Name, n.Annotations)
		}
	}
	drift.Store(false)
	h.until(20*time.Second, "the storm over", func() bool {
		n, _ := rec.count(remediate.SelfNode, remediate.StormOver)
		return n == 1
	})
}
