package chart_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
)

// reportsAPI is the module the chart's OpenReports CRD comes from.
const reportsAPI = "github.com/openreports/reports-api@v0.2.1"

// The CRD the chart installs (openReports.installCRD) is the module's, byte
// for byte: vendored, never edited.
func TestOpenReportsCRDIsUpstream(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	want, err := os.ReadFile(filepath.Join(moduleDir(ctx, t, reportsAPI), "config/crd/openreports.io_clusterreports.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if got := openReportsCRD(t); !bytes.Equal(got, want) {
		t.Fatalf("charts/proxyaudit/files/openreports.io_clusterreports.yaml differs from %s's config/crd: copy it again", reportsAPI)
	}
}

func openReportsCRD(t *testing.T) []byte {
	t.Helper()
	crd, err := os.ReadFile(filepath.Join(root(t), "charts/proxyaudit/files/openreports.io_clusterreports.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	return crd
}

// installOpenReportsCRD applies the chart's OpenReports CRD and waits
// until the API serves it.
func installOpenReportsCRD(ctx context.Context, t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	if err := chart.ApplyCRD(ctx, c.RESTConfig, openReportsCRD(t), "openreports.io/v1alpha1"); err != nil {
		t.Fatal(err)
	}
}

// The reports proxyaudit builds are what the genuine OpenReports CRD
// accepts, field by field (strict validation on the real API server): a
// node's report with every kind of finding, the fleet's, and a flushed
// node's 20,000 findings summarised; updated in place; deleted.
func TestE2EOpenReportsValidateServerSide(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	installOpenReportsCRD(ctx, t, c)
	gvr := openreports.Resource
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	reports := dc.Resource(gvr)

	since := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	f := func(node, svc string, kind audit.Kind, ep string) audit.TimedFinding {
		return audit.TimedFinding{Since: since, Finding: audit.Finding{Node: node, Service: svc, Port: "dns", Protocol: "UDP", Family: 4, Scope: audit.ScopeCluster,
			Kind: kind, Endpoint: ep, Detail: fmt.Sprintf("%s of %s on %s", kind, svc, node)}}
	}
	var fs []audit.TimedFinding
	for _, k := range []audit.Kind{audit.StaleEndpoint, audit.MissingEndpoint, audit.StaleService, audit.MissingService, audit.StaleConntrack} {
		fs = append(fs, f("node-b", "kube-system/kube-dns", k, "198.18.128.12:53"))
	}
	fs = append(fs, audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "node-b", Kind: audit.StuckProxy, Detail: "stuck"}},
		audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "node-d", Kind: audit.CollectorMissing, Detail: "silent"}},
		audit.TimedFinding{Since: since, Finding: audit.Finding{Kind: audit.MassDivergence, Detail: "storm"}})
	for i := range 20000 {
		fs = append(fs, f("node-x", fmt.Sprintf("ns/svc-%05d", i), audit.MissingService, ""))
	}
	put := func(r openreports.ClusterReport, update bool) *unstructured.Unstructured {
		t.Helper()
		raw, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		u := &unstructured.Unstructured{}
		if err := u.UnmarshalJSON(raw); err != nil {
			t.Fatal(err)
		}
		var got *unstructured.Unstructured
		if update {
			got, err = reports.Update(ctx, u, metav1.UpdateOptions{FieldValidation: "Strict"})
		} else {
			got, err = reports.Create(ctx, u, metav1.CreateOptions{FieldValidation: "Strict"})
		}
		if err != nil {
			t.Fatalf("%s (%d results, %d bytes): %v", r.Metadata.Name, len(r.Results), len(raw), err)
		}
		return got
	}
	built := openreports.Build(&audit.Verdict{Findings: fs})
	for _, r := range built {
		put(r, false)
	}
	list, err := reports.List(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, it := range list.Items {
		names = append(names, it.GetName())
	}
	if got := strings.Join(names, " "); got != "proxyaudit-fleet proxyaudit-node-node-b proxyaudit-node-node-d proxyaudit-node-node-x" {
		t.Fatalf("reports on the API server: %s", got)
	}
	// What the API server holds reads back as what was written.
	var back openreports.ClusterReport
	raw, _ := list.Items[1].MarshalJSON()
	if err := json.Unmarshal(raw, &back); err != nil {
		t.Fatal(err)
	}
	if back.Summary.Fail != 6 || len(back.Results) != 6 || back.Results[0].Policy != "proxyaudit/StuckProxy" || back.Scope == nil || back.Scope.Name != "node-b" {
		t.Errorf("node-b's report as the API server holds it: %+v", back)
	}
	// node-b's drift ends but for one finding; node-d's ends.
	var have []openreports.ClusterReport
	for _, it := range list.Items {
		raw, _ := it.MarshalJSON()
		var r openreports.ClusterReport
		json.Unmarshal(raw, &r)
		have = append(have, r)
	}
	var next []audit.TimedFinding
	for _, x := range fs {
		if x.Node != "node-d" && (x.Node != "node-b" || x.Kind == audit.StaleConntrack) {
			next = append(next, x)
		}
	}
	create, update, del := openreports.Plan(have, openreports.Build(&audit.Verdict{Findings: next}))
	if len(create) != 0 || len(update) != 1 || fmt.Sprint(del) != "[proxyaudit-node-node-d]" {
		t.Fatalf("plan: create %d, update %d, delete %v", len(create), len(update), del)
	}
	got := put(update[0], true)
	if res, _, _ := unstructured.NestedSlice(got.Object, "results"); len(res) != 1 {
		t.Errorf("node-b after its update holds %d results", len(res))
	}
	for _, name := range append(del, "proxyaudit-node-node-b", "proxyaudit-node-node-x", "proxyaudit-fleet") {
		if err := reports.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}
