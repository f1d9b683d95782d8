// Package realnodes tests proxyaudit where it runs in pods: real nodes
// (each a network namespace with containerd and the genuine kubelet), the
// controller manager and scheduler, kube-proxy as a DaemonSet, CoreDNS,
// and the chart installed with helm.
package realnodes

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The fleet: kube-proxy in both modes the host kernel runs, two zones.
var fleet = []localcluster.KubeletNodeSpec{
	{Name: "real-ipt-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "real-ipt-b", Mode: localcluster.ModeIPTables, Zone: "zone-b"},
	{Name: "real-nft-a", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
}

var shared struct {
	once sync.Once
	c    *localcluster.Cluster
	bin  string
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.c != nil {
		if err := shared.c.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "stop the local cluster:", err)
			code = 1
		}
		if left := localcluster.Leftovers(); len(left) > 0 {
			fmt.Fprintf(os.Stderr, "the local cluster left behind:\n  %s\n", strings.Join(left, "\n  "))
			code = 1
		}
	}
	os.Exit(code)
}

func skipUnlessCluster(t *testing.T) {
	t.Helper()
	if testing.Short() {
		t.Skip("end-to-end test skipped in -short mode (make unit); make test runs it")
	}
	if err := localcluster.CanRun(); err != nil {
		if os.Getenv("PROXYAUDIT_E2E_REQUIRE") == "1" {
			t.Fatalf("END-TO-END TEST REQUIRED BUT CANNOT RUN: %v", err)
		}
		t.Skipf("END-TO-END TEST SKIPPED: %v", err)
	}
}

// cluster brings up (once per package) the control plane with the
// controller manager and scheduler, three real nodes, kube-proxy's
// DaemonSets and CoreDNS, all Ready.
func cluster(t *testing.T) *localcluster.Cluster {
	t.Helper()
	skipUnlessCluster(t)
	shared.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
		defer cancel()
		c, err := localcluster.Start(ctx, localcluster.Config{Logf: t.Logf, KeepWorkDir: os.Getenv("KEEP") != ""})
		if err != nil {
			shared.err = err
			return
		}
		shared.c = c
		start := time.Now()
		for _, s := range fleet {
			if _, err := c.AddKubeletNode(ctx, s); err != nil {
				shared.err = err
				return
			}
		}
		t.Logf("%d real nodes Ready %s after the control plane (images built on the way)", len(fleet), time.Since(start).Round(time.Millisecond))
		for _, m := range []localcluster.Mode{localcluster.ModeIPTables, localcluster.ModeNFTables} {
			if err := c.DeployKubeProxy(ctx, m); err != nil {
				shared.err = err
				return
			}
		}
		if err := c.DeployDNS(ctx); err != nil {
			shared.err = err
			return
		}
		if shared.bin, err = os.MkdirTemp("", "proxyaudit-realnodes-bin-"); err == nil {
			err = localcluster.BuildProxyaudit(shared.bin)
		}
		shared.err = err
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return shared.c
}

// waitPods waits until want pods match selector in ns, all Running and
// Ready, and returns them.
func waitPods(ctx context.Context, t *testing.T, c *localcluster.Cluster, ns, selector string, want int, timeout time.Duration) []corev1.Pod {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err == nil {
			ready := 0
			var states []string
			for _, p := range pods.Items {
				ok := p.DeletionTimestamp == nil
				isReady := false
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
						isReady = true
					}
				}
				if ok && isReady {
					ready++
				}
				states = append(states, fmt.Sprintf("%s@%s:%s ready=%v", p.Name, p.Spec.NodeName, p.Status.Phase, isReady))
			}
			last = strings.Join(states, " ")
			if ready == want && len(pods.Items) == want {
				return pods.Items
			}
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			t.Fatalf("pods %s in %s: want %d Ready within %s; have: %s", selector, ns, want, timeout, last)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func TestE2ERealNodesRunKubeProxyAndDNS(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-proxy", len(fleet), 2*time.Minute)
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	for _, n := range c.Nodes() {
		if err := n.WaitRules(ctx, time.Minute, "default/kubernetes programmed by the DaemonSet's kube-proxy", func(rules string) bool {
			return n.RoutesTo(rules, localcluster.APIServerIP+":6443")
		}); err != nil {
			t.Fatalf("%v\nkubelet:\n%s", err, n.KubeletLog(20))
		}
	}
}

func helm(ctx context.Context, t *testing.T, c *localcluster.Cluster, args ...string) string {
	t.Helper()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	bin, err := chart.Helm(root)
	if err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.AdminKubeconfig, "HELM_CACHE_HOME="+home+"/cache",
		"HELM_CONFIG_HOME="+home+"/config", "HELM_DATA_HOME="+home+"/data")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// report runs `kubectl proxyaudit report -o json` as the chart's README
// says, through the API server's proxy to the aggregator's pods.
func report(ctx context.Context, t *testing.T, c *localcluster.Cluster) (*api.FindingsResponse, string, error) {
	t.Helper()
	plugin := filepath.Join(shared.bin, "kubectl-proxyaudit")
	if _, err := os.Stat(plugin); err != nil {
		if err := os.Link(filepath.Join(shared.bin, "proxyaudit"), plugin); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.CommandContext(ctx, c.Kubectl(), "proxyaudit", "report", "-n", "proxyaudit", "-o", "json")
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.AdminKubeconfig, "PATH="+shared.bin+":"+os.Getenv("PATH"))
	out, err := cmd.Output()
	var r api.FindingsResponse
	if jerr := json.Unmarshal(out, &r); jerr != nil {
		var ee *exec.ExitError
		stderr := ""
		if errors.As(err, &ee) {
			stderr = string(ee.Stderr)
		}
		return nil, string(out) + stderr, fmt.Errorf("report: %v (%v)", jerr, err)
	}
	return &r, string(out), nil
}

// waitInSync waits for a report with every node in sync and no finding.
func waitInSync(ctx context.Context, t *testing.T, c *localcluster.Cluster, timeout time.Duration, what string) *api.FindingsResponse {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		r, raw, err := report(ctx, t, c)
		if err == nil && r.Stale == nil && r.Summary.Nodes == len(fleet) && r.Summary.NodesInSync == len(fleet) && len(r.Findings) == 0 {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no report with %d nodes in sync within %s; last: %v\n%s", what, len(fleet), timeout, err, raw)
		}
		time.Sleep(time.Second)
	}
}

// The README's quickstart on real nodes: helm install, every pod Ready,
// the collectors in their pods read every node's rules, the report says
// in sync; then the leading aggregator's pod is deleted.
func TestE2EChartOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	start := time.Now()
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace")
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=collector", len(fleet), 3*time.Minute)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
	t.Logf("helm install: every pod Ready after %s", time.Since(start).Round(time.Millisecond))
	r := waitInSync(ctx, t, c, 3*time.Minute, "after helm install")
	t.Logf("report: %d nodes in sync %s after helm install; leader %s", r.Summary.NodesInSync, time.Since(start).Round(time.Millisecond), r.Leader)
}
