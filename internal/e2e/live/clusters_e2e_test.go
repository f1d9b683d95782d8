package live

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/browser"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

// The second cluster's nodes repeat the first's names: in a fleet of
// clusters node names are not unique, the cluster is part of the name.
var secondNodes = []localcluster.NodeSpec{
	{Name: "agg-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "agg-nft", Mode: localcluster.ModeNFTables, Zone: "zone-b"},
}

// Its replicas, on addresses of their own beside the first cluster's.
var secondReplicaIPs = []string{"198.18.2.250", "198.18.2.251"}

// Two clusters, each with its own etcd, API server, kube-proxies,
// aggregators and collectors, as a platform team runs them: a frozen
// kube-proxy in each, found in each; each cluster's findings as OpenReports
// in its own API server and nowhere else, gone when the drift ends; one
// `proxyaudit report` and one `proxyaudit ui` (in Chromium) across both
// contexts; and the report with one cluster's API server gone.
func TestE2ETwoClusters(t *testing.T) {
	ctx := context.Background()
	a := localcluster.Shared(t)
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	crd, err := os.ReadFile(filepath.Join(root, "charts/proxyaudit/files/openreports.io_clusterreports.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := chart.ApplyCRD(ctx, a.RESTConfig, crd, "openreports.io/v1alpha1"); err != nil {
		t.Fatal(err)
	}
	// Later tests of the shared cluster run without the CRD, as before.
	t.Cleanup(func() { deleteReportsCRD(t, a) })
	la := newLive(ctx, t, "openReports.enabled=true")

	start := time.Now()
	b := localcluster.Up(t, localcluster.Topology{Own: true, Config: localcluster.Config{Instance: 1}, Nodes: secondNodes})
	if err := chart.ApplyCRD(ctx, b.RESTConfig, crd, "openreports.io/v1alpha1"); err != nil {
		t.Fatal(err)
	}
	lb := newLiveOn(ctx, t, b, secondNodes, secondReplicaIPs, "openReports.enabled=true")
	t.Logf("second cluster (API server %s) up, %d nodes in sync, in %s", b.APIServer(), len(secondNodes), time.Since(start).Round(time.Second))

	// One frozen kube-proxy in each cluster, a different node in each;
	// then the endpoints of three services move.
	frozen := map[*live]string{la: "agg-ipt", lb: "agg-nft"}
	thaw := map[*live]localcluster.Undo{}
	for l, node := range frozen {
		undo, err := l.c.Node(node).Freeze(ctx)
		if err != nil {
			t.Fatal(err)
		}
		thaw[l] = undo
		t.Cleanup(func() { _ = undo(ctx) })
		l.epoch++
		for i := range 3 {
			if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
				t.Fatal(err)
			}
		}
	}
	for l, node := range frozen {
		took := l.waitFor("StaleEndpoint on "+node, grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
			return findings.Has(fs, node, audit.StaleEndpoint)
		})
		fs, _ := l.findings()
		if len(findings.Only(fs, node)) != len(fs) {
			t.Errorf("%s: findings on nodes whose kube-proxy runs:\n%s", l.c.APIServer(), findings.Describe(fs))
		}
		t.Logf("%s: StaleEndpoint on %s after %s", l.c.APIServer(), node, took.Round(100*time.Millisecond))
	}

	// Each API server holds the report of its own frozen node, and only it.
	for l, node := range frozen {
		waitReports(t, l.c, []string{openreports.Name(node)}, 30*time.Second)
		// The report is written when the node's first finding shows and
		// rewritten as the others pass the grace: wait for all nine.
		var r openreports.ClusterReport
		stale := 0
		_, err := testkit.Poll(30*time.Second, func() bool {
			r = getReport(t, l.c, openreports.Name(node))
			stale = 0
			for _, res := range r.Results {
				if res.Policy == "proxyaudit/StaleEndpoint" {
					stale++
				}
			}
			return stale == 9
		})
		if r.Scope == nil || r.Scope.Kind != "Node" || r.Scope.Name != node || r.Summary.Fail == 0 {
			t.Errorf("%s: the report of %s: scope %+v, summary %+v", l.c.APIServer(), node, r.Scope, r.Summary)
		}
		if err != nil {
			t.Errorf("%s: want 9 StaleEndpoint results (3 endpoints of 3 services) in %s's report, got %d %s", l.c.APIServer(), node, stale, err)
		}
	}

	// One report across both clusters, the SRE's view of each.
	multi := twoContexts(t, la, lb)
	out, code := la.report(t, "--kubeconfig", multi, "--context", "alpha", "--context", "beta")
	stale := map[string]int{} // "cluster node" → StaleEndpoint rows
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) >= 4 && (f[0] == "alpha" || f[0] == "beta") && f[3] == string(audit.StaleEndpoint) {
			stale[f[0]+" "+f[1]]++
		}
	}
	t.Logf("proxyaudit report --context alpha --context beta (exit %d):\n%s", code, out)
	if code != 1 || stale["alpha agg-ipt"] != 9 || stale["beta agg-nft"] != 9 || len(stale) != 2 {
		t.Errorf("proxyaudit report across two clusters: exit %d, StaleEndpoint rows %v, want 9 for alpha's agg-ipt and beta's agg-nft\n%s", code, stale, out)
	}
	out, code = la.report(t, "--kubeconfig", multi, "--all-contexts", "-o", "json")
	var all struct {
		Clusters []struct {
			Context string `json:"context"`
			Report  *struct {
				Findings []audit.TimedFinding `json:"findings"`
			} `json:"report"`
			Error string `json:"error"`
		} `json:"clusters"`
	}
	if err := json.Unmarshal([]byte(out), &all); err != nil || code != 1 || len(all.Clusters) != 2 {
		t.Fatalf("proxyaudit report --all-contexts -o json: exit %d, %v\n%s", code, err, out)
	}
	for _, c := range all.Clusters {
		want := map[string]string{"alpha": "agg-ipt", "beta": "agg-nft"}[c.Context]
		if c.Error != "" || c.Report == nil || len(c.Report.Findings) == 0 || len(findings.Only(c.Report.Findings, want)) != len(c.Report.Findings) {
			t.Errorf("--all-contexts: %s should show findings of %s only: %s", c.Context, want, out)
		}
	}

	// The clusters page of `proxyaudit ui` across both, in Chromium.
	uiAcrossClusters(t, la, multi)

	// The drift ends in both: the reports go, from both API servers.
	for l, undo := range thaw {
		if err := undo(ctx); err != nil {
			t.Fatal(err)
		}
		l.waitAllInSync(fmt.Sprintf("%s in sync after the thaw", l.c.APIServer()))
	}
	for l := range frozen {
		waitReports(t, l.c, nil, 30*time.Second)
	}

	// The second cluster's API server goes away: the first still reports,
	// the second is named with why, and the exit status says so.
	startAPI, err := b.StopAPIServer()
	if err != nil {
		t.Fatal(err)
	}
	out, code = la.report(t, "--kubeconfig", multi, "--context", "alpha", "--context", "beta")
	t.Logf("the same with beta's API server stopped (exit %d):\n%s", code, out)
	if code != 2 || !startsLine(out, "beta", "-") || !strings.Contains(out, "UNREADABLE: cannot reach the API server") || !startsLine(out, "alpha", "0") {
		t.Errorf("proxyaudit report with the second cluster's API server down: exit %d\n%s", code, out)
	}
	if err := startAPI(ctx); err != nil {
		t.Fatal(err)
	}
}

