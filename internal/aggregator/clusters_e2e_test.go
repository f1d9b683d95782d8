package aggregator

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/promtool"
)

// One Prometheus (Thanos, Mimir) holding two clusters' series, each with
// its aggregator pods named alike: the alerts fire per cluster, with the
// cluster's label, and ignore followers; the dashboard's queries evaluate
// for one cluster, the other and both (no join matches across clusters),
// and show only the cluster chosen.
func TestAlertsAndDashboardAcrossClusters(t *testing.T) {
	bin, rel := chartAndPromtool(t, "metrics.prometheusRule.enabled=true", "metrics.grafanaDashboard.enabled=true")
	pr := rel.Find("PrometheusRule", "proxyaudit-aggregator")
	cm := rel.Find("ConfigMap", "proxyaudit-aggregator-dashboard")
	if pr == nil || cm == nil {
		t.Fatal("no PrometheusRule or dashboard")
	}
	pod := func(cluster, p string, more string) string {
		return `{cluster="` + cluster + `",namespace="proxyaudit",pod="proxyaudit-aggregator-` + p + `"` + more + `}`
	}
	series := []promtool.Series{
		{Series: "proxyaudit_leader" + pod("eu", "0", ""), Values: "1x20"},
		{Series: "proxyaudit_leader" + pod("eu", "1", ""), Values: "0x20"},
		{Series: "proxyaudit_leader" + pod("us", "0", ""), Values: "1x20"},
		{Series: "proxyaudit_leader" + pod("us", "1", ""), Values: "0x20"},
		// us has a stuck kube-proxy; eu's follower still shows an old one.
		{Series: "proxyaudit_findings" + pod("us", "0", `,kind="StuckProxy"`), Values: "1x20"},
		{Series: "proxyaudit_findings" + pod("eu", "0", `,kind="StuckProxy"`), Values: "0x20"},
		{Series: "proxyaudit_findings" + pod("eu", "1", `,kind="StuckProxy"`), Values: "2x20"},
		{Series: "proxyaudit_nodes" + pod("eu", "0", `,state="InSync"`), Values: "3x20"},
		{Series: "proxyaudit_nodes" + pod("eu", "1", `,state="InSync"`), Values: "7x20"},
		{Series: "proxyaudit_nodes" + pod("us", "0", `,state="InSync"`), Values: "4x20"},
		{Series: "proxyaudit_nodes" + pod("us", "0", `,state="Stuck"`), Values: "1x20"},
		{Series: "proxyaudit_view_stale" + pod("eu", "0", ""), Values: "0x20"},
		{Series: "proxyaudit_view_stale" + pod("us", "0", ""), Values: "0x20"},
	}
	spec, _ := json.Marshal(pr.Object["spec"])
	rules, err := promtool.Alerts(spec)
	if err != nil {
		t.Fatal(err)
	}
	alerts := []promtool.AlertTest{
		{EvalTime: "3m", AlertName: "ProxyAuditKubeProxyStuck", ExpAlerts: []promtool.ExpAlert{rules["ProxyAuditKubeProxyStuck"].Expect("1", "cluster", "us")}},
		{EvalTime: "3m", AlertName: "ProxyAuditNoLeader"},
		{EvalTime: "3m", AlertName: "ProxyAuditViewStale"},
	}
	// The dashboard: every query evaluates with each choice of cluster,
	// and the fleet's states show the cluster chosen only (the leader's
	// gauges, not the follower's).
	var exprs []promtool.ExprTest
	for _, p := range dashboardOf(t, cm).Panels {
		for _, tg := range p.Targets {
			for _, c := range []string{"eu", "us", ".*"} {
				q := strings.NewReplacer("$namespace", "proxyaudit", "$cluster", c).Replace(tg.Expr)
				if !strings.Contains(tg.Expr, `cluster=~"$cluster"`) {
					t.Errorf("panel %q ignores the cluster chosen: %s", p.Title, tg.Expr)
				}
				exprs = append(exprs, promtool.ExprTest{EvalTime: "3m", Expr: "(count(" + q + ") or vector(0)) >= bool 0",
					Samples: []promtool.Sample{{Labels: "{}", Value: 1}}})
				if p.Title == "Nodes by state" {
					want := map[string][]promtool.Sample{
						"eu": {{Labels: `{state="InSync"}`, Value: 3}},
						"us": {{Labels: `{state="InSync"}`, Value: 4}, {Labels: `{state="Stuck"}`, Value: 1}},
						".*": {{Labels: `{state="InSync"}`, Value: 7}, {Labels: `{state="Stuck"}`, Value: 1}},
					}[c]
					exprs = append(exprs, promtool.ExprTest{EvalTime: "3m", Expr: q, Samples: want})
				}
			}
		}
	}
	ut := promtool.UnitTest{EvaluationInterval: "15s", Tests: []promtool.Test{{Interval: "15s", InputSeries: series, Alerts: alerts, Exprs: exprs}}}
	if out, err := promtool.TestRules(bin, t.TempDir(), spec, ut); err != nil {
		t.Fatalf("promtool test rules over two clusters' series: %v\n%s", err, out)
	}
	t.Logf("%d dashboard evaluations over two clusters, alerts per cluster", len(exprs))
}
