package aggregator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// The stuck-node scenario, scraped: the real aggregator's /metrics read
// every 15 s (of the harness's clock) while a node's kube-proxy misses a
// change and later catches up; the chart's rendered rules evaluated by
// promtool on exactly what was scraped (as Prometheus would store it,
// with the namespace and pod its ServiceMonitor adds): ProxyAuditKubeProxyStuck
// fires a minute after the finding appears and resolves once it clears.
func TestStuckAlertFiresOnScrapedMetrics(t *testing.T) {
	if testing.Short() {
		t.Skip("renders the chart and runs promtool")
	}
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(root, "deploy/k8s-tools/promtool.sh")).Output()
	if err != nil {
		t.Fatalf("building promtool: %v", err)
	}
	promtool := strings.TrimSpace(string(out))
	rel, err := chart.Render(root, "proxyaudit", "proxyaudit", nil, "metrics.prometheusRule.enabled=true")
	if err != nil {
		t.Fatal(err)
	}
	pr := rel.Find("PrometheusRule", "proxyaudit-aggregator")
	if pr == nil {
		t.Fatal("no PrometheusRule")
	}

	h := start(t, 2*time.Second, InsecureNoAuth{})
	var mu sync.Mutex
	current, stuck := rules(t), rules(t)
	h.collector(h.ctx, "n1", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
	h.collector(h.ctx, "n2", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
	h.collector(h.ctx, "n3", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return stuck })
	srv := httptest.NewServer(h.agg.Handler("0"))
	defer srv.Close()
	// samples["metric{labels}"] holds one value per scrape.
	samples := map[string][]string{}
	scrapes := 0
	scrape := func() {
		resp, err := srv.Client().Get(srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"proxyaudit_leader", "proxyaudit_findings"} {
			for _, m := range fams[name].GetMetric() {
				labels := `namespace="proxyaudit",pod="proxyaudit-aggregator-0"`
				for _, l := range m.GetLabel() {
					labels += fmt.Sprintf(",%s=%q", l.GetName(), l.GetValue())
				}
				key := name + "{" + labels + "}"
				for len(samples[key]) < scrapes { // a series that appeared late
					samples[key] = append(samples[key], "_")
				}
				samples[key] = append(samples[key], fmt.Sprint(m.GetGauge().GetValue()))
			}
		}
		scrapes++
	}
	every := func(d time.Duration) {
		for end := h.clk.Now().Add(d); h.clk.Now().Before(end); {
			h.advance(15*time.Second, nil)
			scrape()
		}
	}
	h.until(10*time.Second, "the nodes in sync", func() bool {
		v := h.verdict()
		for _, n := range v.Nodes {
			if n.State != audit.NodeInSync {
				return false
			}
		}
		return len(v.Nodes) == 3 && len(v.Findings) == 0
	})
	every(30 * time.Second)
	sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Get(h.ctx, synth.ServiceName(2)+"-0", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sl.Endpoints = sl.Endpoints[:len(sl.Endpoints)-1]
	if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(context.Background(), sl, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	current = rules(t, 2)
	mu.Unlock()
	every(2 * time.Minute) // n3 stuck
	mu.Lock()
	stuck = current // its kube-proxy catches up
	mu.Unlock()
	every(time.Minute)

	stuckKey := `proxyaudit_findings{namespace="proxyaudit",pod="proxyaudit-aggregator-0",kind="StuckProxy"}`
	first, last := -1, -1
	for i, v := range samples[stuckKey] {
		if v != "0" && v != "_" {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	if first < 0 || last-first < 6 {
		t.Fatalf("the scraped StuckProxy gauge never rose for long: %v", samples[stuckKey])
	}
	var in []series
	for k, vs := range samples {
		in = append(in, series{Series: k, Values: strings.Join(vs, " ")})
	}
	at := func(i int) string { return fmt.Sprintf("%ds", 15*i) }
	var groups struct {
		Groups []struct {
			Rules []struct {
				Alert       string            `json:"alert"`
				Labels      map[string]string `json:"labels"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	}
	spec, _ := json.Marshal(pr.Object["spec"])
	json.Unmarshal(spec, &groups)
	var want expAlert
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "ProxyAuditKubeProxyStuck" {
				want.Labels = r.Labels
				want.Annotations = map[string]string{}
				for k, v := range r.Annotations {
					want.Annotations[k] = strings.ReplaceAll(v, "{{ $value }}", "1")
				}
			}
		}
	}
	test := map[string]any{
		"rule_files":          []string{"rules.yaml"},
		"evaluation_interval": "15s",
		"tests": []map[string]any{{
			"interval":     "15s",
			"input_series": in,
			"alert_rule_test": []alertTest{
				{EvalTime: at(first), AlertName: "ProxyAuditKubeProxyStuck"},                                  // pending
				{EvalTime: at(first + 5), AlertName: "ProxyAuditKubeProxyStuck", ExpAlerts: []expAlert{want}}, // for: 1m
				{EvalTime: at(last + 2), AlertName: "ProxyAuditKubeProxyStuck"},                               // resolved
			},
		}},
	}
	dir := t.TempDir()
	data, _ := json.MarshalIndent(test, "", " ")
	os.WriteFile(filepath.Join(dir, "rules.yaml"), spec, 0o644)
	os.WriteFile(filepath.Join(dir, "test.yaml"), data, 0o644)
	cmd := exec.Command(promtool, "test", "rules", "test.yaml")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules on the scraped series: %v\n%s", err, out)
	}
	t.Logf("%d scrapes; StuckProxy from scrape %d to %d; the alert fired a minute in and resolved", scrapes, first, last)
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
