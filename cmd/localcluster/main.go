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
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/proxyaudit/proxyaudit/audit"
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
	fmt.Println("▶ starting etcd and kube-apiserver (built from k8s.io/kubernetes; the first run compiles the control plane and kubelet, ~10 min)")
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
	fmt.Println("▶ adding real nodes, each a network namespace with its own containerd and kubelet:")
	fmt.Println("  node-a (iptables, zone-a), node-b (iptables, zone-b), node-c (nftables, zone-a); images are built here, nothing is pulled")
	for _, spec := range []localcluster.KubeletNodeSpec{
		{Name: "node-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
		{Name: "node-b", Mode: localcluster.ModeIPTables, Zone: "zone-b"},
		{Name: "node-c", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
	} {
		if _, err := c.AddKubeletNode(ctx, spec); err != nil {
			return err
		}
	}
	fmt.Println("▶ kube-proxy as kubeadm runs it (DaemonSets in kube-system), CoreDNS")
	for _, m := range []localcluster.Mode{localcluster.ModeIPTables, localcluster.ModeNFTables} {
		if err := c.DeployKubeProxy(ctx, m); err != nil {
			return err
		}
	}
	if err := c.DeployDNS(ctx); err != nil {
		return err
	}
	if _, err := c.WaitPodsReady(ctx, "kube-system", "k8s-app=kube-proxy", 3, 2*time.Minute); err != nil {
		return err
	}
	dnsPods, err := c.WaitPodsReady(ctx, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	if err != nil {
		return err
	}
	oldDNS := dnsPods[0].Status.PodIP

	fmt.Println("▶ creating services: shop/web (http, https; two pods), shop/checkout (NodePort)")
	web, err := c.CreateService(ctx, svc("shop", "web", corev1.ServiceTypeClusterIP,
		port("http", 80, corev1.ProtocolTCP), port("https", 443, corev1.ProtocolTCP)))
	if err != nil {
		return err
	}
	checkout, err := c.CreateService(ctx, svc("shop", "checkout", corev1.ServiceTypeNodePort, port("http", 8080, corev1.ProtocolTCP)))
	if err != nil {
		return err
	}
	applyWeb := func(ips ...string) error {
		return c.ApplySlice(ctx, multiPortSlice(web, "web-1", ips, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP), epPort("https", 8443, corev1.ProtocolTCP)}))
	}
	if err := applyWeb("198.18.250.20", "198.18.250.21"); err != nil {
		return err
	}
	if err := c.ApplySlice(ctx, multiPortSlice(checkout, "checkout-1", []string{"198.18.250.30"}, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP)})); err != nil {
		return err
	}
	for _, n := range c.Nodes() {
		if err := n.WaitRules(ctx, time.Minute, "demo services", func(r string) bool {
			return n.RoutesTo(r, oldDNS+":53") && n.RoutesTo(r, "198.18.250.21:8443") && n.RoutesTo(r, "198.18.250.30:8080")
		}); err != nil {
			return err
		}
	}

	p, err := newProxyaudit(c)
	if err != nil {
		return err
	}
	if err := p.install(ctx); err != nil {
		return err
	}
	if err := p.wait(ctx, 2*time.Minute, "every node in sync", func(r *fleetReport) bool {
		return allInSync(r, 3)
	}); err != nil {
		return err
	}
	fmt.Println("\n$ kubectl proxyaudit report")
	p.show(ctx)

	hung := c.Node("node-b")
	proxyPod, err := kubeProxyPod(ctx, c, hung.Name)
	if err != nil {
		return err
	}
	fmt.Printf("\n▶ drifting %s: its kube-proxy's connection to the API dies without an error (the dead-watch failure),\n  then CoreDNS is rolled (kubectl rollout restart) and web scales down\n", hung.Name)
	if _, err := hung.DropAPIConnection(ctx); err != nil {
		return err
	}
	if err := restartDeployment(ctx, c, "kube-system", "coredns"); err != nil {
		return err
	}
	if err := applyWeb("198.18.250.20"); err != nil {
		return err
	}
	dnsPods, err = waitNewPod(ctx, c, "kube-system", "k8s-app=kube-dns", oldDNS)
	if err != nil {
		return err
	}
	newDNS := dnsPods[0].Status.PodIP
	changed := time.Now()
	for _, n := range c.Nodes() {
		if n == hung {
			continue
		}
		if err := n.WaitRules(ctx, time.Minute, "new endpoints", func(r string) bool {
			return n.RoutesTo(r, newDNS+":53") && !n.RoutesTo(r, oldDNS+":53") && !n.RoutesTo(r, "198.18.250.21:8443")
		}); err != nil {
			return err
		}
	}
	code, err := hung.Livez(ctx)
	if err != nil {
		return fmt.Errorf("kube-proxy livez on %s: %w", hung.Name, err)
	}
	if err := capture(ctx, c, o.out); err != nil {
		return err
	}
	fmt.Printf("\n%s's kube-proxy (pod %s) answers /livez %d, yet its rules still send DNS to the CoreDNS pod that is gone (%s):\n", hung.Name, proxyPod, code, oldDNS)
	r, _ := hung.Rules(ctx)
	for _, line := range strings.Split(r, "\n") {
		for _, gone := range []string{oldDNS + ":53", "198.18.250.21:"} {
			if strings.Contains(line, "--to-destination "+gone) {
				fmt.Println("    " + line)
			}
		}
	}
	fmt.Printf("\n▶ waiting for the aggregator to judge (grace %s for the demo; the default is 30s)\n", demoGrace)
	if err := p.wait(ctx, demoGrace+2*time.Minute, "StuckProxy on "+hung.Name, func(r *fleetReport) bool {
		for _, f := range r.Findings {
			if f.Kind == audit.StuckProxy && f.Node == hung.Name {
				return true
			}
		}
		return false
	}); err != nil {
		return err
	}
	fmt.Printf("\n$ kubectl proxyaudit report        # %s after the change\n", time.Since(changed).Round(time.Second))
	p.show(ctx)
	fmt.Printf("\n▶ remediation (on for the demo; the chart's default is dry-run) deletes %s's kube-proxy pod; its DaemonSet makes a new one\n", hung.Name)
	var healed string
	for deadline := time.Now().Add(3 * time.Minute); healed == ""; time.Sleep(500 * time.Millisecond) {
		pod, err := kubeProxyPod(ctx, c, hung.Name)
		if err == nil && pod != "" && pod != proxyPod {
			healed = pod
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("remediation did not replace kube-proxy pod %s on %s within 3 minutes", proxyPod, hung.Name)
		}
	}
	if err := p.wait(ctx, 2*time.Minute, "every node in sync again", func(r *fleetReport) bool {
		return allInSync(r, 3)
	}); err != nil {
		return err
	}
	fmt.Printf("  · pod %s replaced by %s; the node is in sync %s after the change\n", proxyPod, healed, time.Since(changed).Round(time.Second))
	fmt.Println("\n$ kubectl proxyaudit report")
	p.show(ctx)
	fmt.Printf("\nCaptured the cluster state and every node's rules as they were while %s drifted, in %s/; the offline check is:\n  bin/proxyaudit diff --cluster %s %s\n",
		hung.Name, o.out, filepath.Join(o.out, "cluster.json"), strings.Join(rulesArgs(c, o.out), " "))
	if !o.hold {
		fmt.Println("\nRe-run with `bin/localcluster demo --hold` to keep the cluster up and look around.")
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
`, hung.Name, c.AdminKubeconfig, c.Dir)
	fmt.Println("\nThe cluster keeps running; press Ctrl-C to tear it down.")
	<-ctx.Done()
	return nil
}

// capture writes the cluster state and each node's rules into out.
func capture(ctx context.Context, c *localcluster.Cluster, out string) error {
	if err := os.MkdirAll(out, 0o755); err != nil {
		return err
	}
	state, err := c.DumpClusterJSON(ctx)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(out, "cluster.json"), state, 0o644); err != nil {
		return err
	}
	for _, n := range c.Nodes() {
		r, err := n.Rules(ctx)
		if err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(out, n.Name+".rules"), []byte(r), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func rulesArgs(c *localcluster.Cluster, out string) []string {
	var args []string
	for _, n := range c.Nodes() {
		args = append(args, "--rules", n.Name+"="+filepath.Join(out, n.Name+".rules"))
	}
	return args
}

// kubeProxyPod names the kube-proxy pod on node that is not being deleted.
func kubeProxyPod(ctx context.Context, c *localcluster.Cluster, node string) (string, error) {
	pods, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy", FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return "", err
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp == nil {
			return p.Name, nil
		}
	}
	return "", nil
}

// restartDeployment does what kubectl rollout restart does.
func restartDeployment(ctx context.Context, c *localcluster.Cluster, ns, name string) error {
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339))
	_, err := c.Client.AppsV1().Deployments(ns).Patch(ctx, name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// waitNewPod waits for the one Ready pod of selector to have another IP
// than old.
func waitNewPod(ctx context.Context, c *localcluster.Cluster, ns, selector, old string) ([]corev1.Pod, error) {
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
		pods, err := c.WaitPodsReady(ctx, ns, selector, 1, 2*time.Minute)
		if err != nil {
			return nil, err
		}
		if pods[0].Status.PodIP != old {
			return pods, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("pods %s in %s: still %s after 2 minutes", selector, ns, old)
		}
	}
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

func multiPortSlice(s *corev1.Service, name string, ips []string, ports []discoveryv1.EndpointPort) *discoveryv1.EndpointSlice {
	es := localcluster.Slice(s, name, "", 0, corev1.ProtocolTCP)
	es.Ports = ports
	es.Endpoints = nil
	for _, ip := range ips {
		es.Endpoints = append(es.Endpoints, localcluster.ReadyEndpoint(ip, ""))
	}
	return es
}

// allInSync: n nodes, each judged in sync, and no finding.
func allInSync(r *fleetReport, n int) bool {
	in := 0
	for _, s := range r.Nodes {
		if s.State == audit.NodeInSync {
			in++
		}
	}
	return len(r.Nodes) == n && in == n && len(r.Findings) == 0
}
