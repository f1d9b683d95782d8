// Command localcluster runs proxyaudit's demo: a real kube-apiserver, etcd,
// controller manager and scheduler, three real nodes (containerd and the
// genuine kubelet in network namespaces on this machine) running kube-proxy
// from its DaemonSets (two iptables, one nftables) and CoreDNS, proxyaudit
// installed with its Helm chart, and one node whose kube-proxy has silently
// stopped seeing the API while its health check stays green.
//
// Usage (as root; `make demo` does this):
//
//	localcluster demo [--out DIR] [--hold]
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/demo"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

const usage = `localcluster demo: bring up a real local Kubernetes cluster with three real
nodes, install proxyaudit's chart, drift one node, show the evidence and the repair.

Usage:
  localcluster demo [flags]

Flags:
`

func main() {
	if len(os.Args) < 2 || os.Args[1] != "demo" {
		fmt.Fprint(os.Stderr, usage)
		demoFlags(nil).PrintDefaults()
		os.Exit(2)
	}
	var opts demoOptions
	fs := demoFlags(&opts)
	if err := fs.Parse(os.Args[2:]); err != nil {
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := runDemo(ctx, opts); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

type demoOptions struct {
	out  string
	hold bool
}

func demoFlags(o *demoOptions) *flag.FlagSet {
	if o == nil {
		o = &demoOptions{}
	}
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.StringVar(&o.out, "out", "demo-out", "directory for the captured cluster state (cluster.json) and each node's rules (<node>.rules)")
	fs.BoolVar(&o.hold, "hold", false, "keep the cluster running until Ctrl-C so that you can look around; without it the demo tears down after printing")
	return fs
}

func runDemo(ctx context.Context, o demoOptions) error {
	logf := func(format string, args ...any) { fmt.Printf("  · "+format+"\n", args...) }
	fmt.Println("▶ starting etcd and kube-apiserver (built here from k8s.io/kubernetes), then real nodes, each a")
	fmt.Println("  network namespace with its own containerd and kubelet: node-a (iptables, zone-a), node-b (iptables,")
	fmt.Println("  zone-b), node-c (nftables, zone-a); kube-proxy as kubeadm runs it (DaemonSets in kube-system), CoreDNS;")
	fmt.Println("  images are built here, nothing is pulled")
	c, err := localcluster.StartTopology(ctx, localcluster.Topology{
		Kubelets: []localcluster.KubeletNodeSpec{
			{Name: "node-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
			{Name: "node-b", Mode: localcluster.ModeIPTables, Zone: "zone-b"},
			{Name: "node-c", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
		},
		ProxyModes: []localcluster.Mode{localcluster.ModeIPTables, localcluster.ModeNFTables},
		DNS:        true,
	}, logf)
	defer func() {
		fmt.Println("▶ tearing down the local cluster")
		if err := c.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "teardown:", err)
		}
	}()
	if err != nil {
		return err
	}
	if _, err := c.WaitPodsReady(ctx, "kube-system", "k8s-app=kube-proxy", 3, 2*time.Minute); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	hung := "node-b"
	_, err = demo.Run(ctx, demo.Config{Cluster: c, Drift: hung, CLI: filepath.Join(filepath.Dir(self), "proxyaudit"), Capture: o.out, Out: os.Stdout})
	if err != nil {
		return err
	}
	fmt.Printf("\nThe cluster state and every node's rules as they were while %s drifted are in %s/; the offline check:\n  %s\n",
		hung, o.out, demo.DiffCommand(c, o.out))
	if !o.hold {
		fmt.Printf(`
Next steps:
  1. Look around while the cluster runs: bin/localcluster demo --hold, then in another shell
       export KUBECONFIG=<printed by --hold>; PATH=$PWD/bin:$PATH kubectl proxyaudit report
       bin/proxyaudit ui     # the status page on http://127.0.0.1:8484/ui/
  2. Check your own cluster offline, nothing installed: on a node, iptables-save -t nat > node.rules
     (or nft -j list table ip kube-proxy, or ipvsadm -Sn); then
       kubectl get services,endpointslices,nodes -A -o json > cluster.json
       bin/proxyaudit diff --cluster cluster.json --rules NODE=node.rules
  3. Install it: helm install proxyaudit charts/proxyaudit -n proxyaudit --create-namespace
     (dry-run remediation by default; charts/proxyaudit/README.md has every value)
`)
		return nil
	}
	fmt.Printf(`
Where to look:
  export KUBECONFIG=%[2]s
  kubectl get pods -A -o wide                                            # real pods on real kubelets
  PATH=$PWD/bin:$PATH kubectl proxyaudit report                          # proxyaudit's verdict
  bin/proxyaudit ui    # the status page on http://127.0.0.1:8484/ui/ (open it in a browser)
  kubectl -n kube-system get events --field-selector involvedObject.kind=Node
  ip netns exec pa-%[1]s iptables-save -t nat | grep -E 'KUBE-(SVC|SEP)'   # a node's rules
  ip netns exec pa-node-c nft list table ip kube-proxy                    # the nftables node
  logs: %[3]s (nodes/<node>/kubelet.log, containerd.log, pod-logs/)
`, hung, c.AdminKubeconfig, c.Dir)
	fmt.Println("\nThe cluster keeps running; press Ctrl-C to tear it down.")
	<-ctx.Done()
	return nil
}
