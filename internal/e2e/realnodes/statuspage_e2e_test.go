package realnodes

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/browser"
)

// The status page on the live cluster, in a real Chromium, the way an SRE
// opens it: `kubectl proxyaudit ui` on their machine, through the API
// server's service proxy to the chart's aggregators (readers only). One
// node's kube-proxy has its watch hung (alive, its metrics in sync by its own
// account) and the CoreDNS pod is replaced: the fleet
// page shows that node Stuck in the heatmap, its page the old pod's
// address STALE under kube-dns and kube-proxy's own last sync, the
// incidents page the dry-run ladder. With PROXYAUDIT_SCREENSHOTS set
// (make screenshots) its pictures, and the report's as a terminal shows
// it, are the README's.
func TestE2EStatusPageOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bctx := browser.New(t)
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		// The chart's grace (30 s): shorter, the conntrack entries of the
		// collectors' DNS lookups that ended just before CoreDNS's pod went
		// outlive it on every node (the pictures are the README's).
		"--set", "collector.interval=5s", "--set", "remediation.mode=dry-run", "--set", "remediation.maxUnhealthy=100%")
	defer uninstall(t, c)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
	waitInSync(ctx, t, c, 3*time.Minute, time.Time{}, "after helm install")

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ui := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "ui", "-n", "proxyaudit", "--listen", addr)
	var out strings.Builder
	ui.Stdout, ui.Stderr = &out, &out
	if err := ui.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { ui.Process.Kill(); ui.Wait() }()
	base := "http://" + addr + "/ui/"
	for deadline, last := time.Now().Add(time.Minute), ""; ; time.Sleep(300 * time.Millisecond) {
		if r, err := http.Get(base); err == nil {
			b, _ := io.ReadAll(r.Body)
			r.Body.Close()
			if r.StatusCode == http.StatusOK {
				break
			}
			last = fmt.Sprintf("%s: %s", r.Status, b)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			t.Fatalf("proxyaudit ui does not serve the page: %s\n%s", last, out.String())
		}
	}

	// The seed's failure, and the pictures': kube-proxy alive and serving
	// its metrics, its watch hung for as long as the pictures take, so
	// that what it says of itself (in sync, nothing pending) is beside
	// what its rules show.
	stuck := c.Node("real-ipt-a")
	pods := waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	old := net.JoinHostPort(pods[0].Status.PodIP, "53")
	says := "does not know it is behind"
	heal, err := stuck.HangProxyWatch(ctx)
	if err != nil {
		// A host without the unified cgroup hierarchy cannot match
		// kube-proxy's packets alone: freeze it instead (its metrics then
		// cannot be read, which the report says).
		t.Logf("hanging kube-proxy's watch on %s: %v; freezing it instead", stuck.Name, err)
		if heal, err = stuck.Freeze(ctx); err != nil {
			t.Fatal(err)
		}
		says = "metrics could not be read"
	}
	defer heal(context.Background())
	if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, pods[0].Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(time.Second) {
		r, raw, err := report(ctx, t, c)
		if err == nil && nodeState(r, stuck.Name) == audit.NodeStuck && slices.ContainsFunc(r.Findings, func(f audit.TimedFinding) bool {
			return f.Node == stuck.Name && f.Kind == audit.StuckProxy && strings.Contains(f.Detail, says)
		}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not Stuck with kube-proxy's metrics read (in sync by its own account):\n%s", stuck.Name, clip(raw))
		}
	}

	// The report as a terminal shows it, for the README (make screenshots).
	table, err := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "report", "-n", "proxyaudit").Output()
	if !strings.Contains(string(table), "kube-system/kube-dns") || !strings.Contains(string(table), string(audit.StuckProxy)) {
		t.Errorf("the report while %s is stuck (%v):\n%s", stuck.Name, err, table)
	}
	browser.Terminal(t, bctx, "report", "kubectl proxyaudit report", string(table))

	do := func(what string, a chromedp.Action[chromedp.Void]) {
		t.Helper()
		browser.Do(t, bctx, what+" (proxyaudit ui said: "+strings.TrimSpace(out.String())+")", a)
	}
	eval := func(js string) string { t.Helper(); return browser.Text(t, bctx, js) }
	do("the fleet page", chromedp.Navigate(base))
	do("the heatmap", chromedp.WaitVisible("#heatmap"))
	cell := fmt.Sprintf(`#heatmap [data-node="%s"]`, stuck.Name)
	if got := eval(`document.querySelector('` + cell + `').dataset.state`); got != string(audit.NodeStuck) {
		t.Errorf("%s in the heatmap: %q, want Stuck", stuck.Name, got)
	}
	if got := eval(`String(document.querySelectorAll('#heatmap [data-node]').length)`); got != fmt.Sprint(len(fleet)) {
		t.Errorf("%s cells, want %d", got, len(fleet))
	}
	browser.Picture(t, bctx, "status-fleet")
	do("opening the node", chromedp.Click(cell))
	do("the node page", chromedp.WaitVisible("#ports"))
	if got := eval(`document.querySelector('#state').innerText`); got != string(audit.NodeStuck) {
		t.Errorf("node page state %q", got)
	}
	if ports := eval(`document.querySelector('#ports').innerText`); !strings.Contains(ports, "kube-system/kube-dns") || !strings.Contains(ports, old+" stale") {
		t.Errorf("the node page does not show %s STALE under kube-dns:\n%s", old, ports)
	}
	if kp := eval(`(document.querySelector('#kubeproxy') || {innerText: ""}).innerText`); !strings.Contains(kp, "Last sync") {
		t.Errorf("kube-proxy's own account missing: %q", kp)
	}
	browser.Picture(t, bctx, "status-node")
	do("the incidents page", chromedp.Navigate(base+"incidents"))
	do("an incident", chromedp.WaitVisible(fmt.Sprintf(`.incident[data-node="%s"]`, stuck.Name)))
	if got := eval(fmt.Sprintf(`document.querySelector('.incident[data-node="%s"]').innerText`, stuck.Name)); !strings.Contains(got, "dry-run: nothing was changed") ||
		!strings.Contains(got, "RestartProxy") {
		t.Errorf("the incident:\n%s", got)
	}
	browser.Picture(t, bctx, "status-incidents")
}

func nodeState(r *fleetReport, node string) audit.NodeState {
	for _, n := range r.Nodes {
		if n.Node == node {
			return n.State
		}
	}
	return ""
}
