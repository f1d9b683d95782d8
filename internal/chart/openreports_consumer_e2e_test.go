package chart_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/dynamic"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
)

// A consumer proxyaudit did not write reads its reports: the OpenTelemetry
// Collector's k8sobjects receiver (v0.111.0, built from its modules), as a
// hub collects ClusterReports from its member clusters, watches them on
// the real API server and logs each as it comes and goes: the node, the
// policy and the endpoint of a finding the leader's writer put there.
//
// Policy Reporter, the first choice, cannot be built here: the
// module proxy serves no version of github.com/kyverno/policy-reporter
// (nor /v3): "is not available".
func TestE2EOpenReportsSeenByOTelCollector(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bin, err := localcluster.EnsureOTelCollector(ctx)
	if err != nil {
		t.Fatal(err)
	}
	installOpenReportsCRD(ctx, t, c)
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	defer dc.Resource(openreports.Resource).DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})

	cfg := filepath.Join(t.TempDir(), "otelcol.yaml")
	if err := os.WriteFile(cfg, []byte(`receivers:
  k8sobjects:
    auth_type: kubeConfig
    objects:
      - name: clusterreports
        group: openreports.io
        mode: watch
exporters:
  debug:
    verbosity: detailed
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    logs:
      receivers: [k8sobjects]
      exporters: [debug]
`), 0o600); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var out bytes.Buffer
	seen := func() string { mu.Lock(); defer mu.Unlock(); return out.String() }
	cmd := exec.CommandContext(ctx, bin, "--config", "file:"+cfg)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.AdminKubeconfig)
	w := lockedWriter{mu: &mu, b: &out}
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	defer func() { cmd.Process.Kill(); <-exited }()
	waitOut := func(what string, ok func(string) bool) {
		t.Helper()
		for deadline := time.Now().Add(time.Minute); !ok(seen()); time.Sleep(200 * time.Millisecond) {
			select {
			case <-exited:
				t.Fatalf("the collector exited before it logged %s:\n%s", what, tailLines(seen(), 40))
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("the collector never logged %s:\n%s", what, tailLines(seen(), 40))
			}
		}
	}
	waitOut("that it started", func(s string) bool { return strings.Contains(s, "Everything is ready") })

	writer := openreports.NewWriter(openreports.WriterConfig{Client: dc})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go writer.Run(runCtx)
	since := time.Now().Add(-time.Minute).Truncate(time.Second)
	stale := audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "node-otel", Service: "kube-system/kube-dns", Port: "dns", Protocol: "UDP", Family: 4,
		Scope: audit.ScopeCluster, Kind: audit.StaleEndpoint, Endpoint: "198.18.7.7:53", Detail: "routes to 198.18.7.7:53, which the cluster no longer lists"}}
	writer.Offer(ctx, &audit.Verdict{Nodes: []audit.NodeStatus{{Node: "node-otel", State: audit.NodeStuck}}, Findings: []audit.TimedFinding{stale}})
	waitOut("the report's finding", func(s string) bool {
		return strings.Contains(s, openreports.Name("node-otel")) && strings.Contains(s, "proxyaudit/StaleEndpoint") && strings.Contains(s, "198.18.7.7:53")
	})
	added := strings.Count(seen(), "ADDED")
	// The drift ends: the report goes, and the collector hears it go.
	writer.Offer(ctx, &audit.Verdict{Nodes: []audit.NodeStatus{{Node: "node-otel", State: audit.NodeInSync}}})
	waitOut("the report's deletion", func(s string) bool { return strings.Contains(s, "DELETED") })
	t.Logf("the OpenTelemetry Collector logged the report (%d ADDED event(s)) and its deletion", added)
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func tailLines(s string, n int) string {
	lines := strings.Split(s, "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
