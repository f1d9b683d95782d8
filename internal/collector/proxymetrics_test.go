package collector

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// The lines as kube-proxy 1.36 prints them (per-family gauges carry an
// ip_family label; the pending gauges carry none).
const kubeProxyPage = `# HELP kubeproxy_sync_proxy_rules_endpoint_changes_pending [ALPHA] Pending proxy rules Endpoint changes
# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_pending gauge
kubeproxy_sync_proxy_rules_endpoint_changes_pending 3
kubernetes_build_info{build_date="2026-10-01T00:00:00Z",compiler="gc",git_commit="0",git_tree_state="clean",git_version="v1.36.3",go_version="go1.26",major="1",minor="36",platform="linux/amd64"} 1
kubeproxy_sync_proxy_rules_endpoint_changes_total 1234
kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family="IPv4"} 1.7637e+09
kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family="IPv6"} 1.7638e+09
kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv4"} 1.76369e+09
kubeproxy_sync_proxy_rules_service_changes_pending 0
kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"} 0
`

func TestParseKubeProxyMetrics(t *testing.T) {
	kp, err := parseKubeProxyMetrics(strings.NewReader(kubeProxyPage))
	if err != nil {
		t.Fatal(err)
	}
	want := stream.KubeProxy{LastSync: 1.76369e+09, LastQueued: 1.7638e+09, EndpointChangesPending: 3, EndpointChangesTotal: 1234, Version: "v1.36.3"}
	if *kp != want {
		t.Fatalf("got %+v, want %+v", *kp, want)
	}
	for _, bad := range []string{"", "node_cpu_seconds_total 1\n", "kubeproxy_sync_proxy_rules_endpoint_changes_pending NaNx\n"} {
		if _, err := parseKubeProxyMetrics(strings.NewReader(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// A metrics endpoint that fails is a note in the report, never an error.
func TestScrapeKubeProxyFailures(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			w.Write([]byte(kubeProxyPage))
			return
		}
		http.NotFound(w, r)
	}))
	defer srv.Close()
	ctx := context.Background()
	if kp := ScrapeKubeProxy(ctx, srv.Client(), srv.URL+"/metrics"); kp.Error != "" || kp.EndpointChangesPending != 3 {
		t.Fatalf("good page: %+v", kp)
	}
	if kp := ScrapeKubeProxy(ctx, srv.Client(), srv.URL+"/nope"); !strings.Contains(kp.Error, "404") {
		t.Fatalf("404: %+v", kp)
	}
	if kp := ScrapeKubeProxy(ctx, srv.Client(), "http://127.0.0.1:1/metrics"); !strings.Contains(kp.Error, "refused") {
		t.Fatalf("closed port: %+v", kp)
	}
}
