package aggregator

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/promtool"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// The stuck-node scenario, scraped: the real aggregator's /metrics read
// every 15 s (of the harness's clock) while a node's kube-proxy misses a
// change and later catches up; the chart's rendered rules evaluated by
// promtool on exactly what was scraped (as Prometheus would store it,
// with the namespace and pod its ServiceMonitor adds): ProxyAuditKubeProxyStuck
// fires a minute after the finding appears and resolves once it clears.
//
// The chart's Grafana dashboard is evaluated on the same series: every
// panel's query runs without error, and the panels this scenario feeds
// (states, findings, lag, time to find, stream bytes, staleness, leader,
// read cost, reports waiting) return data.
func TestStuckAlertFiresOnScrapedMetrics(t *testing.T) {
	bin, rel := chartAndPromtool(t, "metrics.prometheusRule.enabled=true", "metrics.grafanaDashboard.enabled=true")
	pr := rel.Find("PrometheusRule", "proxyaudit-aggregator")
	if pr == nil {
		t.Fatal("no PrometheusRule")
	}
	cm := rel.Find("ConfigMap", "proxyaudit-aggregator-dashboard")
	if cm == nil {
		t.Fatal("no dashboard ConfigMap")
	}

	h := start(t, 2*time.Second, auth.InsecureNoAuth{})
	h.settle = realTime // Prometheus scrapes the aggregator over a real socket
	var mu sync.Mutex
	current, stuck := rules(t), rules(t)
	h.collector(h.ctx, "n1", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
	h.collector(h.ctx, "n2", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
	h.collector(h.ctx, "n3", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return stuck })
	srv := httptest.NewServer(h.agg.Handler("0"))
	defer srv.Close()
	sc := &scraper{url: srv.URL + "/metrics", client: srv.Client(), samples: map[string][]string{}}
	every := func(d time.Duration) {
		for end := h.clk.Now().Add(d); h.clk.Now().Before(end); {
			h.advance(15*time.Second, nil)
			sc.scrape(t)
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
	for i, v := range sc.samples[stuckKey] {
		if v != "0" && v != "_" {
			if first < 0 {
				first = i
			}
			last = i
		}
	}
	if first < 0 || last-first < 6 {
		t.Fatalf("the scraped StuckProxy gauge never rose for long: %v", sc.samples[stuckKey])
	}
	var in []promtool.Series
	for k, vs := range sc.samples {
		in = append(in, promtool.Series{Series: k, Values: strings.Join(vs, " ")})
	}
	at := func(i int) string { return fmt.Sprintf("%ds", 15*i) }
	spec, _ := json.Marshal(pr.Object["spec"])
	rules, err := promtool.Alerts(spec)
	if err != nil {
		t.Fatal(err)
	}
	const alert = "ProxyAuditKubeProxyStuck"
	// The dashboard's queries at the end of the stuck spell: each runs
	// (a wrong join fails evaluation), and those this scenario feeds
	// return data.
	fed := map[string]bool{"Nodes by state": true, "Findings by kind": true, "Programming lag": true, "Time to find": true,
		"Stream bytes": true, "View staleness and leader": true, "Collector read cost": true, "Reports waiting": true}
	dash := dashboardOf(t, cm)
	var exprs []promtool.ExprTest
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			// One cluster without the label: Grafana's All (".*").
			q := strings.NewReplacer("$namespace", "proxyaudit", "$cluster", ".*").Replace(tg.Expr)
			e := promtool.ExprTest{EvalTime: at(last), Samples: []promtool.Sample{{Labels: "{}", Value: 1}},
				Expr: "(count(" + q + ") or vector(0)) >= bool 0"} // evaluates, data or not
			if fed[p.Title] {
				e.Expr = "count(" + q + ") > bool 0" // has data
			}
			exprs = append(exprs, e)
		}
	}
	ut := promtool.UnitTest{EvaluationInterval: "15s", Tests: []promtool.Test{{Interval: "15s", InputSeries: in, Alerts: []promtool.AlertTest{
		{EvalTime: at(first), AlertName: alert}, // pending
		{EvalTime: at(first + 5), AlertName: alert, ExpAlerts: []promtool.ExpAlert{rules[alert].Expect("1")}}, // for: 1m
		{EvalTime: at(last + 2), AlertName: alert},                                                            // resolved
	}, Exprs: exprs}}}
	if out, err := promtool.TestRules(bin, t.TempDir(), spec, ut); err != nil {
		t.Fatalf("promtool test rules on the scraped series: %v\n%s", err, out)
	}
	t.Logf("%d scrapes of %d series; StuckProxy from scrape %d to %d; the alert fired a minute in and resolved; %d dashboard queries evaluated", sc.scrapes, len(in), first, last, len(exprs))
}

// scraper keeps what each scrape of the aggregator's /metrics returned,
// as Prometheus would store it (with the namespace and pod its
// ServiceMonitor adds): samples["metric{labels}"] holds one value per
// scrape ("_" before a series appeared).
type scraper struct {
	url     string
	client  *http.Client
	samples map[string][]string
	scrapes int
}

func (sc *scraper) scrape(t *testing.T) {
	t.Helper()
	resp, err := sc.client.Get(sc.url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	add := func(name, labels string, v float64) {
		key := name + "{" + labels + "}"
		for len(sc.samples[key]) < sc.scrapes { // a series that appeared late
			sc.samples[key] = append(sc.samples[key], "_")
		}
		sc.samples[key] = append(sc.samples[key], fmt.Sprint(v))
	}
	for name, fam := range fams {
		if !strings.HasPrefix(name, "proxyaudit_") {
			continue
		}
		for _, m := range fam.GetMetric() {
			labels := `namespace="proxyaudit",pod="proxyaudit-aggregator-0"`
			for _, l := range m.GetLabel() {
				labels += fmt.Sprintf(",%s=%q", l.GetName(), l.GetValue())
			}
			switch {
			case m.Gauge != nil:
				add(name, labels, m.GetGauge().GetValue())
			case m.Counter != nil:
				add(name, labels, m.GetCounter().GetValue())
			case m.Histogram != nil:
				h := m.GetHistogram()
				for _, b := range h.GetBucket() {
					add(name+"_bucket", labels+fmt.Sprintf(",le=%q", fmt.Sprint(b.GetUpperBound())), float64(b.GetCumulativeCount()))
				}
				add(name+"_bucket", labels+`,le="+Inf"`, float64(h.GetSampleCount()))
				add(name+"_sum", labels, h.GetSampleSum())
				add(name+"_count", labels, float64(h.GetSampleCount()))
			}
		}
	}
	sc.scrapes++
}

// The chart's Grafana dashboard asks only for what the aggregator
// exports, in PromQL that Prometheus's own parser takes: every panel's
// query names metrics of the aggregator's registry (a histogram's
// _bucket of a histogram), and promtool checks each as a recording rule.
func TestGrafanaDashboardQueries(t *testing.T) {
	bin, rel := chartAndPromtool(t, "metrics.grafanaDashboard.enabled=true")
	cm := rel.Find("ConfigMap", "proxyaudit-aggregator-dashboard")
	if cm == nil {
		t.Fatalf("no dashboard ConfigMap in %v", rel.Kinds())
	}
	dash := dashboardOf(t, cm)
	// What the aggregator exports: every collector of its Metrics.
	exported := map[string]string{}
	m := NewMetrics()
	v := reflect.ValueOf(m).Elem()
	ch := make(chan *prometheus.Desc, 64)
	for i := range v.NumField() {
		c, ok := v.Field(i).Interface().(prometheus.Collector)
		if !ok {
			continue
		}
		go func() { c.Describe(ch); ch <- nil }()
		for d := <-ch; d != nil; d = <-ch {
			name := descName(d)
			kind := "other"
			if _, ok := c.(prometheus.Histogram); ok {
				kind = "histogram"
			} else if _, ok := c.(*prometheus.HistogramVec); ok {
				kind = "histogram"
			}
			exported[name] = kind
		}
	}
	exported["proxyaudit_tls_certificate_expiry_timestamp_seconds"] = "other" // registered by the binary when it serves TLS
	nameRE := regexp.MustCompile(`proxyaudit_[a-z_]+`)
	var exprs []string
	for _, p := range dash.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, name := range nameRE.FindAllString(tg.Expr, -1) {
				base, hist := strings.CutSuffix(name, "_bucket")
				if kind, ok := exported[base]; !ok || (hist && kind != "histogram") {
					t.Errorf("panel %q asks for %s, which the aggregator does not export", p.Title, name)
				}
			}
			exprs = append(exprs, strings.NewReplacer("$namespace", "proxyaudit", "$cluster", ".*").Replace(tg.Expr))
		}
	}
	if out, err := promtool.CheckRecorded(bin, t.TempDir(), exprs); err != nil {
		t.Fatalf("promtool check rules on the dashboard's %d queries: %v\n%s", len(exprs), err, out)
	}
	n := len(exprs)
	t.Logf("%d panels, %d queries: every metric exported, every query parsed by Prometheus", len(dash.Panels), n)
}

