// Command localcluster runs proxyaudit's demo: a real kube-apiserver, etcd and
// three real kube-proxies (two iptables, one nftables) in network namespaces
// on this machine, a handful of services, and one node whose kube-proxy has
// silently stopped seeing the API while its health check stays green.
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
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

const usage = `localcluster demo: bring up a real local Kubernetes control plane and three
kube-proxy nodes, drift one of them, and show the evidence.

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
	if err := demo(ctx, opts); err != nil {
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

func demo(ctx context.Context, o demoOptions) error {
	logf := func(format string, args ...any) { fmt.Printf("  · "+format+"\n", args...) }
	fmt.Println("▶ starting etcd and kube-apiserver (built from k8s.io/kubernetes; the first run compiles them, ~5-7 min)")
	c, err := localcluster.Start(ctx, localcluster.Config{Logf: logf})
	if err != nil {
		return err
	}
	defer func() {
		fmt.Println("▶ tearing down the local cluster")
		if err := c.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "teardown:", err)
		}
	}()
	fmt.Println("▶ adding nodes: node-a (iptables, zone-a), node-b (iptables, zone-b), node-c (nftables, zone-a)")
	for _, spec := range []localcluster.NodeSpec{
		{Name: "node-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
		{Name: "node-b", Mode: localcluster.ModeIPTables, Zone: "zone-b"},
		{Name: "node-c", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
	} {
		if _, err := c.AddNode(ctx, spec); err != nil {
			return err
		}
	}

	fmt.Println("▶ creating services: kube-system/kube-dns (UDP+TCP 53), shop/web (http, https), shop/checkout (NodePort), shop/idle (no endpoints)")
	dns, err := c.CreateService(ctx, svc("kube-system", "kube-dns", corev1.ServiceTypeClusterIP,
		port("dns", 53, corev1.ProtocolUDP), port("dns-tcp", 53, corev1.ProtocolTCP)))
	if err != nil {
		return err
	}
	web, err := c.CreateService(ctx, svc("shop", "web", corev1.ServiceTypeClusterIP,
		port("http", 80, corev1.ProtocolTCP), port("https", 443, corev1.ProtocolTCP)))
	if err != nil {
		return err
	}
	checkout, err := c.CreateService(ctx, svc("shop", "checkout", corev1.ServiceTypeNodePort, port("http", 8080, corev1.ProtocolTCP)))
	if err != nil {
		return err
	}
	if _, err := c.CreateService(ctx, svc("shop", "idle", corev1.ServiceTypeClusterIP, port("http", 80, corev1.ProtocolTCP))); err != nil {
		return err
	}
	dnsIPs := []string{"198.18.128.10", "198.18.128.11", "198.18.128.12", "198.18.128.13"}
	apply := func(dnsIPs, webIPs []string) error {
		if err := c.ApplySlice(ctx, multiPortSlice(dns, "kube-dns-1", dnsIPs, dnsPorts())); err != nil {
			return err
		}
		if err := c.ApplySlice(ctx, multiPortSlice(web, "web-1", webIPs, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP), epPort("https", 8443, corev1.ProtocolTCP)})); err != nil {
			return err
		}
		return c.ApplySlice(ctx, multiPortSlice(checkout, "checkout-1", []string{"198.18.128.30"}, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP)}))
	}
	if err := apply(dnsIPs, []string{"198.18.128.20", "198.18.128.21"}); err != nil {
		return err
	}
	for _, n := range c.Nodes() {
		if err := n.WaitRules(ctx, time.Minute, "demo services", func(r string) bool {
			return n.RoutesTo(r, "198.18.128.13:53") && n.RoutesTo(r, "198.18.128.21:8443") && n.RoutesTo(r, "198.18.128.30:8080")
		}); err != nil {
			return err
		}
	}

	agg, err := startProxyaudit(ctx, c)
	if err != nil {
		return err
	}
	if err := agg.wait(ctx, 90*time.Second, "every node in sync", func(fs []audit.TimedFinding, nodes []audit.NodeStatus) bool {
		in := 0
		for _, n := range nodes {
			if n.State == audit.NodeInSync {
				in++
			}
		}
		return len(fs) == 0 && in == len(c.Nodes())
	}); err != nil {
		return err
	}
	fmt.Println("  · all three nodes in sync, no findings")

	hung := c.Node("node-b")
	fmt.Printf("▶ drifting %s: dropping its kube-proxy's API traffic (the dead-watch failure), then rolling kube-dns and scaling web down\n", hung.Name)
	if _, err := hung.HangInformer(ctx); err != nil {
		return err
	}
	// Two kube-dns pods are replaced, one web pod goes away.
	if err := apply([]string{"198.18.128.10", "198.18.128.11", "198.18.128.14", "198.18.128.15"}, []string{"198.18.128.20"}); err != nil {
		return err
	}
	for _, n := range c.Nodes() {
		if n == hung {
			continue
		}
		if err := n.WaitRules(ctx, time.Minute, "new endpoints", func(r string) bool {
			return n.RoutesTo(r, "198.18.128.15:53") && !n.RoutesTo(r, "198.18.128.13:53") && !n.RoutesTo(r, "198.18.128.21:8443")
		}); err != nil {
			return err
		}
	}
	code, err := hung.Livez(ctx)
	if err != nil {
		return fmt.Errorf("kube-proxy livez on %s: %w", hung.Name, err)
	}

	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	state, err := c.DumpClusterJSON(ctx)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(o.out, "cluster.json"), state, 0o644); err != nil {
		return err
	}
	var rulesArgs []string
	for _, n := range c.Nodes() {
		r, err := n.Rules(ctx)
		if err != nil {
			return err
		}
		path := filepath.Join(o.out, n.Name+".rules")
		if err := os.WriteFile(path, []byte(r), 0o644); err != nil {
			return err
		}
		rulesArgs = append(rulesArgs, "--rules", n.Name+"="+path)
	}

	fmt.Printf("\n%s's kube-proxy /livez answers %d, yet its rules still send traffic to pods that no longer exist:\n", hung.Name, code)
	r, _ := hung.Rules(ctx)
	for _, line := range strings.Split(r, "\n") {
		for _, gone := range []string{"198.18.128.12:53", "198.18.128.13:53", "198.18.128.21:"} {
			if strings.Contains(line, "--to-destination "+gone) {
				fmt.Println("    " + line)
			}
		}
	}
	drifted := time.Now()
	fmt.Printf("\n▶ waiting for the aggregator to judge (grace %s; the default is 30s)\n", demoGrace)
	var findings []audit.TimedFinding
	var nodes []audit.NodeStatus
	if err := agg.wait(ctx, demoGrace+90*time.Second, "StuckProxy on "+hung.Name, func(fs []audit.TimedFinding, ns []audit.NodeStatus) bool {
		findings, nodes = fs, ns
		for _, f := range fs {
			if f.Kind == audit.StuckProxy && f.Node == hung.Name {
				return true
			}
		}
		return false
	}); err != nil {
		return err
	}
	fmt.Printf("\nproxyaudit's findings, %s after the change (GET %s/api/v1/findings):\n\n", time.Since(drifted).Round(time.Second), agg.url)
	printFindings(findings)
	fmt.Println("\nNodes (GET /api/v1/nodes):")
	for _, n := range nodes {
		fmt.Printf("  %-8s %-8s %-9s in sync %d, lagging %d, divergent %d\n", n.Node, n.State, n.Mode, n.InSync, n.Lagging, n.Divergent)
	}
	fmt.Printf("\nCaptured cluster state and every node's rules in %s/; the offline check is:\n  bin/proxyaudit diff --cluster %s %s\n",
		o.out, filepath.Join(o.out, "cluster.json"), strings.Join(rulesArgs, " "))
	if !o.hold {
		fmt.Println("\nRe-run with `bin/localcluster demo --hold` to keep the cluster up and inspect the nodes by hand.")
		return nil
	}
	fmt.Printf(`
