// Package realnodes tests proxyaudit where it runs in pods: real nodes
// (each a network namespace with containerd and the genuine kubelet), the
// controller manager and scheduler, kube-proxy as a DaemonSet.
package realnodes

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

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

// waitPods waits until every pod matching selector in ns is Running and
// Ready, and there are want of them.
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
				ok := false
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
						ok = true
					}
				}
				if ok {
					ready++
				}
				states = append(states, p.Name+"@"+p.Spec.NodeName+":"+string(p.Status.Phase))
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

func TestE2ERealNodesRunKubeProxyDaemonSet(t *testing.T) {
	skipUnlessCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	c, err := localcluster.Start(ctx, localcluster.Config{Logf: t.Logf, KeepWorkDir: os.Getenv("KEEP") != ""})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
		if left := localcluster.Leftovers(); len(left) > 0 {
			t.Errorf("the cluster left behind:\n  %s", strings.Join(left, "\n  "))
		}
	}()
	start := time.Now()
	for _, s := range []localcluster.KubeletNodeSpec{
		{Name: "real-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
		{Name: "real-nft", Mode: localcluster.ModeNFTables, Zone: "zone-b"},
	} {
		if _, err := c.AddKubeletNode(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("two real nodes Ready %s after the control plane", time.Since(start).Round(time.Millisecond))
	for _, m := range []localcluster.Mode{localcluster.ModeIPTables, localcluster.ModeNFTables} {
		if err := c.DeployKubeProxy(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-proxy", 2, 2*time.Minute)
	for _, n := range c.Nodes() {
		if err := n.WaitRules(ctx, time.Minute, "default/kubernetes programmed by the DaemonSet's kube-proxy", func(rules string) bool {
			return n.RoutesTo(rules, localcluster.APIServerIP+":6443")
		}); err != nil {
			t.Fatalf("%v\nkubelet:\n%s", err, n.KubeletLog(20))
		}
	}
}
