package live

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

// The chart on the oldest Kubernetes it supports (Chart.yaml's
// kubeVersion; localcluster.OldestKubernetes), beside the test cluster's
// own release: a second control plane whose API server and kube-proxies
// are that release's, built from its own k8s.io/kubernetes module. `helm
// install` (the API server's version against kubeVersion, every object
// through its admission and schema, the ValidatingAdmissionPolicies among
// them) and uninstall; then the aggregators and collectors as the chart
// runs them, every node in sync on 1.33's rules, and a frozen kube-proxy
// found.
func TestE2EOldestKubernetes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	v := localcluster.OldestKubernetes
	apiserver, err := localcluster.ToolAt(ctx, v, "kube-apiserver")
	if err != nil {
		t.Fatalf("kube-apiserver %s (make cluster-binaries builds it): %v", v, err)
	}
	proxy, err := localcluster.ToolAt(ctx, v, "kube-proxy")
	if err != nil {
		t.Fatalf("kube-proxy %s (make cluster-binaries builds it): %v", v, err)
	}
	start := time.Now()
	b := localcluster.Up(t, localcluster.Topology{Own: true, Nodes: secondNodes,
		Config: localcluster.Config{Instance: 1, APIServer: apiserver, KubeProxy: proxy}})
	sv, err := b.Client.Discovery().ServerVersion()
	if err != nil || sv.GitVersion != v {
		t.Fatalf("the second API server says %v (%v), want %s", sv, err, v)
	}
	for _, n := range b.Nodes() {
		out, err := n.Exec(ctx, proxy, "--version")
		if err != nil || !strings.Contains(out, v) {
			t.Fatalf("%s's kube-proxy says %q (%v), want %s", n.Name, out, err, v)
		}
	}
	t.Logf("cluster on %s (API server %s) with %d nodes in %s", v, b.APIServer(), len(secondNodes), time.Since(start).Round(time.Second))

	// helm install as a user runs it, then uninstall.
	sys := &localcluster.System{C: b, Namespace: "proxyaudit-helm"}
	helm := func(args ...string) {
		t.Helper()
		if _, err := sys.Helm(ctx, args...); err != nil {
			t.Fatalf("on %s: %v", v, err)
		}
	}
	helm("install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit-helm", "--create-namespace", "--wait=false")
	vaps, err := b.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().List(ctx, metav1.ListOptions{})
	if err != nil || len(vaps.Items) == 0 {
		t.Errorf("the chart's ValidatingAdmissionPolicies on %s: %d, %v", v, len(vaps.Items), err)
	}
	if err := sys.Uninstall(ctx); err != nil {
		t.Fatalf("on %s: %v", v, err)
	}

	// The binaries as the chart runs them, on 1.33's rules.
	l := newLiveOn(ctx, t, b, secondNodes, secondReplicaIPs)
	t.Logf("%s: every node in sync after %s", v, time.Since(start).Round(time.Second))
	const node = "agg-nft"
	undo, err := b.Node(node).Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = undo(context.Background()) })
	l.epoch++
	for i := range 3 {
		if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	took := l.waitFor("StaleEndpoint on "+node, grace+2*interval+30*time.Second, func(fs []audit.TimedFinding) bool {
		return findings.Has(fs, node, audit.StaleEndpoint)
	})
	if fs, _ := l.findings(); len(findings.Only(fs, node)) != len(fs) {
		t.Errorf("%s: findings on nodes whose kube-proxy runs:\n%s", v, findings.Describe(fs))
	}
	t.Logf("%s: StaleEndpoint on frozen %s after %s", v, node, took.Round(100*time.Millisecond))
	if err := undo(ctx); err != nil {
		t.Fatal(err)
	}
	l.waitAllInSync(v + ": in sync after the thaw")
}