Where to look:
  curl -s %[5]s/api/v1/findings                                          # proxyaudit's verdict
  ip netns exec pa-%[1]s iptables-save -t nat | grep -E 'KUBE-(SVC|SEP)'   # the stale node
  ip netns exec pa-node-a iptables-save -t nat | grep -E 'KUBE-(SVC|SEP)' # a healthy node
  ip netns exec pa-node-c nft list table ip kube-proxy                    # the nftables node
  curl -s http://%[2]s:10256/livez                                       # still 200 on %[1]s
  KUBECONFIG=%[3]s kubectl get endpointslices -A
  logs: %[4]s
`, hung.Name, hung.IP, c.AdminKubeconfig, c.Dir, agg.url)
	fmt.Println("\nThe cluster keeps running; press Ctrl-C to tear it down.")
	<-ctx.Done()
	return nil
}

func svc(ns, name string, typ corev1.ServiceType, ports ...corev1.ServicePort) *corev1.Service {
	return &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       corev1.ServiceSpec{Type: typ, Ports: ports},
	}
}

func port(name string, p int32, proto corev1.Protocol) corev1.ServicePort {
	return corev1.ServicePort{Name: name, Port: p, Protocol: proto, TargetPort: intstr.FromString(name)}
}

func epPort(name string, p int32, proto corev1.Protocol) discoveryv1.EndpointPort {
	return discoveryv1.EndpointPort{Name: &name, Port: &p, Protocol: &proto}
}

func dnsPorts() []discoveryv1.EndpointPort {
	return []discoveryv1.EndpointPort{epPort("dns", 53, corev1.ProtocolUDP), epPort("dns-tcp", 53, corev1.ProtocolTCP)}
}

func multiPortSlice(s *corev1.Service, name string, ips []string, ports []discoveryv1.EndpointPort) *discoveryv1.EndpointSlice {
	es := localcluster.Slice(s, name, "", 0, corev1.ProtocolTCP)
	es.Ports = ports
	es.Endpoints = nil
	for _, ip := range ips {
		es.Endpoints = append(es.Endpoints, localcluster.ReadyEndpoint(ip, ""))
	}
	return es
}
