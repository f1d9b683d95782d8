package chart_test

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/promtool"
)

// Every alert of the chart's PrometheusRule, evaluated by Prometheus's own
// rule engine (promtool, built from Prometheus's Go module) over series
// shaped as a leader's and a follower's /metrics are scraped: each fires
// after its "for" with the labels and the annotations it promises, and
// the gauges a follower still exports (findings from before it lost the
// Lease) are left out by the join on proxyaudit_leader.
func TestPrometheusRulesInPromtool(t *testing.T) {
	skipShort(t)
	bin, err := promtool.Binary(root(t))
	if err != nil {
		t.Fatal(err)
	}
	r := render(t, nil, "metrics.prometheusRule.enabled=true")
	pr := r.Find("PrometheusRule", "proxyaudit-aggregator")
	if pr == nil {
		t.Fatalf("no PrometheusRule in %v", r.Kinds())
	}
	spec, _ := json.Marshal(pr.Object["spec"])
	rules, err := promtool.Alerts(spec)
	if err != nil {
		t.Fatal(err)
	}
	expect := func(name, value string) []promtool.ExpAlert {
		r, ok := rules[name]
		if !ok {
			t.Fatalf("the chart has no alert %s", name)
		}
		return []promtool.ExpAlert{r.Expect(value)}
	}
	gauge := func(metric, pod, values string, labels ...string) promtool.Series {
		s := fmt.Sprintf(`%s{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator"`, metric, pod)
		for i := 0; i+1 < len(labels); i += 2 {
			s += fmt.Sprintf(",%s=%q", labels[i], labels[i+1])
		}
		return promtool.Series{Series: s + "}", Values: values}
	}
	leader := func(pod, values string) promtool.Series { return gauge("proxyaudit_leader", pod, values) }
	finding := func(pod, kind, values string) promtool.Series {
		return gauge("proxyaudit_findings", pod, values, "kind", kind)
	}
	// agg-0 leads; agg-1 follows and still exports what it found when it
	// led (5 of every kind).
	replicas := []promtool.Series{leader("agg-0", "1x90"), leader("agg-1", "0x90")}
	findingTest := func(alert, kind string, forMinutes int, value string) promtool.Test {
		in := append(append([]promtool.Series(nil), replicas...), finding("agg-0", kind, "0 0 "+value+"x88"), finding("agg-1", kind, "5x90"))
		return promtool.Test{Name: alert, Interval: "1m", InputSeries: in, Alerts: []promtool.AlertTest{
			{EvalTime: "2m", AlertName: alert}, // the leader's gauge just rose: pending
			{EvalTime: fmt.Sprintf("%dm", 3+forMinutes), AlertName: alert, ExpAlerts: expect(alert, value)},
		}}
	}
	followerOnly := promtool.Test{Name: "a follower's gauges alone fire nothing", Interval: "1m",
		InputSeries: append(append([]promtool.Series(nil), replicas...), finding("agg-1", "StuckProxy", "5x90"), finding("agg-0", "StuckProxy", "0x90")),
		Alerts:      []promtool.AlertTest{{EvalTime: "30m", AlertName: "ProxyAuditKubeProxyStuck"}}}
	stale := func(pod, values string) promtool.Series { return gauge("proxyaudit_view_stale", pod, values) }
	waiting := func(pod, values string) promtool.Series {
		return gauge("proxyaudit_stream_reports_waiting", pod, values)
	}
	expiry := func(pod, values string) promtool.Series {
		return gauge("proxyaudit_tls_certificate_expiry_timestamp_seconds", pod, values)
	}
	ut := promtool.UnitTest{EvaluationInterval: "1m", Tests: []promtool.Test{
		findingTest("ProxyAuditKubeProxyStuck", "StuckProxy", 1, "1"),
		findingTest("ProxyAuditNodesDrifted", "StaleEndpoint", 2, "3"),
		findingTest("ProxyAuditStaleConntrack", "StaleConntrack", 2, "2"),
		findingTest("ProxyAuditCollectorsSilent", "CollectorMissing", 10, "4"),
		followerOnly,
		{Name: "ProxyAuditViewStale", Interval: "1m", InputSeries: []promtool.Series{stale("agg-0", "0x90"), stale("agg-1", "0 1x89")},
			Alerts: []promtool.AlertTest{{EvalTime: "1m", AlertName: "ProxyAuditViewStale"}, {EvalTime: "3m", AlertName: "ProxyAuditViewStale", ExpAlerts: expect("ProxyAuditViewStale", "1")}}},
		{Name: "ProxyAuditNoLeader, both replicas following", Interval: "1m", InputSeries: []promtool.Series{leader("agg-0", "1 1 0x88"), leader("agg-1", "0x90")},
			Alerts: []promtool.AlertTest{{EvalTime: "1m", AlertName: "ProxyAuditNoLeader"}, {EvalTime: "5m", AlertName: "ProxyAuditNoLeader", ExpAlerts: expect("ProxyAuditNoLeader", "0")}}},
		{Name: "ProxyAuditNoLeader, no replica scraped", Interval: "1m", InputSeries: []promtool.Series{stale("agg-0", "0x90")},
			Alerts: []promtool.AlertTest{{EvalTime: "5m", AlertName: "ProxyAuditNoLeader", ExpAlerts: expect("ProxyAuditNoLeader", "0")}}},
		{Name: "ProxyAuditLeaderBehind", Interval: "1m", InputSeries: []promtool.Series{waiting("agg-0", "0 0 150x88"), waiting("agg-1", "0x90")},
			Alerts: []promtool.AlertTest{{EvalTime: "4m", AlertName: "ProxyAuditLeaderBehind"}, {EvalTime: "8m", AlertName: "ProxyAuditLeaderBehind", ExpAlerts: expect("ProxyAuditLeaderBehind", "150")}}},
		// Expiring 8 days after the test's epoch; at 2h it has 7d 22h left.
		{Name: "ProxyAuditCertificateExpiring", Interval: "1m", InputSeries: []promtool.Series{expiry("agg-0", "691200x200"), expiry("agg-1", "9999999x200")},
			Alerts: []promtool.AlertTest{{EvalTime: "2h", AlertName: "ProxyAuditCertificateExpiring", ExpAlerts: expect("ProxyAuditCertificateExpiring", "7d 22h 0m 0s")}}},
	}}
	if len(rules) != 8 {
		t.Errorf("the chart has %d alerts; this test covers 8 (add the new one here)", len(rules))
	}
	if out, err := promtool.TestRules(bin, t.TempDir(), spec, ut); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}
