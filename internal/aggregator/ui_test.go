package aggregator

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/chromedp/chromedp"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/browser"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// The status page in a real Chromium, served by the real aggregator over
// the stream from real collectors: n3's rules keep an endpoint the
// cluster no longer has, its service chain named with markup. The fleet page
// shows n3 in the heatmap in the state the API says; clicking it opens
// the node page with the STALE endpoint under its service; the markup is
// text; the incidents page shows the dry-run restart.
func TestStatusPageInChromium(t *testing.T) {
	client := fakeCluster()
	h := startWith(t, 2*time.Second, auth.InsecureNoAuth{}, client, nil)
	h.settle = realTime // Chromium reaches the status page over a real socket
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-n3", Labels: map[string]string{"k8s-app": "kube-proxy"},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: "kube-proxy", UID: "ds"}}},
		Spec: corev1.PodSpec{NodeName: "n3"}}
	if _, err := client.CoreV1().Pods("kube-system").Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := remediate.DefaultPolicy() // dry-run
	p.MaxUnhealthy = remediate.MustBudget("100%")
	ex := &effect.Executor{Client: client, Policy: p, Clock: h.clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy"}
	h.agg.cfg.Remediation = &Remediation{Policy: p, Executor: ex}
	const evil = `<script>document.title="pwned"</script>`
	stale := netip.MustParseAddrPort("198.18.250.250:8080")
	for _, name := range []string{"n1", "n2", "n3"} {
		h.collector(h.ctx, name, func() *audit.Observed {
			o := rules(t)
			if name == "n3" {
				for i := range o.Frontends {
					if !o.Frontends[i].NodePort && o.Frontends[i].IP == synth.VIP(0) {
						o.Frontends[i].Endpoints = append(o.Frontends[i].Endpoints, audit.Endpoint{Addr: stale, Weight: -1})
						o.Frontends[i].Chain = "KUBE-SVC-" + evil // the node names its rules
					}
				}
			}
			return o
		})
	}
	h.until(30*time.Second, "n3 drifted and a dry-run restart decided", func() bool {
		for _, e := range h.agg.journal.recent("n3", 10) {
			if e.Kind == string(remediate.RestartProxy) && e.DryRun {
				return true
			}
		}
		return false
	})
	want := ""
	for _, n := range h.verdict().Nodes {
		if n.Node == "n3" {
			want = string(n.State)
		}
	}
	srv := httptest.NewServer(h.agg.Handler("0"))
	defer srv.Close()

	ctx := browser.New(t)
	step := func(what string, a chromedp.Action[chromedp.Void]) { t.Helper(); browser.Do(t, ctx, what, a) }
	eval := func(js string) string { t.Helper(); return browser.Text(t, ctx, js) }

	step("the fleet page", chromedp.Navigate(srv.URL+"/ui/"))
	step("the heatmap", chromedp.WaitVisible("#heatmap"))
	if got := eval(`document.querySelector('#heatmap [data-node="n3"]').dataset.state`); got != want || want == string(audit.NodeInSync) {
		t.Errorf("n3 in the heatmap: %q, the verdict says %q", got, want)
	}
	if got := eval(`String(document.querySelectorAll('#heatmap [data-node]').length)`); got != "3" {
		t.Errorf("%s cells in the heatmap, want 3", got)
	}
	if got := eval(`document.querySelector('#worst').innerText`); !strings.Contains(got, "n3") {
		t.Errorf("n3 not among the nodes to look at: %q", got)
	}
	browser.Screenshot(t, ctx, "fleet")

	step("clicking n3", chromedp.Click(`#heatmap [data-node="n3"]`))
	step("the node page", chromedp.WaitVisible("#ports"))
	ports := eval(`document.querySelector('#ports').innerText`)
	if !strings.Contains(ports, stale.String()+" stale") || !strings.Contains(ports, evil) {
		t.Errorf("node page's rules:\n%s", ports)
	}
	if got := eval(`document.title + " / " + document.scripts.length`); strings.Contains(got, "pwned") || !strings.HasSuffix(got, " / 1") {
		t.Errorf("the node's markup ran: title and scripts %q", got)
	}
	if got := eval(`document.querySelector('#state').innerText`); got != want {
		t.Errorf("node state %q, want %q", got, want)
	}
	browser.Screenshot(t, ctx, "node-n3")

	step("the incidents page", chromedp.Navigate(srv.URL+"/ui/incidents"))
	step("the incidents", chromedp.WaitVisible("#incidents"))
	if got := eval(`document.querySelector('.incident[data-node="n3"] tr.k-RestartProxy.dry').innerText`); !strings.Contains(got, "dry-run") {
		t.Errorf("the dry-run restart: %q", got)
	}
	browser.Screenshot(t, ctx, "incidents")
}

// The status page answers who may read exactly as the API does: the
// same reader authentication in front of both, a follower sends both to
// the leader.
func TestStatusPageBehindReaderAuth(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
		h.collector(h.ctx, "n1", func() *audit.Observed { return rules(t) })
		h.until(20*time.Second, "a verdict", func() bool { return len(h.verdict().Nodes) > 0 })
		h.agg.cfg.Readers = &auth.ReaderAuth{Client: fakeCluster(), Audience: "proxyaudit", Namespace: "pa", Service: "agg", Clock: h.clk}
		srvURL, hc := h.net.HTTPServer(t, h.agg.Handler("0"))
		get := func(path string) (int, string) {
			r, err := hc.Get(srvURL + path)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Body.Close()
			b, _ := io.ReadAll(r.Body)
			return r.StatusCode, string(b)
		}
		apiCode, apiBody := get("/api/v1/findings")
		for _, path := range []string{"/ui/", "/ui/nodes/n1", "/ui/incidents", "/ui/static/style.css"} {
			if code, body := get(path); code != apiCode || body != apiBody || code != http.StatusUnauthorized {
				t.Errorf("%s without a token: %d %q; the API: %d %q", path, code, body, apiCode, apiBody)
			}
		}
	})
}
