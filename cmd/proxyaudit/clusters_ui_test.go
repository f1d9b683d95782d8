package main

import (
	"github.com/spf13/pflag"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"

	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/browser"
)

// proxyaudit ui with several contexts, in a real Chromium: the clusters
// side by side, each read through its own API server (a cluster that
// cannot be reached says so, the others still show), the nodes to look at
// linking into that cluster's own node page, served through its API
// server's service proxy.
func TestUIAcrossClusters(t *testing.T) {
	fr, nr := fleet()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	cfg := kubeconfig(t, map[string]string{
		"prod-eu": apiServer(t, fr, nr),
		"arn:aws:eks:eu-west-1:123456789012:cluster/b": apiServer(t, api.FindingsResponse{At: fr.At}, api.NodesResponse{At: nr.At, Nodes: nr.Nodes[:1]}),
		"gone": down.URL,
	})
	fs := pflag.NewFlagSet("ui", pflag.ContinueOnError)
	a := accessFlags(fs, true)
	if err := fs.Parse([]string{"--kubeconfig", cfg, "--timeout", "5s"}); err != nil {
		t.Fatal(err)
	}
	contexts, err := a.clusters(true)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(hostGuard(nil, a.clustersUI(contexts, io.Discard)))
	defer srv.Close()

	ctx := browser.New(t)
	step := func(what string, act chromedp.Action[chromedp.Void]) { t.Helper(); browser.Do(t, ctx, what, act) }
	eval := func(js string) string { t.Helper(); return browser.Text(t, ctx, js) }
	step("the clusters page", chromedp.Navigate(srv.URL+"/"))
	step("its table", chromedp.WaitVisible("#clusters"))
	rows := eval(`[...document.querySelectorAll('#clusters tbody tr')].map(r => r.dataset.cluster + ' | ' + r.innerText.replace(/\s+/g, ' ')).join('\n')`)
	for _, want := range []string{
		"arn:aws:eks:eu-west-1:123456789012:cluster/b | arn:aws:eks:eu-west-1:123456789012:cluster/b 1 1 InSync 0 none",
		"gone | gone cannot be read: cannot reach the API server",
		"prod-eu | prod-eu 4 2 InSync 1 Missing 1 Stuck 4 node-b Stuck · 3 finding(s) node-d Missing · 1 finding(s)",
	} {
		if !strings.Contains(rows, want) {
			t.Errorf("the clusters page does not show %q:\n%s", want, rows)
		}
	}
	if got := eval(`document.querySelector('#unreadable').innerText`); !strings.Contains(got, "1 cluster(s) could not be read") {
		t.Errorf("the banner says %q", got)
	}
	if got := eval(`getComputedStyle(document.querySelector('header')).display`); got == "" {
		t.Error("the stylesheet did not load")
	}
	browser.Picture(t, ctx, "clusters")

	_, port, _ := net.SplitHostPort(strings.TrimPrefix(srv.URL, "http://"))
	step("clicking node-b of prod-eu", chromedp.Click(`tr[data-cluster="prod-eu"] a[href$="nodes/node-b"]`))
	step("node-b's page", chromedp.WaitVisible("#node"))
	if got := eval(`location.host + location.pathname + ' ' + document.querySelector('#node').innerText`); got != "prod-eu.localhost:"+port+"/ui/nodes/node-b node-b Stuck" {
		t.Errorf("the node page: %q", got)
	}
	step("its fleet link", chromedp.Click(`header nav a`))
	step("prod-eu's fleet page", chromedp.WaitVisible("#states"))
	if got := eval(`location.pathname`); got != "/ui/" {
		t.Errorf("the node page's fleet link went to %s", got)
	}
	eks := "http://arn-aws-eks-eu-west-1-123456789012-cluster-b.localhost:" + port
	step("the EKS cluster's page", chromedp.Navigate(eks+"/ui/"))
	step("its states", chromedp.WaitVisible("#states"))
	if got := eval(`document.querySelector('#states').innerText.replace(/\s+/g, ' ')`); got != "1 InSync" {
		t.Errorf("the EKS cluster's fleet page shows %q", got)
	}
	// Script on one cluster's page cannot read another's (each cluster has
	// an origin of its own: trust review 4, item 5): the request is
	// refused before that cluster's credentials are attached, and the
	// browser hands the page nothing.
	prod := "http://prod-eu.localhost:" + port + "/ui/nodes/node-b"
	if got := eval(`fetch(` + strconv.Quote(prod) + `).then(r => r.text()).then(t => 'read: ' + t.length, e => 'refused: ' + e)`); !strings.HasPrefix(got, "refused") {
		t.Errorf("the EKS cluster's page read prod-eu's: %s", got)
	}
	if got := eval(`fetch('/clusters/').then(r => String(r.status), e => 'refused')`); got != "404" {
		t.Errorf("a cluster's origin serves the clusters page: %s", got)
	}
}

func TestClusterSlugs(t *testing.T) {
	got := clusterSlugs([]string{"prod-eu", "Prod_EU", "arn:aws:eks:eu-west-1:1:cluster/b", "prod-eu", "///", "gke_p_europe-west1_c"})
	want := "prod-eu prod-eu-2 arn-aws-eks-eu-west-1-1-cluster-b prod-eu-3 cluster gke-p-europe-west1-c"
	if strings.Join(got, " ") != want {
		t.Errorf("slugs %q, want %q", strings.Join(got, " "), want)
	}
}
