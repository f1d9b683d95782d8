package fleetsim_test

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
)

// installReportsCRD applies the chart's OpenReports CRD, so that the
// replicas (--openreports=auto) write their findings as ClusterReports
// and the simulation measures those writes.
func installReportsCRD(ctx context.Context, t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	doc, err := os.ReadFile("../../charts/proxyaudit/files/openreports.io_clusterreports.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := chart.ApplyCRD(ctx, c.RESTConfig, doc, "openreports.io/v1alpha1"); err != nil {
		t.Fatal(err)
	}
}

// reportWrites follows the API server's own count of writes (POST, PUT,
// PATCH, DELETE) on ClusterReports, whoever made them (a killed leader
// too), sampled every few seconds.
type reportWrites struct {
	mu    sync.Mutex
	at    []time.Time
	count []float64
}

func sampleReportWrites(ctx context.Context, client kubernetes.Interface, every time.Duration) *reportWrites {
	w := &reportWrites{}
	go func() {
		for {
			n, err := apiReportWrites(ctx, client)
			if err == nil { // a failed sample is skipped: the peak spans the samples taken
				w.mu.Lock()
				w.at, w.count = append(w.at, time.Now()), append(w.count, n)
				w.mu.Unlock()
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(every):
			}
		}
	}()
	return w
}

// peak is the highest rate over any window of at least span between
// samples.
func (w *reportWrites) peak(span time.Duration) float64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	best := 0.0
	j := 0
	for i := range w.at {
		for j < i && w.at[i].Sub(w.at[j+1]) >= span {
			j++
		}
		if d := w.at[i].Sub(w.at[j]); d >= span {
			best = max(best, (w.count[i]-w.count[j])/d.Seconds())
		}
	}
	return best
}

func apiReportWrites(ctx context.Context, client kubernetes.Interface) (float64, error) {
	raw, err := client.CoreV1().RESTClient().Get().AbsPath("/metrics").DoRaw(ctx)
	if err != nil {
		return 0, err
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mf, err := parser.TextToMetricFamilies(strings.NewReader(string(raw)))
	if err != nil {
		return 0, err
	}
	n := 0.0
	for _, m := range mf["apiserver_request_total"].GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		if l["group"] != openreports.Resource.Group || l["resource"] != openreports.Resource.Resource {
			continue
		}
		switch l["verb"] {
		case "POST", "PUT", "PATCH", "DELETE":
			n += m.GetCounter().GetValue()
		}
	}
	return n, nil
}

// reportsHeld counts the ClusterReports proxyaudit holds in the API and
// the largest one's size in bytes.
func reportsHeld(ctx context.Context, c *localcluster.Cluster) (n, largest int, err error) {
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		return 0, 0, err
	}
	l, err := dc.Resource(openreports.Resource).List(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
	if err != nil {
		return 0, 0, err
	}
	for _, it := range l.Items {
		raw, err := it.MarshalJSON()
		if err != nil {
			return 0, 0, err
		}
		largest = max(largest, len(raw))
	}
	return len(l.Items), largest, nil
}

// checkReportsHeld waits (up to 2 min: updates are merged for a minute)
// until the API holds one report per node with findings in the leader's
// verdict, and records both counts.
func checkReportsHeld(ctx context.Context, t *testing.T, c *localcluster.Cluster, agg *apiClient, res *Result) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(2 * time.Second) {
		v, err := agg.verdict()
		if err != nil {
			t.Logf("verdict: %v", err)
			continue
		}
		nodes := map[string]bool{}
		for _, f := range v.Findings {
			nodes[f.Node] = true
		}
		held, _, err := reportsHeld(ctx, c)
		if err != nil {
			t.Logf("ClusterReports: %v", err)
		}
		res.ReportsHeldAtEnd, res.ReportNodesAtEnd = held, len(nodes)
		if err == nil && held == len(nodes) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%d ClusterReports held for %d nodes with findings", held, len(nodes))
			return
		}
	}
}
