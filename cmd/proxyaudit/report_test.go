package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/ui"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var update = flag.Bool("update", false, "rewrite the golden files under testdata/report")

// fleet is the demo's situation as the aggregator's API returns it: node-b
// stuck behind a kube-dns roll, node-d's collector silent.
func fleet() (api.FindingsResponse, api.NodesResponse) {
	at := time.Date(2026, 11, 21, 16, 19, 3, 0, time.UTC)
	since := at.Add(-17 * time.Second)
	f := func(node, svc, port string, kind audit.Kind, ep, detail string, s time.Time) audit.TimedFinding {
		return audit.TimedFinding{Since: s, Finding: audit.Finding{Node: node, Service: svc, Port: port, Protocol: "UDP", Scope: audit.ScopeCluster, Kind: kind, Endpoint: ep, Detail: detail}}
	}
	findings := []audit.TimedFinding{
		{Since: since, Finding: audit.Finding{Node: "node-b", Kind: audit.StuckProxy, Detail: "kube-proxy on this node stopped following the API: its rules still show versions of 1 service(s) that changed up to 17s ago (kube-system/kube-dns); restart kube-proxy on this node"}},
		f("node-b", "kube-system/kube-dns", "dns", audit.MissingEndpoint, "198.18.128.14:53", "the node does not route to 198.18.128.14:53", since),
		f("node-b", "kube-system/kube-dns", "dns", audit.StaleEndpoint, "198.18.128.12:53", "the node routes to 198.18.128.12:53, which the cluster no longer lists", since),
		{Since: at.Add(-time.Minute), Finding: audit.Finding{Node: "node-d", Kind: audit.CollectorMissing, Detail: "last report 1m0s ago (3 intervals of 10s): the collector or its stream is down; the node's rules are unknown, not stale"}},
	}
	lag := audit.LagStats{Samples: 40, P50: 1.8, P90: 2.6, P99: 3.1, Max: 3.1}
	nodes := []audit.NodeStatus{
		{Node: "node-a", State: audit.NodeInSync, Mode: audit.ModeIPTables, Services: 5, InSync: 5, Lag: lag},
		{Node: "node-b", State: audit.NodeStuck, Mode: audit.ModeIPTables, Services: 5, InSync: 4, Lagging: 1, Lag: audit.LagStats{Samples: 3, P50: 2.2, P90: 2.2, P99: 2.2, Max: 2.2}},
		{Node: "node-c", State: audit.NodeInSync, Mode: audit.ModeNFTables, Services: 5, InSync: 5, Lag: audit.LagStats{Samples: 40, P50: 1.5, P90: 2, P99: 4.4, Max: 5.0}},
		{Node: "node-d", State: audit.NodeMissing, Mode: audit.ModeIPTables},
	}
	return api.FindingsResponse{At: at, Leader: "10.0.0.5:9443", Grace: "30s", Findings: findings},
		api.NodesResponse{At: at, Nodes: nodes}
}

func serve(t *testing.T, fr api.FindingsResponse, nr api.NodesResponse) string {
	srv := httptest.NewServer(aggregatorAPI(fr, nr))
	t.Cleanup(srv.Close)
	return srv.URL
}

// aggregatorAPI answers the two paths report reads, as the aggregator
// does, and its status page's fleet and node pages (rendered from them by
// internal/ui, as the aggregator renders them).
func aggregatorAPI(fr api.FindingsResponse, nr api.NodesResponse) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		base := ui.Base{Title: "fleet", Root: "./", At: nr.At, Now: nr.At, Leader: fr.Leader, Grace: 30}
		switch node, isNode := strings.CutPrefix(r.URL.Path, "/ui/nodes/"); {
		case r.URL.Path == "/api/v1/findings":
			json.NewEncoder(w).Encode(fr)
		case r.URL.Path == "/api/v1/nodes":
			json.NewEncoder(w).Encode(nr)
		case r.URL.Path == "/ui/":
			ui.Serve(w, "fleet", ui.Fleet(base, nr.Nodes, fr.Findings, func(string) string { return "" }))
		case strings.HasPrefix(r.URL.Path, "/ui/static/"):
			ui.Static().ServeHTTP(w, r)
		case isNode:
			base.Title, base.Root = node, "../"
			for _, n := range nr.Nodes {
				if n.Node == node {
					ui.Serve(w, "node", ui.NodePage{Base: base, Status: n})
					return
				}
			}
			http.NotFound(w, r)
		default:
			http.NotFound(w, r)
		}
	})
}

