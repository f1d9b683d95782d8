package localcluster

import (
	"context"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

// Topology is what a test's cluster is made of: the control plane's
// Config (families, the instance, another release's API server or
// kube-proxy), its namespace nodes, its real kubelet nodes and what runs
// on them. Up is the one way a test gets a cluster; a test adds the IPVS
// VM's node (AddVMNode) or a node beside them as a step of its own.
type Topology struct {
	Config
	// Own: a cluster of the test's own, started by Up and stopped when the
	// test ends (a dual-stack API server, a second instance). Otherwise the
	// package's shared cluster, started by its first Up and stopped after
	// the package's tests (Main); every Up of a package must then ask for
	// the same topology.
	Own bool
	// Nodes are namespace nodes, in order.
	Nodes []NodeSpec
	// Kubelets are real kubelet nodes (lane 0 only), Ready before Up
	// returns; then kube-proxy's DaemonSet of each of ProxyModes and,
	// with DNS, CoreDNS, their pods Ready.
	Kubelets   []KubeletNodeSpec
	ProxyModes []Mode
	DNS        bool
}

// Up returns the test's cluster of topology: the package's shared one
// (started at its first use) or, with Own, one of the test's own. It
// skips the test where the machine cannot run it (fails it under
// PROXYAUDIT_E2E_REQUIRE=1) and in -short mode.
func Up(t testing.TB, topology Topology) *Cluster {
	t.Helper()
	if shared.skip != "" && !topology.Own {
		t.Skipf("END-TO-END TEST SKIPPED: %s", shared.skip)
	}
	NeedRoot(t, false)
	if topology.Own {
		c, err := StartTopology(context.Background(), topology, t.Logf)
		t.Cleanup(func() {
			if err := c.Stop(); err != nil {
				t.Errorf("stop the local cluster: %v", err)
			}
			// Another instance's, or the package's shared cluster, may
			// still run: only a lone cluster leaves nothing behind.
			if topology.Instance == 0 && shared.cluster == nil {
				if left := Leftovers(); len(left) > 0 {
					t.Errorf("the local cluster left behind:\n  %s", strings.Join(left, "\n  "))
				}
			}
		})
		if err != nil {
			t.Fatalf("local cluster: %v", err)
		}
		return c
	}
	shared.once.Do(func() {
		shared.topology = topology
		logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, "localcluster: "+format+"\n", args...) }
		shared.cluster, shared.err = StartTopology(context.Background(), topology, logf)
	})
	if shared.err != nil {
		t.Fatalf("local cluster: %v", shared.err)
	}
	if !reflect.DeepEqual(shared.topology, topology) {
		t.Fatalf("local cluster: this package's tests ask for two topologies (%+v, then %+v); a test that needs another sets Own", shared.topology, topology)
	}
	return shared.cluster
}

// StartTopology starts the cluster of topology and its nodes, for Up and
// for the demo (cmd/localcluster), which runs outside a test; tests use
// Up. The cluster is returned with the error when it started, so that it
// is stopped.
func StartTopology(ctx context.Context, topology Topology, logf func(string, ...any)) (*Cluster, error) {
	cfg := topology.Config
	cfg.Logf = logf
	if cfg.KubeProxy == "" {
		cfg.KubeProxy = os.Getenv(KubeProxyEnv) // another release's (make fixtures K8S_VERSION=…)
	}
	if os.Getenv("PROXYAUDIT_KEEP") != "" {
		cfg.KeepWorkDir = true
	}
	// Start waits for the lane's cluster lock while other packages'
	// clusters run (go test's -timeout bounds that); the nodes' own budget
	// begins once the control plane is up.
	c, err := Start(ctx, cfg)
	if err != nil {
		return c, err
	}
	ctx, cancel := context.WithTimeout(ctx, 20*time.Minute)
	defer cancel()
	for _, spec := range topology.Nodes {
		if _, err := c.AddNode(ctx, spec); err != nil {
			return c, err
		}
	}
	if len(topology.Kubelets) > 0 {
		start := time.Now()
		for _, spec := range topology.Kubelets {
			if _, err := c.AddKubeletNode(ctx, spec); err != nil {
				return c, err
			}
		}
		logf("%d real nodes Ready %s after the control plane (images built on the way)", len(topology.Kubelets), time.Since(start).Round(time.Millisecond))
	}
	for _, m := range topology.ProxyModes {
		if err := c.DeployKubeProxy(ctx, m); err != nil {
			return c, err
		}
	}
	if topology.DNS {
		if err := c.DeployDNS(ctx); err != nil {
			return c, err
		}
	}
	return c, nil
}
