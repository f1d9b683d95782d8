package effect

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// pages counts notices by kind.
type pages struct{ kinds []remediate.ActionKind }

func (p *pages) Notify(n remediate.Notice) { p.kinds = append(p.kinds, n.Kind) }

// rounds runs the planner and the executor as the aggregator does, once a
// second, over one drifted node.
func rounds(t *testing.T, ex *Executor, clk *clocktesting.FakeClock, p remediate.Policy, n int, exempt string) []remediate.ActionKind {
	t.Helper()
	var acted []remediate.ActionKind
	for range n {
		node, err := ex.Client.CoreV1().Nodes().Get(context.Background(), "node-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		fleet := remediate.Fleet{Nodes: []remediate.Node{{Name: "node-a", Drifted: true, Summary: "StuckProxy: test", Exempt: exempt,
			Unschedulable: node.Spec.Unschedulable, Incident: ex.Incident(node)}}}
		actions := remediate.Plan(clk.Now(), p, fleet)
		for _, a := range actions {
			acted = append(acted, a.Kind)
		}
		_ = ex.Execute(context.Background(), actions, nil)
		clk.Step(time.Second)
	}
	return acted
}

func proxyNode() []runtime.Object {
	return []runtime.Object{
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-a", UID: "u1", Labels: map[string]string{"k8s-app": "kube-proxy"}},
			Spec: corev1.PodSpec{NodeName: "node-a"}},
	}
}

// A page whose incident cannot be written is still one page: before, the
// planner saw no incident and paged again every round (10 in 10).
func TestFailedIncidentRecordPagesOnce(t *testing.T) {
	client := fake.NewClientset(proxyNode()...)
	client.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("etcd is unhappy")
	})
	clk := clocktesting.NewFakeClock(time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC))
	p := remediate.DefaultPolicy()
	p.Mode = remediate.Restart
	rec := &pages{}
	ex := &Executor{Client: client, Policy: p, Notifier: rec, Clock: clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy"}
	if acted := rounds(t, ex, clk, p, 10, "label x"); len(acted) != 1 || len(rec.kinds) != 1 {
		t.Errorf("10 rounds with the record failing: actions %v, notices %v; want one page", acted, rec.kinds)
	}
}

// A restart whose pod delete fails is taken back: the next round restarts
// again. Before, the incident said "restarted" and, the node still
// drifting after the recheck, the ladder cordoned it without a restart.
func TestFailedRestartIsRetriedNotEscalated(t *testing.T) {
	client := fake.NewClientset(proxyNode()...)
	failures := 1
	client.PrependReactor("delete", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, errors.New("the API server timed out")
		}
		return false, nil, nil
	})
	clk := clocktesting.NewFakeClock(time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC))
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxShare, p.Cooldown = remediate.RestartAndCordon, 1, 0
	ex := &Executor{Client: client, Policy: p, Notifier: &pages{}, Clock: clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy"}
	first := rounds(t, ex, clk, p, 1, "")
	clk.Step(p.Recheck + time.Second) // long enough for the ladder to judge a restart
	second := rounds(t, ex, clk, p, 1, "")
	if len(first) != 1 || first[0] != remediate.RestartProxy || len(second) != 1 || second[0] != remediate.RestartProxy {
		t.Fatalf("a failed restart, then: %v; want RestartProxy, then RestartProxy again", append(first, second...))
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(context.Background(), "kube-proxy-a", metav1.GetOptions{}); err == nil {
		t.Error("the kube-proxy pod was not deleted on the retry")
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-a", metav1.GetOptions{})
	if inc := remediate.IncidentFromAnnotations(node.Annotations); inc.Stage != remediate.StageRestarted || len(inc.Restarts) != 1 {
		t.Errorf("incident after the retry: %+v, want restarted once", inc)
	}
}