func TestReportGolden(t *testing.T) {
	fr, nr := fleet()
	url := serve(t, fr, nr)
	for file, format := range map[string]string{"table": "table", "json": "json", "markdown": "markdown",
		// kubectl's formats (issue #57): the same document in YAML, a part
		// of it, one line per finding, the nodes with findings.
		"wide": "wide", "yaml": "yaml", "name": "name", "jsonpath": "jsonpath={.summary.findings} {.nodesByState}",
		"custom-columns": "custom-columns=NODE:.node,KIND:.kind,SERVICE:.service,ENDPOINT:.endpoint"} {
		var out, errb bytes.Buffer
		if code := run([]string{"report", "--aggregator", url, "-o", format}, &out, &errb); code != exitFindings {
			t.Fatalf("%s: exit %d: %s", format, code, errb.String())
		}
		golden := filepath.Join("testdata", "report", "fleet."+file)
		if *update {
			if err := os.WriteFile(golden, out.Bytes(), 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		}
		want, err := os.ReadFile(golden)
		if err != nil {
			t.Fatalf("%v (run go test ./cmd/proxyaudit -update)", err)
		}
		if out.String() != string(want) {
			t.Errorf("%s output differs from %s (review, then -update):\n%s", format, golden, out.String())
		}
	}
}

func TestReportCleanAndErrors(t *testing.T) {
	fr, nr := fleet()
	fr.Findings = nil
	url := serve(t, fr, nr)
	var out, errb bytes.Buffer
	if code := run([]string{"report", "--aggregator", url}, &out, &errb); code != exitClean || !strings.Contains(out.String(), "No findings") {
		t.Fatalf("clean fleet: exit %d\n%s%s", code, out.String(), errb.String())
	}
	for name, args := range map[string][]string{
		"unreachable":   {"report", "--aggregator", "http://127.0.0.1:1"},
		"not the API":   {"report", "--aggregator", url + "/nope"},
		"bad format":    {"report", "--aggregator", url, "-o", "xml"},
		"no kubeconfig": {"report", "--kubeconfig", "/nonexistent"},
	} {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), "proxyaudit report:") {
			t.Errorf("%s: exit %d: %q", name, code, errb.String())
		}
	}
}

func TestExplainGolden(t *testing.T) {
	spec := synth.Spec{Services: 2, EndpointsPerService: 2, Comments: true}
	svcs, slices := spec.Objects()
	obs, err := spec.Observed()
	if err != nil {
		t.Fatal(err)
	}
	// The cluster moved svc-00001 to a new endpoint; the node did not follow.
	slices[1].Endpoints[1].Addresses = []string{"198.18.99.7"}
	st := audit.FromAPI(svcs, slices, nil)
	resp := api.ExplainResponse{Node: "node-b", Mode: "iptables",
		States: map[string]audit.ServiceState{"synth/svc-00001": audit.Lagging},
		// A UDP client still pinned to the endpoint svc-00000 lost.
		Ports: audit.AttachStaleFlows(audit.Explain(audit.ExpectedFor(st, "node-b"), obs, ""), []audit.TimedFinding{{Finding: audit.Finding{
			Node: "node-b", Service: "synth/svc-00000", Port: "http", Protocol: "TCP", Family: 4, Kind: audit.StaleConntrack, Endpoint: "198.18.0.9:8080", Flows: 2,
			Detail: "2 TCP SYN_SENT flow(s) through 198.19.192.0:80/TCP still DNATed to 198.18.0.9:8080, which left the service 41s ago; clients 198.18.5.5:40000"}}}, ""),
		Collector: &audit.CollectorCost{Reads: map[string]uint64{"resync": 1, "change": 9, "backstop": 2}, LastReadSeconds: 0.412,
			LastReadCPUSeconds: 0.388, LastReadBytes: 7_340_032}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/nodes/node-b/explain" {
			http.NotFound(w, r)
			return
		}
		json.NewEncoder(w).Encode(resp)
	}))
	defer srv.Close()
	var out, errb bytes.Buffer
	if code := run([]string{"explain", "node", "node-b", "--aggregator", srv.URL}, &out, &errb); code != exitFindings {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	golden := filepath.Join("testdata", "report", "explain.table")
	if *update {
		os.WriteFile(golden, out.Bytes(), 0o644)
		return
	}
	want, _ := os.ReadFile(golden)
	if out.String() != string(want) {
		t.Errorf("explain output differs from %s (review, then -update):\n%s", golden, out.String())
	}
	if code := run([]string{"explain", "node-b"}, &out, &errb); code != exitUsage {
		t.Errorf("explain without 'node': exit %d", code)
	}
}

