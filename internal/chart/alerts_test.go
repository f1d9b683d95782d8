package chart_test

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// promtoolUnitTest is a `promtool test rules` file (JSON is YAML).
type promtoolUnitTest struct {
	RuleFiles          []string       `json:"rule_files"`
	EvaluationInterval string         `json:"evaluation_interval"`
	Tests              []promtoolTest `json:"tests"`
}

type promtoolTest struct {
	Name        string      `json:"name"`
	Interval    string      `json:"interval"`
	InputSeries []series    `json:"input_series"`
	Alerts      []alertTest `json:"alert_rule_test"`
}

type series struct {
	Series string `json:"series"`
	Values string `json:"values"`
}

type alertTest struct {
	EvalTime  string     `json:"eval_time"`
	AlertName string     `json:"alertname"`
	ExpAlerts []expAlert `json:"exp_alerts"`
}

type expAlert struct {
	Labels      map[string]string `json:"exp_labels"`
	Annotations map[string]string `json:"exp_annotations"`
}

// rule is one alerting rule as the chart renders it.
type rule struct {
	Alert       string            `json:"alert"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

// Every alert of the chart's PrometheusRule, evaluated by Prometheus's own
// rule engine (promtool, built from Prometheus's Go module) over series
// shaped as a leader's and a follower's /metrics are scraped: each fires
// after its "for" with the labels and the annotations it promises, and
// the gauges a follower still exports (findings from before it lost the
// Lease) are left out by the join on proxyaudit_leader.
func TestPrometheusRulesInPromtool(t *testing.T) {
	skipShort(t)
	out, err := exec.Command(filepath.Join(root(t), "deploy/k8s-tools/promtool.sh")).Output()
	if err != nil {
		t.Fatalf("building promtool: %v", err)
	}
	promtool := strings.TrimSpace(string(out))
	r := render(t, nil, "metrics.prometheusRule.enabled=true")
	pr := r.Find("PrometheusRule", "proxyaudit-aggregator")
	if pr == nil {
		t.Fatalf("no PrometheusRule in %v", r.Kinds())
	}
	dir := t.TempDir()
	spec, _ := json.Marshal(pr.Object["spec"])
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), spec, 0o644); err != nil {
		t.Fatal(err)
	}
	var groups struct {
		Groups []struct {
			Rules []rule `json:"rules"`
		} `json:"groups"`
	}
	if err := json.Unmarshal(spec, &groups); err != nil {
		t.Fatal(err)
	}
	rules := map[string]rule{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			rules[r.Alert] = r
		}
	}
	// The annotations an alert promises, with its value in.
	expect := func(name, value string, extra ...string) []expAlert {
		r, ok := rules[name]
		if !ok {
			t.Fatalf("the chart has no alert %s", name)
		}
		an := map[string]string{}
		for k, v := range r.Annotations {
			v = strings.ReplaceAll(v, "{{ $value | humanizeDuration }}", value)
			an[k] = strings.ReplaceAll(v, "{{ $value }}", value)
		}
		labels := map[string]string{}
		for k, v := range r.Labels {
			labels[k] = v
		}
		for i := 0; i+1 < len(extra); i += 2 {
			labels[extra[i]] = extra[i+1]
		}
		return []expAlert{{Labels: labels, Annotations: an}}
	}
	leader := func(pod, values string) series {
		return series{Series: fmt.Sprintf(`proxyaudit_leader{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator"}`, pod), Values: values}
	}
	finding := func(pod, kind, values string) series {
		return series{Series: fmt.Sprintf(`proxyaudit_findings{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator",kind=%q}`, pod, kind), Values: values}
	}
	// agg-0 leads; agg-1 follows and still exports what it found when it
	// led (5 of every kind).
	replicas := []series{leader("agg-0", "1x90"), leader("agg-1", "0x90")}
	findingTest := func(alert, kind, forDur, value string) promtoolTest {
		in := append(append([]series(nil), replicas...), finding("agg-0", kind, "0 0 "+value+"x88"), finding("agg-1", kind, "5x90"))
		return promtoolTest{Name: alert, Interval: "1m", InputSeries: in, Alerts: []alertTest{
			{EvalTime: "2m", AlertName: alert}, // the leader's gauge just rose: pending
			{EvalTime: durationPlus("2m", forDur), AlertName: alert, ExpAlerts: expect(alert, value)},
		}}
	}
	followerOnly := promtoolTest{Name: "a follower's gauges alone fire nothing", Interval: "1m",
		InputSeries: append(append([]series(nil), replicas...), finding("agg-1", "StuckProxy", "5x90"), finding("agg-0", "StuckProxy", "0x90")),
		Alerts:      []alertTest{{EvalTime: "30m", AlertName: "ProxyAuditKubeProxyStuck"}}}
	stale := func(pod, values string) series {
		return series{Series: fmt.Sprintf(`proxyaudit_view_stale{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator"}`, pod), Values: values}
	}
	waiting := func(pod, values string) series {
		return series{Series: fmt.Sprintf(`proxyaudit_stream_reports_waiting{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator"}`, pod), Values: values}
	}
	expiry := func(pod, values string) series {
		return series{Series: fmt.Sprintf(`proxyaudit_tls_certificate_expiry_timestamp_seconds{namespace="proxyaudit",pod=%q,job="proxyaudit-aggregator"}`, pod), Values: values}
	}
	ut := promtoolUnitTest{RuleFiles: []string{"rules.yaml"}, EvaluationInterval: "1m", Tests: []promtoolTest{
		findingTest("ProxyAuditKubeProxyStuck", "StuckProxy", "1m", "1"),
		findingTest("ProxyAuditNodesDrifted", "StaleEndpoint", "2m", "3"),
		findingTest("ProxyAuditStaleConntrack", "StaleConntrack", "2m", "2"),
		findingTest("ProxyAuditCollectorsSilent", "CollectorMissing", "10m", "4"),
		followerOnly,
		{Name: "ProxyAuditViewStale", Interval: "1m", InputSeries: []series{stale("agg-0", "0x90"), stale("agg-1", "0 1x89")},
			Alerts: []alertTest{{EvalTime: "1m", AlertName: "ProxyAuditViewStale"}, {EvalTime: "3m", AlertName: "ProxyAuditViewStale", ExpAlerts: expect("ProxyAuditViewStale", "1")}}},
		{Name: "ProxyAuditNoLeader, both replicas following", Interval: "1m", InputSeries: []series{leader("agg-0", "1 1 0x88"), leader("agg-1", "0x90")},
			Alerts: []alertTest{{EvalTime: "1m", AlertName: "ProxyAuditNoLeader"}, {EvalTime: "5m", AlertName: "ProxyAuditNoLeader", ExpAlerts: expect("ProxyAuditNoLeader", "0")}}},
		{Name: "ProxyAuditNoLeader, no replica scraped", Interval: "1m", InputSeries: []series{stale("agg-0", "0x90")},
			Alerts: []alertTest{{EvalTime: "5m", AlertName: "ProxyAuditNoLeader", ExpAlerts: expect("ProxyAuditNoLeader", "0")}}},
		{Name: "ProxyAuditLeaderBehind", Interval: "1m", InputSeries: []series{waiting("agg-0", "0 0 150x88"), waiting("agg-1", "0x90")},
			Alerts: []alertTest{{EvalTime: "4m", AlertName: "ProxyAuditLeaderBehind"}, {EvalTime: "8m", AlertName: "ProxyAuditLeaderBehind", ExpAlerts: expect("ProxyAuditLeaderBehind", "150")}}},
		// Expiring 8 days after the test's epoch; at 2h it has 7d 22h left.
		{Name: "ProxyAuditCertificateExpiring", Interval: "1m", InputSeries: []series{expiry("agg-0", "691200x200"), expiry("agg-1", "9999999x200")},
			Alerts: []alertTest{{EvalTime: "2h", AlertName: "ProxyAuditCertificateExpiring", ExpAlerts: expect("ProxyAuditCertificateExpiring", "7d 22h 0m 0s")}}},
	}}
	if len(rules) != 8 {
		t.Errorf("the chart has %d alerts; this test covers 8 (add the new one here)", len(rules))
	}
	data, _ := json.MarshalIndent(ut, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "test.yaml"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(promtool, "test", "rules", "test.yaml")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules: %v\n%s", err, out)
	}
}

// durationPlus adds two promtool durations of whole minutes.
func durationPlus(a, b string) string {
	var x, y int
	fmt.Sscanf(a, "%dm", &x)
	fmt.Sscanf(b, "%dm", &y)
	return fmt.Sprintf("%dm", x+y+1)
}