// dashboard is the chart's Grafana dashboard, its panels' queries.
type dashboard struct {
	Panels []struct {
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

// dashboardOf reads the dashboard out of its rendered ConfigMap.
func dashboardOf(t *testing.T, cm *unstructured.Unstructured) dashboard {
	t.Helper()
	raw, _, _ := unstructuredString(cm.Object, "data", "proxyaudit.json")
	var d dashboard
	if err := json.Unmarshal([]byte(raw), &d); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	return d
}

// chartAndPromtool renders the chart with sets and builds promtool.
func chartAndPromtool(t *testing.T, sets ...string) (string, *chart.Release) {
	t.Helper()
	if testing.Short() {
		t.Skip("renders the chart and runs promtool")
	}
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin, err := promtool.Binary(root)
	if err != nil {
		t.Fatal(err)
	}
	rel, err := chart.Render(root, "proxyaudit", "proxyaudit", nil, sets...)
	if err != nil {
		t.Fatal(err)
	}
	return bin, rel
}

// descName is a Desc's fully-qualified name.
func descName(d *prometheus.Desc) string {
	s := d.String()
	_, rest, _ := strings.Cut(s, `fqName: "`)
	name, _, _ := strings.Cut(rest, `"`)
	return name
}

func unstructuredString(obj map[string]any, fields ...string) (string, bool, error) {
	var cur any = obj
	for _, f := range fields {
		m, ok := cur.(map[string]any)
		if !ok {
			return "", false, nil
		}
		cur = m[f]
	}
	s, ok := cur.(string)
	return s, ok, nil
}