// A report from a stale aggregator says so first, in every format, and
// exits 2: its findings are the last known, not current. One from an
// aggregator holding drift back after an API outage says that instead.
func TestReportStaleAndRecovering(t *testing.T) {
	fr, nr := fleet()
	fr.Stale = &api.StaleView{Since: fr.At.Add(-time.Minute), Reason: "the EndpointSlices watch has failed since …"}
	url := serve(t, fr, nr)
	for format, first := range map[string]string{"table": "STALE: the aggregator cannot see the API", "markdown": "> **STALE:", "json": "{\n  \"at\""} {
		var out, errb bytes.Buffer
		code := run([]string{"report", "--aggregator", url, "-o", format}, &out, &errb)
		if code != exitUsage || !strings.HasPrefix(out.String(), first) || !strings.Contains(out.String(), "EndpointSlices watch") {
			t.Errorf("%s: exit %d, want 2 and the stale reason, output starting %q:\n%s", format, code, first, out.String())
		}
	}
	fr.Stale = nil
	until := fr.At.Add(30 * time.Second)
	fr.RecoveringUntil = &until
	url = serve(t, fr, nr)
	var out, errb bytes.Buffer
	if code := run([]string{"report", "--aggregator", url}, &out, &errb); code != exitFindings || !strings.HasPrefix(out.String(), "RECOVERING:") {
		t.Errorf("recovering: exit %d\n%s", code, out.String())
	}
}

// A node's warnings (a kube-proxy release known to misbehave in IPVS
// mode) show in every format without changing the exit status.
func TestReportWarnings(t *testing.T) {
	fr, nr := fleet()
	nr.Nodes[0].Warnings = []string{"kube-proxy v1.12.3 is in the known-bad window"}
	url := serve(t, fr, nr)
	for format, want := range map[string]string{"table": "WARNING " + nr.Nodes[0].Node + ": kube-proxy v1.12.3", "markdown": "- **Warning** " + nr.Nodes[0].Node, "json": `"warnings": [`} {
		var out, errb bytes.Buffer
		code := run([]string{"report", "--aggregator", url, "-o", format}, &out, &errb)
		if code != exitFindings || !strings.Contains(out.String(), want) {
			t.Errorf("%s: exit %d, want %q in:\n%s", format, code, want, out.String())
		}
	}
}