// startsLine says whether a line of out begins with these fields.
func startsLine(out string, fields ...string) bool {
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= len(fields) && strings.Join(f[:len(fields)], " ") == strings.Join(fields, " ") {
			return true
		}
	}
	return false
}

// twoContexts writes one kubeconfig with the SRE's context of each
// cluster, named alpha and beta.
func twoContexts(t *testing.T, a, b *live) string {
	t.Helper()
	out := clientcmdapi.NewConfig()
	for name, l := range map[string]*live{"alpha": a, "beta": b} {
		cfg, err := clientcmd.LoadFromFile(l.sreKubeconfig)
		if err != nil {
			t.Fatal(err)
		}
		cur := cfg.Contexts[cfg.CurrentContext]
		out.Clusters[name] = cfg.Clusters[cur.Cluster]
		out.AuthInfos[name] = cfg.AuthInfos[cur.AuthInfo]
		ctx := clientcmdapi.NewContext()
		ctx.Cluster, ctx.AuthInfo, ctx.Namespace = name, name, ns
		out.Contexts[name] = ctx
	}
	out.CurrentContext = "alpha"
	path := filepath.Join(a.dir, "alpha-beta.kubeconfig")
	if err := clientcmd.WriteToFile(*out, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// uiAcrossClusters serves `proxyaudit ui` over both contexts (the real
// binary, as the SRE runs it) and reads its clusters page in Chromium:
// each cluster's frozen node to look at, and its link into that cluster's
// own node page through that cluster's API server.
func uiAcrossClusters(t *testing.T, l *live, kubeconfig string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	cmd := exec.Command(filepath.Join(l.bin, "proxyaudit"), "ui", "--kubeconfig", kubeconfig, "--all-contexts", "--listen", addr)
	var log strings.Builder
	cmd.Stdout, cmd.Stderr = &log, &log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if r, err := http.Get("http://" + addr + "/"); err == nil {
			r.Body.Close()
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("proxyaudit ui did not answer on %s: %v\n%s", addr, err, log.String())
		}
	}
	ctx := browser.New(t)
	step := func(what string, act chromedp.Action[chromedp.Void]) { t.Helper(); browser.Do(t, ctx, what, act) }
	eval := func(js string) string { t.Helper(); return browser.Text(t, ctx, js) }
	step("the clusters page", chromedp.Navigate("http://"+addr+"/"))
	step("its table", chromedp.WaitVisible("#clusters"))
	rows := eval(`[...document.querySelectorAll('#clusters tbody tr')].map(r => r.dataset.cluster + ' | ' + r.innerText.replace(/\s+/g, ' ')).join('\n')`)
	for cluster, want := range map[string][]string{
		"alpha": {"alpha | alpha 3 2 InSync 1 Stuck", "agg-ipt Stuck"},
		"beta":  {"beta | beta 2 1 InSync 1 Stuck", "agg-nft Stuck"},
	} {
		if row := rowOf(rows, cluster); !strings.HasPrefix(row, want[0]) || !strings.Contains(row, want[1]) {
			t.Errorf("the clusters page's row of %s is not %q … %q:\n%s\n%s", cluster, want[0], want[1], rows, log.String())
		}
	}
	step("clicking beta's agg-nft", chromedp.Click(`tr[data-cluster="beta"] a[href$="nodes/agg-nft"]`))
	step("its node page", chromedp.WaitVisible("#node"))
	// Each cluster on an origin of its own (trust review 4, item 5).
	if got := eval(`location.hostname + location.pathname + ' ' + document.querySelector('#node').innerText`); got != "beta.localhost/ui/nodes/agg-nft agg-nft Stuck" {
		t.Errorf("beta's node page, read through beta's API server: %q", got)
	}
}

// rowOf is the clusters page row of one cluster.
func rowOf(rows, cluster string) string {
	for _, r := range strings.Split(rows, "\n") {
		if strings.HasPrefix(r, cluster+" | ") {
			return r
		}
	}
	return ""
}

// waitReports waits until proxyaudit's ClusterReports in c are exactly
// names (sorted).
func waitReports(t *testing.T, c *localcluster.Cluster, names []string, d time.Duration) {
	t.Helper()
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(names)
	var got []string
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		list, err := dc.Resource(openreports.Resource).List(context.Background(), metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
		if err != nil {
			continue
		}
		got = got[:0]
		for _, u := range list.Items {
			got = append(got, u.GetName())
		}
		sort.Strings(got)
		if strings.Join(got, ",") == strings.Join(names, ",") {
			return
		}
	}
	t.Fatalf("%s: ClusterReports %v after %s, want %v", c.APIServer(), got, d, names)
}

func getReport(t *testing.T, c *localcluster.Cluster, name string) openreports.ClusterReport {
	t.Helper()
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	u, err := dc.Resource(openreports.Resource).Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := u.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	var r openreports.ClusterReport
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// deleteReportsCRD removes the OpenReports CRD (and so every report) and
// waits until it is gone.
func deleteReportsCRD(t *testing.T, c *localcluster.Cluster) {
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Error(err)
		return
	}
	crds := dc.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	const name = "clusterreports.openreports.io"
	if err := crds.Delete(context.Background(), name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete the OpenReports CRD: %v", err)
		return
	}
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if _, err := crds.Get(context.Background(), name, metav1.GetOptions{}); apierrors.IsNotFound(err) {
			return
		}
	}
	t.Errorf("the OpenReports CRD is still there a minute after its deletion")
}
