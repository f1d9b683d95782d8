package live

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// Two replicas that both believe they lead (the old one has not yet
// noticed it lost the Lease) race to repair two drifted nodes with room
// for one. On the real API server the record's compare-and-swap lets
// exactly one restart through, whichever writes first, and once the new
// leader has written, the old term is fenced out entirely. Before, each
// counted the budget from a list of Nodes and patched without a
// resourceVersion: both restarted.
func TestE2EIncidentRecordFencing(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const rns = "pa-fence"
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	// No controller manager here makes the namespace's default account.
	if _, err := c.Client.CoreV1().ServiceAccounts(rns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	nodes := []string{"pa-fence-a", "pa-fence-b"}
	for _, n := range nodes {
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			_ = c.Client.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{})
		}
		_ = c.Client.CoreV1().Namespaces().Delete(context.Background(), rns, metav1.DeleteOptions{})
	})
	zero := int64(0)
	pods := func() (gone int) {
		for _, n := range nodes {
			p, err := c.Client.CoreV1().Pods(rns).Get(ctx, "kube-proxy-"+n, metav1.GetOptions{})
			if apierrors.IsNotFound(err) || err == nil && p.DeletionTimestamp != nil {
				gone++
			} else if err != nil {
				t.Fatal(err)
			}
		}
		return gone
	}
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxConcurrent, p.MaxUnhealthy, p.BreakerWindow = remediate.Restart, 1, remediate.MustBudget("100%"), 0
	clk := clock.RealClock{}
	replica := func(term int64) *effect.Executor {
		return &effect.Executor{Client: c.Client, Policy: p, Clock: clk, Log: zaptest.NewLogger(t), ProxyNamespace: rns, ProxySelector: "k8s-app=kube-proxy",
			Incidents: &effect.Incidents{Client: c.Client, Namespace: rns, Name: "incidents"}, Lead: func() (int64, bool) { return term, true }}
	}
	plan := func(ex *effect.Executor, drifted string) []remediate.Action {
		if err := ex.Load(ctx); err != nil {
			t.Fatal(err)
		}
		var f remediate.Fleet
		for _, n := range nodes {
			f.Nodes = append(f.Nodes, remediate.Node{Name: n, Drifted: n == drifted, Healthy: n != drifted, Summary: "StuckProxy: test", Incident: ex.Incident(n)})
		}
		return remediate.Plan(clk.Now(), p, f)
	}
	for round := range 10 {
		_ = c.Client.CoreV1().ConfigMaps(rns).Delete(ctx, "incidents", metav1.DeleteOptions{})
		for _, n := range nodes {
			_ = c.Client.CoreV1().Pods(rns).Delete(ctx, "kube-proxy-"+n, metav1.DeleteOptions{GracePeriodSeconds: &zero})
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: rns, Name: "kube-proxy-" + n, Labels: map[string]string{"k8s-app": "kube-proxy"}},
				Spec: corev1.PodSpec{NodeName: n, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
			for {
				_, err := c.Client.CoreV1().Pods(rns).Create(ctx, pod, metav1.CreateOptions{})
				if err == nil {
					break
				}
				if !apierrors.IsAlreadyExists(err) || ctx.Err() != nil {
					t.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond) // the forced delete is finishing
			}
		}
		old, cur := replica(1), replica(2)
		oldActs, curActs := plan(old, nodes[0]), plan(cur, nodes[1])
		start := make(chan struct{})
		done := make(chan error, 2)
		for _, r := range []struct {
			ex   *effect.Executor
			acts []remediate.Action
		}{{old, oldActs}, {cur, curActs}} {
			go func() { <-start; done <- r.ex.Execute(ctx, r.acts, nil) }()
		}
		close(start)
		errOld, errCur := <-done, <-done
		if got := pods(); got != 1 {
			t.Fatalf("round %d: %d kube-proxy pods deleted with room for one (errors: %v; %v)", round, got, errOld, errCur)
		}
		// The new leader has written: the old one may do nothing more.
		if err := old.Load(ctx); err != nil {
			t.Fatal(err)
		}
		inc := old.Incident(nodes[1])
		inc.Stage = remediate.StageEscalated
		page := remediate.Action{Kind: remediate.Page, Node: nodes[1], Reason: "still drifted", Incident: inc}
		if err := old.Execute(ctx, []remediate.Action{page}, nil); !errors.Is(err, effect.ErrFenced) {
			t.Fatalf("round %d: the old leader acted after the new one wrote: %v", round, err)
		}
	}
}