// Through the API server, report mints a reader token and shows it to the
// aggregator; when it may not mint one, the aggregator's refusal reaches
// the user in its own words (client-go would call a passed-through 401 a
// problem with the kubeconfig's credentials). The API server here is a
// stand-in answering the two paths; the real one is in TestE2ELiveSystem.
func TestReportShowsAReaderToken(t *testing.T) {
	fr, nr := fleet()
	fr.Findings = nil
	const proxy = "/api/v1/namespaces/proxyaudit/services/http:proxyaudit-aggregator:http/proxy"
	var mayMint bool
	var unavailable atomic.Int32 // how many requests a replica answers 503 first
	notYet := func() bool {
		for n := unavailable.Load(); n > 0; n = unavailable.Load() {
			if unavailable.CompareAndSwap(n, n-1) {
				return true
			}
		}
		return false
	}
	agg := http.StripPrefix(proxy, aggregatorAPI(fr, nr))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && r.URL.Path == "/api/v1/namespaces/proxyaudit/serviceaccounts/proxyaudit-reader/token":
			if !mayMint {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusForbidden)
				w.Write([]byte(`{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"Forbidden","code":403,"message":"serviceaccounts \"proxyaudit-reader\" is forbidden"}`))
				return
			}
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
				"status": map[string]any{"token": "reader-token", "expirationTimestamp": time.Now().Add(time.Hour).Format(time.RFC3339)}})
		case strings.HasPrefix(r.URL.Path, proxy+"/") && notYet():
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			w.Write([]byte(`{"error": "no aggregator leads yet; retry in a few seconds"}`))
		case strings.HasPrefix(r.URL.Path, proxy+"/"):
			if r.Header.Get(api.TokenHeader) != "reader-token" {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				w.Write([]byte(`{"error": "findings are for readers only: send a token"}`))
				return
			}
			agg.ServeHTTP(w, r)
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "+srv.URL+"}}]\n"+
		"users: [{name: u, user: {token: user-token}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"), 0o600)

	mayMint = true
	var out, errb bytes.Buffer
	// The replica the Service picks first has not seen the leader yet (it
	// just started): the CLI waits it out.
	unavailable.Store(2)
	if code := run([]string{"report", "--kubeconfig", kubeconfig}, &out, &errb); code != exitClean {
		t.Fatalf("with a reader token: exit %d\n%s%s", code, out.String(), errb.String())
	}
	if n := unavailable.Load(); n != 0 {
		t.Errorf("%d answers of 503 left: the CLI did not retry", n)
	}
	// No leader for longer: it gives up after its tries, with the reason.
	unavailable.Store(100)
	out.Reset()
	errb.Reset()
	if code := run([]string{"report", "--kubeconfig", kubeconfig}, &out, &errb); code == exitClean || !strings.Contains(errb.String(), "no aggregator leads yet") {
		t.Errorf("with no leader: exit %d, %q", code, errb.String())
	}
	if left := unavailable.Load(); left != 100-unavailableTries {
		t.Errorf("with no leader: %d tries, want %d", 100-left, unavailableTries)
	}
	unavailable.Store(0)
	mayMint = false
	out.Reset()
	errb.Reset()
	code := run([]string{"report", "--kubeconfig", kubeconfig}, &out, &errb)
	msg := errb.String()
	if code != exitUsage || !strings.Contains(msg, "the aggregator behind service proxyaudit/proxyaudit-aggregator refused: findings are for readers only") ||
		!strings.Contains(msg, `minting one for ServiceAccount proxyaudit/proxyaudit-reader failed`) {
		t.Errorf("without a reader token: exit %d, %q", code, msg)
	}
	t.Logf("what the user reads: %s", strings.TrimSpace(msg))
}

// hostileText is what a compromised node or aggregator, or a crafted dump,
// could put where the CLI prints node text: a terminal title and hidden
// line, a bidirectional override, a Markdown link and a cell break.
const hostileText = "\x1b]0;pwned\x07\x1b[2K\rall in sync\u202e [click](https://evil.example) | <b>x</b>"

