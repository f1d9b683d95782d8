package aggregator

import (
	"context"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// A pause holds every repair of a drifted node: it is paged, saying who
// paused and why, its kube-proxy pod is left alone, and the API and the
// metric say repairs are held. Resumed, the node's open incident is
// repaired.
func TestPauseHoldsRepairsAndSaysSo(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		client := fakeCluster()
		h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
		ctx := context.Background()
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-n3", Labels: map[string]string{"k8s-app": "kube-proxy"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "kube-proxy", UID: "ds"}}},
			Spec: corev1.PodSpec{NodeName: "n3"}}
		if _, err := client.CoreV1().Pods("kube-system").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		req := remediate.PauseRequest{By: "alice@example.com", Reason: "kube-proxy rollout", Since: h.clk.Now()}
		if _, err := client.CoreV1().ConfigMaps("proxyaudit").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-pause"},
			Data: req.Data()}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		rec := &kinds{}
		p := remediate.DefaultPolicy()
		p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
		ex := &effect.Executor{Client: client, Policy: p, Notifier: rec, Clock: h.clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy",
			Incidents: &effect.Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents"}}
		pause := &effect.Pause{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-pause", MaxAge: 5 * time.Second, Clock: h.clk}
		h.agg.cfg.Remediation = &Remediation{Policy: p, Executor: ex, Pause: pause}
		for _, name := range []string{"n1", "n2", "n3"} {
			h.collector(h.ctx, name, func() *audit.Observed {
				if name == "n3" {
					return rules(t, 0)
				}
				return rules(t)
			})
		}
		h.until(20*time.Second, "n3 paged, held by the pause", func() bool { return rec.count("n3", remediate.Page) == 1 })
		all, _ := rec.since(0)
		for _, x := range all {
			if x.Node == "n3" && !strings.Contains(x.Reason, "not repaired: remediation paused by alice@example.com since") ||
				!strings.Contains(x.Reason, "kube-proxy rollout") {
				t.Errorf("page: %s", x.Reason)
			}
		}
		h.advance(5*time.Second, nil)
		if rec.count("n3", remediate.RestartProxy) != 0 {
			t.Fatal("restarted while paused")
		}
		if _, err := client.CoreV1().Pods("kube-system").Get(ctx, "kube-proxy-n3", metav1.GetOptions{}); err != nil {
			t.Fatalf("the kube-proxy pod was touched while paused: %v", err)
		}
		srvURL, hc := h.net.HTTPServer(t, h.agg.Handler("0"))
		var fr api.FindingsResponse
		getJSON(t, hc, srvURL+"/api/v1/findings", &fr)
		if !strings.Contains(fr.RemediationHold, "paused by alice@example.com") {
			t.Errorf("the API's remediationHold: %q", fr.RemediationHold)
		}
		if v := testutil.ToFloat64(h.agg.cfg.Metrics.Held.WithLabelValues("paused")); v != 1 {
			t.Errorf("proxyaudit_remediation_held{why=paused} = %v", v)
		}

		// Resumed (as proxyaudit resume leaves it: empty): repaired.
		if _, err := client.CoreV1().ConfigMaps("proxyaudit").Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-pause"}},
			metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		h.until(20*time.Second, "n3 restarted once resumed", func() bool { return rec.count("n3", remediate.RestartProxy) == 1 })
		if v := testutil.ToFloat64(h.agg.cfg.Metrics.Held.WithLabelValues("paused")); v != 0 || h.agg.RemediationHold() != "" {
			t.Errorf("resumed, yet held: metric %v, %q", v, h.agg.RemediationHold())
		}
	})
}
