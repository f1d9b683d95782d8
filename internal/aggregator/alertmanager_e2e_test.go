package aggregator

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
	"github.com/proxyaudit/proxyaudit/remediate/remediatetest"
)

// The stuck-node scenario with a genuine Alertmanager: the incident is an
// alert there and its receiver hears it fire; a silence on the node made
// through Alertmanager's API holds the restart (the node is paged saying
// who silenced it and why, the held-decisions metric counts it); the
// silence expired, the restart happens; the node back in sync, the alert
// ends and the receiver hears "resolved".
func TestAlertmanagerSilenceHoldsTheRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a genuine Alertmanager")
	}
	hook := remediatetest.NewWebhook(t, "127.0.0.1")
	am, err := localcluster.StartAlertmanager(context.Background(), t.TempDir(), "127.0.0.1", hook.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if t.Failed() {
			t.Logf("alertmanager:\n%s\nreceiver: %+v", am.Log(), hook.All())
		}
		am.Stop()
	}()
	ctx := context.Background()
	id, err := am.Silence(ctx, "alice@example.com", "n3 is being drained for a kernel upgrade", time.Hour,
		localcluster.Matcher{Name: "node", Value: "n3", IsEqual: true})
	if err != nil {
		t.Fatal(err)
	}

	client := fakeCluster()
	h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
	h.settle = realTime // Alertmanager is a process of its own, on real sockets and real time
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-n3", Labels: map[string]string{"k8s-app": "kube-proxy"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "kube-proxy", UID: "ds"}}},
		Spec: corev1.PodSpec{NodeName: "n3"}}
	if _, err := client.CoreV1().Pods("kube-system").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	rec := &kinds{}
	// Alertmanager keeps real time: the client's clock is the real one.
	amc, err := effect.NewAlertmanager(effect.AlertmanagerConfig{URLs: []string{am.URL}, Cluster: "e2e", MaxAge: time.Second, Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("-1")
	ex := &effect.Executor{Client: client, Policy: p, Notifier: effect.Fanout{rec, amc}, Clock: h.clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy",
		Incidents: &effect.Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents"}}
	h.agg.cfg.Remediation = &Remediation{Policy: p, Executor: ex, Alertmanager: amc}
	var restarted atomic.Bool // the restart cures n3
	for _, name := range []string{"n1", "n2", "n3"} {
		h.collector(h.ctx, name, func() *audit.Observed {
			if name == "n3" && !restarted.Load() {
				return rules(t, 0)
			}
			return rules(t)
		})
	}
	firing := map[string]string{"alertname": remediate.AlertName, "node": "n3", "cluster": "e2e", "kind": "Divergent", "severity": "warning"}
	h.until(time.Hour, "n3 paged, its restart held by the silence", func() bool { return rec.count("n3", remediate.Page) == 1 })
	all, _ := rec.since(0)
	for _, x := range all {
		if x.Node == "n3" && (!strings.Contains(x.Reason, "not repaired: silenced in Alertmanager by alice@example.com") || !strings.Contains(x.Reason, "kernel upgrade")) {
			t.Errorf("page: %s", x.Reason)
		}
	}
	h.until(time.Hour, "the receiver told n3's incident fires (while silenced, it is not: it waits)", func() bool {
		got, err := am.Alerts(ctx)
		return err == nil && len(got) == 1 && got[0].Status.State == "suppressed" && got[0].Labels["node"] == "n3"
	})
	if hook.Seen("firing", firing) {
		t.Error("the receiver was told of a silenced alert")
	}
	if v := testutil.ToFloat64(h.agg.cfg.Metrics.HeldDecisions.WithLabelValues(remediate.HeldSilenced)); v != 1 {
		t.Errorf("proxyaudit_remediation_held_decisions_total{why=silenced} = %v", v)
	}
	h.advance(5*time.Second, nil)
	if rec.count("n3", remediate.RestartProxy) != 0 {
		t.Fatal("restarted while silenced")
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(ctx, "kube-proxy-n3", metav1.GetOptions{}); err != nil {
		t.Fatalf("the kube-proxy pod was touched while silenced: %v", err)
	}

	// The silence lifted: the receiver hears the alert, and n3 is repaired.
	if err := am.Expire(ctx, id); err != nil {
		t.Fatal(err)
	}
	h.until(time.Hour, "n3 restarted once the silence expired", func() bool {
		time.Sleep(20 * time.Millisecond) // the silences' copy lives a real second
		return rec.count("n3", remediate.RestartProxy) == 1
	})
	// Alertmanager tells its receiver at its group's next flush; the
	// restarted kube-proxy syncs after that.
	h.until(time.Hour, "the receiver told n3's alert fires", func() bool { time.Sleep(20 * time.Millisecond); return hook.Seen("firing", firing) })
	restarted.Store(true)
	h.until(time.Hour, "n3 back in sync, its incident resolved", func() bool { return rec.count("n3", remediate.Resolve) == 1 })
	h.until(time.Hour, "the receiver told n3's alert resolved", func() bool {
		time.Sleep(20 * time.Millisecond)
		return hook.Seen("resolved", firing)
	})
	got, _ := am.Alerts(ctx)
	if len(got) != 0 {
		t.Errorf("still firing in Alertmanager: %+v", got)
	}
	if v := testutil.ToFloat64(h.agg.cfg.Metrics.HeldDecisions.WithLabelValues(remediate.HeldSilenced)); v != 1 {
		t.Errorf("proxyaudit_remediation_held_decisions_total{why=silenced} = %v after the repair", v)
	}
}