// The CLI is the last sink before a person: whatever the API or a dump
// holds, the terminal gets escapes shown, never obeyed, and a Markdown
// report keeps one finding per row with no live link.
func TestReportShowsHostileTextInert(t *testing.T) {
	fr, nr := fleet()
	fr.Findings[0].Detail = hostileText
	fr.Findings[0].Node = "node-b\x1b[8m"
	nr.Nodes[0].Warnings = []string{hostileText}
	url := serve(t, fr, nr)
	for _, format := range []string{"table", "markdown"} {
		var out, errb bytes.Buffer
		if code := run([]string{"report", "--aggregator", url, "-o", format}, &out, &errb); code != exitFindings {
			t.Fatalf("%s: exit %d: %s", format, code, errb.String())
		}
		got := out.String()
		if strings.ContainsAny(got, "\x1b\x07\r\u202e") || !strings.Contains(got, `x1b`) || !strings.Contains(got, "pwned") {
			t.Errorf("%s: control characters reach the terminal:\n%q", format, got)
		}
		if format == "markdown" {
			for _, line := range strings.Split(got, "\n") {
				if strings.HasPrefix(line, "| node-b") && strings.Count(line, "|")-strings.Count(line, `\|`) != 7 {
					t.Errorf("a finding's row has extra cells: %q", line)
				}
			}
			if strings.Count(got, "](https://evil") != strings.Count(got, `\](https://evil`) || strings.Contains(got, "<b>") {
				t.Errorf("markdown keeps a live link or tag:\n%s", got)
			}
		}
	}
}

// diff prints names from the dump itself: a chain named with a terminal
// escape is shown escaped.
func TestDiffShowsHostileDumpInert(t *testing.T) {
	dir := t.TempDir()
	cluster := filepath.Join(dir, "cluster.json")
	rules := filepath.Join(dir, "n.rules")
	os.WriteFile(cluster, []byte(`{"kind":"List","items":[{"kind":"Node","metadata":{"name":"n"}},`+
		`{"kind":"Service","metadata":{"name":"kubernetes","namespace":"default"},"spec":{"clusterIP":"198.19.0.2","ports":[{"name":"https","port":443,"protocol":"TCP"}]}},`+
		`{"kind":"EndpointSlice","metadata":{"name":"kubernetes","namespace":"default","labels":{"kubernetes.io/service-name":"kubernetes"}},"addressType":"IPv4",`+
		`"ports":[{"name":"https","port":6443,"protocol":"TCP"}],"endpoints":[{"addresses":["198.18.0.9"]}]}]}`), 0o644)
	os.WriteFile(rules, []byte("*nat\n-A KUBE-SERVICES -d 198.19.0.1/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-\x1b]0;pwned\x07\n"+
		"-A KUBE-SVC-\x1b]0;pwned\x07 -j KUBE-SEP-AAAAAAAAAAAAAAAA\n-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m tcp -j DNAT --to-destination 198.18.0.1:80\nCOMMIT\n"), 0o644)
	for _, format := range []string{"table", "markdown"} {
		var out, errb bytes.Buffer
		if code := run([]string{"diff", "--cluster", cluster, "--rules", "n=" + rules, "-o", format}, &out, &errb); code != exitFindings {
			t.Fatalf("%s: exit %d: %s\n%s", format, code, errb.String(), out.String())
		}
		if got := out.String(); strings.ContainsAny(got, "\x1b\x07") || !strings.Contains(got, `x1b`) {
			t.Errorf("%s: %q", format, got)
		}
	}
}

// Stale flows say in the table how many and whose: the columns cannot.
func TestReportStaleConntrack(t *testing.T) {
	rep := &FleetReport{At: time.Unix(1_800_000_000, 0), Nodes: []audit.NodeStatus{{Node: "n1", State: audit.NodeInSync, StaleFlows: 2}},
		Findings: []audit.TimedFinding{{Finding: audit.Finding{Node: "n1", Service: "kube-system/kube-dns", Port: "dns", Protocol: "UDP", Kind: audit.StaleConntrack,
			Endpoint: "198.18.77.3:53", Flows: 2, Detail: "2 UDP flow(s) through 198.19.0.10:53/UDP still DNATed to 198.18.77.3:53; clients 198.18.5.5:40000"}}}}
	var b strings.Builder
	reportTable(&b, rep, false)
	for _, want := range []string{"n1 (InSync): 1 finding(s)", "StaleConntrack", "198.18.77.3:53", "clients 198.18.5.5:40000"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}
