package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/api"
)

// apiServer stands in for a cluster's API server as report uses it: the
// aggregator Service's proxy serves its API; minting the reader token is
// refused (report goes on without one, as against an aggregator without
// --http-readers).
func apiServer(t *testing.T, fr api.FindingsResponse, nr api.NodesResponse) string {
	const proxy = "/api/v1/namespaces/proxyaudit/services/http:proxyaudit-aggregator:http/proxy"
	agg := aggregatorAPI(fr, nr)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p, ok := strings.CutPrefix(r.URL.Path, proxy); ok {
			r.URL.Path = p
			agg.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403}`)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// kubeconfig writes a kubeconfig with one context per server.
func kubeconfig(t *testing.T, servers map[string]string) string {
	var b strings.Builder
	b.WriteString("apiVersion: v1\nkind: Config\nclusters:\n")
	for name, url := range servers {
		fmt.Fprintf(&b, "- name: %s\n  cluster:\n    server: %s\n", name, url)
	}
	b.WriteString("users:\n- name: u\n  user:\n    token: t\ncontexts:\n")
	for name := range servers {
		fmt.Fprintf(&b, "- name: %s\n  context:\n    cluster: %s\n    user: u\n", name, name)
	}
	p := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(p, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Several clusters in one report: each asked through its own API server,
// one table with a CLUSTER column; a cluster that cannot be reached is
// named with the reason, sets the exit status, and hides nothing else.
func TestReportAcrossClusters(t *testing.T) {
	fr, nr := fleet()
	quiet := api.FindingsResponse{At: fr.At}
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	locked := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Unauthorized","code":401}`)
	}))
	t.Cleanup(locked.Close)
	cfg := kubeconfig(t, map[string]string{
		"prod-eu": apiServer(t, fr, nr),
		"prod-us": apiServer(t, quiet, api.NodesResponse{At: nr.At, Nodes: nr.Nodes[:1]}),
		"gone":    down.URL,
		"locked":  locked.URL,
	})
	run := func(args ...string) (int, string, string) {
		var out, errs bytes.Buffer
		code := runReport(append([]string{"--kubeconfig", cfg, "--timeout", "5s"}, args...), &out, &errs)
		return code, out.String(), errs.String()
	}

	code, out, errs := run("--context", "prod-eu", "--context", "prod-us")
	if code != exitFindings {
		t.Fatalf("two readable clusters, one with findings: exit %d, want %d\n%s%s", code, exitFindings, out, errs)
	}
	for _, want := range []string{"CLUSTER", "prod-eu  4", "prod-us  0", "prod-eu  node-b  kube-system/kube-dns", "StuckProxy", "prod-eu  node-d"} {
		if !strings.Contains(out, want) {
			t.Errorf("the table does not show %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "prod-us  node-") {
		t.Errorf("findings of prod-us shown:\n%s", out)
	}

	code, out, _ = run("--all-contexts", "-o", "json")
	if code != exitUsage {
		t.Errorf("one cluster unreachable: exit %d, want %d", code, exitUsage)
	}
	var rep ClustersReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("-o json: %v\n%s", err, out)
	}
	got := map[string]string{}
	for _, c := range rep.Clusters {
		switch {
		case c.Report != nil:
			got[c.Context] = fmt.Sprintf("%d findings", len(c.Report.Findings))
		case c.Error != "":
			got[c.Context] = "error"
		}
	}
	if fmt.Sprint(got) != "map[gone:error locked:error prod-eu:4 findings prod-us:0 findings]" {
		t.Errorf("--all-contexts read %v", got)
	}
	if c := rep.Clusters[0]; c.Context != "gone" || !strings.HasPrefix(c.Error, "cannot reach the API server: dial tcp") {
		t.Errorf("the unreachable cluster, first in name order, says %q", c.Error)
	}
	if c := rep.Clusters[1]; c.Context != "locked" || !strings.Contains(c.Error, "refused your credentials") {
		t.Errorf("the cluster that refuses the credentials says %q", c.Error)
	}

	code, out, _ = run("--context", "gone", "--context", "prod-us", "-o", "markdown")
	if code != exitUsage || !strings.Contains(out, "| gone | - | UNREADABLE: ") || !strings.Contains(out, "| prod-us | 0 |") {
		t.Errorf("markdown with one cluster down: exit %d\n%s", code, out)
	}

	for _, args := range [][]string{
		{"--context", "prod-eu", "--context", "prod-us", "--aggregator", "http://127.0.0.1:1"},
		{"--all-contexts", "--context", "prod-eu"},
	} {
		if code, _, errs := run(args...); code != exitUsage || errs == "" {
			t.Errorf("%v: exit %d, %q", args, code, errs)
		}
	}
	var errb bytes.Buffer
	if code := runExplain([]string{"node", "node-b", "--kubeconfig", cfg, "--context", "prod-eu", "--context", "prod-us"}, &bytes.Buffer{}, &errb); code != exitUsage ||
		!strings.Contains(errb.String(), "one cluster") {
		t.Errorf("explain across clusters: exit %d, %q", code, errb.String())
	}
}
