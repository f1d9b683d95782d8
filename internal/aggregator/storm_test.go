package aggregator

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
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

func (k *kinds) count(node string, kind remediate.ActionKind) int {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := 0
	for _, x := range k.all {
		if x.Node == node && x.Kind == kind {
			n++
		}
	}
	return n
}

// since is every notice from index i on, and how many there are now.
func (k *kinds) since(i int) ([]remediate.Notice, int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]remediate.Notice(nil), k.all[min(i, len(k.all)):]...), len(k.all)
}

// A storm (most nodes drifting at once: the API's or the aggregator's
// fault far more often than the nodes') is one page for the fleet, and no
// node is marked: before, 8 drifted nodes of 10 were 8 pages and 8
// KubeProxyRulesStale conditions, which NHC or draino could act on across
// the fleet. When it is over, one page says so.
func TestStormIsOnePageAndMarksNoNode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := fakeCluster()
		h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
		rec := &kinds{}
		// Out of dry-run, so that conditions and incidents would be written.
		p := remediate.DefaultPolicy()
		p.Mode = remediate.Restart
		ex := &effect.Executor{Client: client, Policy: p, Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy",
			Incidents: &effect.Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents"}}
		h.agg.cfg.Remediation = &Remediation{Policy: p, Executor: ex}
		h.agg.cfg.Notifier = rec // fleet notices
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
		h.until(20*time.Second, "the storm paged", func() bool { return rec.count(remediate.SelfNode, remediate.Storm) == 1 })
		// Reports arrive one by one: nodes that crossed grace before enough
		// others did to make a storm were handled alone, as they should be.
		before, at := rec.since(0)
		paged := map[string]bool{}
		for _, x := range before {
			if x.Node != remediate.SelfNode {
				paged[x.Node] = true
			}
		}
		// The storm lasts: evaluations go on, and nothing more is sent.
		h.advance(10*time.Second, nil)
		if after, _ := rec.since(at); len(after) != 0 {
			t.Fatalf("%d notices during the storm, want none: %+v", len(after), after)
		}
		nodes, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		unmarked := 0
		if err := ex.Incidents.Load(ctx); err != nil {
			t.Fatal(err)
		}
		for _, n := range nodes.Items {
			if paged[n.Name] {
				continue
			}
			for _, c := range n.Status.Conditions {
				if c.Type == remediate.ConditionType && c.Status == corev1.ConditionTrue {
					t.Errorf("node %s marked %s during the storm: %s", n.Name, c.Reason, c.Message)
				}
			}
			if inc := ex.Incidents.Get(n.Name, h.clk.Now()); inc.Stage != "" {
				t.Errorf("node %s has an incident during the storm: %+v", n.Name, inc)
			}
			if n.Name != "n1" && n.Name != "n2" {
				unmarked++ // drifting, and left alone
			}
		}
		if unmarked < 1 {
			t.Fatalf("only %d drifting nodes were not handled before the storm formed: the test proves little", unmarked)
		}
		t.Logf("%d drifting nodes handled before the storm formed, %d left alone in it", len(paged), unmarked)
		drift.Store(false)
		h.until(20*time.Second, "the storm over", func() bool { return rec.count(remediate.SelfNode, remediate.StormOver) == 1 })
	})
}
