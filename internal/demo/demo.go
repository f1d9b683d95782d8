// Package demo is the story `make demo` tells, on any local cluster with
// real kubelet nodes, kube-proxy's DaemonSets and CoreDNS: proxyaudit
// installed with its chart, repairs paused, one node's kube-proxy cut off
// from the API while CoreDNS rolls and a service scales down, the report
// that names what that node still routes to, and the repair once resumed.
// Every claim it prints is read from the report it shows.
//
// cmd/localcluster runs it on a cluster of its own; the real-node tests run
// it on theirs and check what it printed.
package demo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/scenario"
)

// The demo keeps the chart's grace period (shorter, the lingering conntrack
// entries of DNS lookups that ended just before CoreDNS rolled would
// outlive it on every node: their 30 s timeout runs from their last
// packet), shortens the collector interval and turns remediation on; the
// chart's defaults are 30s, 10s and dry-run.
const (
	Grace    = 30 * time.Second
	interval = 3 * time.Second
	// Release and Namespace are the chart's, as the README installs it.
	Release   = "proxyaudit"
	Namespace = "proxyaudit"
)

// Config is where the story runs.
type Config struct {
	Cluster *localcluster.Cluster
	// Drift names the node whose kube-proxy loses the API: an iptables
	// node whose kube-proxy is a DaemonSet's pod.
	Drift string
	// CLI is the proxyaudit binary.
	CLI string
	// Capture is the directory the cluster state and each node's rules
	// are written to while the node drifts (for `proxyaudit diff`).
	Capture string
	Out     io.Writer
}

// Result is what the story found, for the caller's own checks.
type Result struct {
	// Drifted is the report (JSON) shown while the node drifted, and
	// DriftedTable the same as the user saw it.
	Drifted      Report
	DriftedTable string
	// GoneDNS and NewDNS are CoreDNS's pod addresses before and after it
	// rolled.
	GoneDNS, NewDNS string
	// Healed is how long after the last change the fleet was in sync
	// again, the repair included.
	Healed time.Duration
}

// Report is what `proxyaudit report -o json` prints.
type Report = localcluster.Report

// Run tells the story. It leaves the chart installed; Uninstall removes it.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	d, err := newDemo(cfg)
	if err != nil {
		return nil, err
	}
	return d.run(ctx)
}

type demo struct {
	Config
	c   *localcluster.Cluster
	sys *localcluster.System
	n   int // nodes
}

func newDemo(cfg Config) (*demo, error) {
	if _, err := os.Stat(cfg.CLI); err != nil {
		return nil, fmt.Errorf("the proxyaudit CLI: %w (run `make build`)", err)
	}
	if cfg.Cluster.Node(cfg.Drift) == nil {
		return nil, fmt.Errorf("no node %s in the cluster", cfg.Drift)
	}
	return &demo{Config: cfg, c: cfg.Cluster, n: len(cfg.Cluster.Nodes()),
		sys: &localcluster.System{C: cfg.Cluster, Bin: filepath.Dir(cfg.CLI), Release: Release, Namespace: Namespace}}, nil
}

func (d *demo) say(format string, args ...any) { fmt.Fprintf(d.Out, format+"\n", args...) }

func (d *demo) run(ctx context.Context) (*Result, error) {
	c := d.c
	res := &Result{}
	dnsPods, err := c.WaitPodsReady(ctx, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	if err != nil {
		return nil, err
	}
	res.GoneDNS = dnsPods[0].Status.PodIP

	d.say("▶ creating services: shop/web (http, https; two pods), shop/checkout (NodePort)")
	web, err := c.CreateService(ctx, svc("shop", "web", corev1.ServiceTypeClusterIP,
		port("http", 80, corev1.ProtocolTCP), port("https", 443, corev1.ProtocolTCP)))
	if err != nil {
		return nil, err
	}
	checkout, err := c.CreateService(ctx, svc("shop", "checkout", corev1.ServiceTypeNodePort, port("http", 8080, corev1.ProtocolTCP)))
	if err != nil {
		return nil, err
	}
	applyWeb := func(ips ...string) error {
		return c.ApplySlice(ctx, multiPortSlice(web, "web-1", ips, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP), epPort("https", 8443, corev1.ProtocolTCP)}))
	}
	if err := applyWeb(webPods[0], webPods[1]); err != nil {
		return nil, err
	}
	if err := c.ApplySlice(ctx, multiPortSlice(checkout, "checkout-1", []string{"198.18.250.30"}, []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP)})); err != nil {
		return nil, err
	}
	for _, n := range c.Nodes() {
		// kube-dns's two ports (dns over UDP, dns-tcp) both to the pod
		// about to go: the drift shown later is both of them left behind.
		if err := n.WaitRules(ctx, time.Minute, "demo services, and kube-dns's two ports to "+res.GoneDNS, func(r string) bool {
			return n.RouteCount(r, res.GoneDNS+":53") >= 2 && n.RoutesTo(r, webPods[1]+":8443") && n.RoutesTo(r, "198.18.250.30:8080")
		}); err != nil {
			return nil, err
		}
	}

	if err := d.install(ctx); err != nil {
		return nil, err
	}
	if _, err := d.sys.Wait(ctx, 2*time.Minute, "every node in sync", d.allInSync); err != nil {
		return nil, err
	}
	d.say("\n$ kubectl proxyaudit report")
	if _, err := d.show(ctx); err != nil {
		return nil, err
	}

	d.say("\n▶ repairs paused first, so that you can read what proxyaudit finds before it acts (as on-call does):")
	if err := d.cli(ctx, "pause", "--reason", "demo: read the report before the repair"); err != nil {
		return nil, err
	}

	hung := c.Node(d.Drift)
	proxyPod, err := d.kubeProxyPod(ctx, hung.Name)
	if err != nil {
		return nil, err
	}
	d.say("\n▶ drifting %s: its kube-proxy's traffic with the API is lost without an error (the dead-watch failure: kube-proxy stays up and green)", hung.Name)
	// All of kube-proxy's API traffic, not its one connection: client-go
	// replaces a dead connection (its HTTP/2 health check, ~45 s), which
	// healed the drift before the demo's repair on 1.37. A new pod (a new
	// cgroup) is what cures it, as the repair does.
	heal, err := hung.HangProxyWatch(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = heal(context.WithoutCancel(ctx)) }()
	d.say("▶ CoreDNS is rolled (kubectl rollout restart deployment/coredns): its pod %s goes", res.GoneDNS)
	if err := restartDeployment(ctx, c, "kube-system", "coredns"); err != nil {
		return nil, err
	}
	if dnsPods, err = waitNewPod(ctx, c, "kube-system", "k8s-app=kube-dns", res.GoneDNS); err != nil {
		return nil, err
	}
	res.NewDNS = dnsPods[0].Status.PodIP
	d.say("  · its new pod %s is Ready", res.NewDNS)
	d.say("▶ shop/web scales down: its pod %s goes", webPods[1])
	if err := applyWeb(webPods[0]); err != nil {
		return nil, err
	}
	changed := time.Now()
	for _, n := range c.Nodes() {
		if n == hung {
			continue
		}
		if err := n.WaitRules(ctx, time.Minute, "new endpoints", func(r string) bool {
			return n.RoutesTo(r, res.NewDNS+":53") && !n.RoutesTo(r, res.GoneDNS+":53") && !n.RoutesTo(r, webPods[1]+":8443")
		}); err != nil {
			return nil, err
		}
	}
	d.say("  · every other node's kube-proxy followed within %s", time.Since(changed).Round(100*time.Millisecond))
	code, err := hung.Livez(ctx)
	if err != nil {
		return nil, fmt.Errorf("kube-proxy livez on %s: %w", hung.Name, err)
	}
	if err := scenario.Capture(ctx, c, d.Capture); err != nil {
		return nil, err
	}
	d.say("\n%s's kube-proxy (pod %s) answers /livez %d, yet its rules still send DNS to the CoreDNS pod that is gone (%s):", hung.Name, proxyPod, code, res.GoneDNS)
	r, err := hung.Rules(ctx)
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(r, "\n") {
		for _, gone := range []string{res.GoneDNS + ":53", webPods[1] + ":"} {
			if strings.Contains(line, "--to-destination "+gone) {
				d.say("    %s", line)
			}
		}
	}

	// The claim above is what the report must bear out: StuckProxy, and
	// every stale endpoint just printed, on the drifted node.
	d.say("\n▶ waiting for the aggregator to judge: a change is drift once it outlives the grace period (%s)", Grace)
	want := []string{res.GoneDNS + ":53", webPods[1] + ":8080", webPods[1] + ":8443"}
	drifted, err := d.sys.Wait(ctx, Grace+2*time.Minute, "StuckProxy and the stale endpoints on "+hung.Name, func(r *Report) bool {
		if !slices.ContainsFunc(r.Findings, func(f audit.TimedFinding) bool { return f.Kind == audit.StuckProxy && f.Node == hung.Name }) {
			return false
		}
		for _, ep := range want {
			if !slices.ContainsFunc(r.Findings, func(f audit.TimedFinding) bool {
				return f.Kind == audit.StaleEndpoint && f.Node == hung.Name && f.Endpoint == ep
			}) {
				return false
			}
		}
		// Both of kube-dns's ports (dns, dns-tcp) before it is shown.
		return len(staleOf(r, hung.Name, "kube-system/kube-dns")) >= 2
	})
	if err != nil {
		return nil, err
	}
	d.say("\n$ kubectl proxyaudit report        # %s after the last change", time.Since(changed).Round(time.Second))
	if res.DriftedTable, err = d.show(ctx); err != nil {
		return nil, err
	}
	res.Drifted = *drifted
	d.say("\nWhat the report says about %s:", hung.Name)
	for _, line := range d.story(drifted, hung.Name) {
		d.say("  · %s", line)
	}
	var others []string
	for _, n := range c.Nodes() {
		if n != hung {
			if lines := d.story(drifted, n.Name); len(lines) > 0 {
				others = append(others, n.Name+": "+strings.Join(lines, "; "))
			}
		}
	}
	if len(others) == 0 {
		d.say("and about the other nodes: nothing; their kube-proxies followed the API.")
	} else {
		d.say("and about the other nodes:")
		for _, o := range others {
			d.say("  · %s", o)
		}
	}

	d.say("\n▶ repairs resumed: remediation (on for the demo; the chart's default is dry-run) deletes %s's kube-proxy pod, and its DaemonSet makes a new one", hung.Name)
	if err := d.cli(ctx, "resume"); err != nil {
		return nil, err
	}
	var healed string
	for deadline := time.Now().Add(3 * time.Minute); healed == ""; time.Sleep(500 * time.Millisecond) {
		pod, err := d.kubeProxyPod(ctx, hung.Name)
		if err == nil && pod != "" && pod != proxyPod {
			healed = pod
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("remediation did not replace kube-proxy pod %s on %s within 3 minutes; what proxyaudit said about the node:\n%s", proxyPod, hung.Name, nodeEvents(ctx, c, hung.Name))
		}
	}
	if _, err := d.sys.Wait(ctx, 2*time.Minute, "every node in sync again", d.allInSync); err != nil {
		return nil, err
	}
	res.Healed = time.Since(changed)
	d.say("  · pod %s replaced by %s; every node in sync %s after the last change", proxyPod, healed, res.Healed.Round(time.Second))
	d.say("\n$ kubectl proxyaudit report")
	if _, err := d.show(ctx); err != nil {
		return nil, err
	}
	return res, nil
}

// webPods are shop/web's two pods; the second goes when it scales down.
var webPods = [2]string{"198.18.250.20", "198.18.250.21"}

// story says in words what the report shows about node, one line per
// finding kind and service, from the findings themselves.
func (d *demo) story(r *Report, node string) []string {
	var out []string
	type key struct {
		kind    audit.Kind
		service string
	}
	ports, eps := map[key][]string{}, map[key][]string{}
	var order []key
	for _, f := range r.Findings {
		if f.Node != node {
			continue
		}
		if f.Service == "" {
			out = append(out, fmt.Sprintf("%s: %s", f.Kind, f.Detail))
			continue
		}
		k := key{f.Kind, f.Service}
		if _, ok := ports[k]; !ok {
			order = append(order, k)
		}
		if !slices.Contains(ports[k], f.Port) {
			ports[k] = append(ports[k], f.Port)
		}
		if !slices.Contains(eps[k], f.Endpoint) {
			eps[k] = append(eps[k], f.Endpoint)
		}
	}
	for _, k := range order {
		what := map[audit.Kind]string{
			audit.StaleEndpoint:   "still sends to %s, which the cluster no longer lists (a pod that is gone)",
			audit.MissingEndpoint: "does not send to %s, which the cluster lists now",
			audit.StaleConntrack:  "flows still DNATed to %s, which left the service",
		}[k.kind]
		if what == "" {
			what = "%s"
		}
		out = append(out, fmt.Sprintf("%s %s (%s): "+what, k.kind, k.service, strings.Join(ports[k], ", "), strings.Join(eps[k], ", ")))
	}
	return out
}

// staleOf lists the ports of service with a StaleEndpoint on node.
func staleOf(r *Report, node, service string) []string {
	var ports []string
	for _, f := range r.Findings {
		if f.Kind == audit.StaleEndpoint && f.Node == node && f.Service == service && !slices.Contains(ports, f.Port) {
			ports = append(ports, f.Port)
		}
	}
	return ports
}

// install runs helm install with the demo's values.
func (d *demo) install(ctx context.Context) error {
	args := []string{"install", Release, chart.Dir, "--namespace", Namespace, "--create-namespace",
		"--set", "collector.interval=" + interval.String(),
		"--set", "remediation.mode=restart", "--set", "remediation.maxUnhealthy=50%"}
	d.say("▶ $ helm %s", strings.Join(args, " "))
	if _, err := d.sys.Helm(ctx, args...); err != nil {
		return err
	}
	start := time.Now()
	if _, err := d.c.WaitPodsReady(ctx, Namespace, "app.kubernetes.io/component=collector", d.n, 3*time.Minute); err != nil {
		return err
	}
	if _, err := d.c.WaitPodsReady(ctx, Namespace, "app.kubernetes.io/component=aggregator", 2, 3*time.Minute); err != nil {
		return err
	}
	d.say("  · a collector on every node and two aggregator replicas Ready %s later", time.Since(start).Round(time.Second))
	return nil
}

// Uninstall removes the chart, what remediation kept for a reinstall (its
// incident record: the demo's restart would count against the next
// install's budget) and the demo's services.
func Uninstall(ctx context.Context, c *localcluster.Cluster) error {
	if err := (&localcluster.System{C: c, Release: Release, Namespace: Namespace}).Uninstall(ctx); err != nil {
		return err
	}
	err := c.Client.CoreV1().Namespaces().Delete(ctx, "shop", metav1.DeleteOptions{})
	if err != nil && !strings.Contains(err.Error(), "not found") {
		return err
	}
	return nil
}

// cli runs `proxyaudit args...` against the cluster, printed as a user
// types it and with what it says.
func (d *demo) cli(ctx context.Context, args ...string) error {
	shown := make([]string, len(args))
	for i, a := range args {
		if strings.ContainsAny(a, " :") {
			a = fmt.Sprintf("%q", a)
		}
		shown[i] = a
	}
	d.say("$ kubectl proxyaudit %s", strings.Join(shown, " "))
	out, err := exec.CommandContext(ctx, d.CLI, append(args, "--kubeconfig", d.c.AdminKubeconfig, "-n", Namespace)...).CombinedOutput()
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		d.say("  %s", line)
	}
	if err != nil {
		return fmt.Errorf("proxyaudit %s: %v", args[0], err)
	}
	return nil
}

func (d *demo) report(ctx context.Context, format string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, d.CLI, "report", "--kubeconfig", d.c.AdminKubeconfig, "-n", Namespace, "-o", format)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 1 {
		err = nil // findings
	}
	if err != nil {
		return out, fmt.Errorf("%v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// show prints `proxyaudit report` as a user sees it, and returns it.
func (d *demo) show(ctx context.Context) (string, error) {
	out, err := d.report(ctx, "table")
	if err != nil {
		return "", fmt.Errorf("report: %w", err)
	}
	d.Out.Write(out)
	return string(out), nil
}

// allInSync: every node judged in sync, and no finding.
func (d *demo) allInSync(r *Report) bool {
	return len(r.Nodes) == d.n && r.InSync() == d.n && len(r.Findings) == 0
}

// DiffCommand is the offline check of what Run captured.
func DiffCommand(c *localcluster.Cluster, out string) string {
	args := []string{"bin/proxyaudit", "diff", "--cluster", filepath.Join(out, "cluster.json")}
	for _, n := range c.Nodes() {
		args = append(args, "--rules", n.Name+"="+filepath.Join(out, n.Name+".rules"))
	}
	return strings.Join(args, " ")
}

// kubeProxyPod names the kube-proxy pod on node that is not being deleted.
func (d *demo) kubeProxyPod(ctx context.Context, node string) (string, error) {
	p, err := d.sys.Pod(ctx, "kube-system", "k8s-app=kube-proxy", node)
	if p == nil {
		return "", err
	}
	return p.Name, nil
}

// restartDeployment does what kubectl rollout restart does.
func restartDeployment(ctx context.Context, c *localcluster.Cluster, ns, name string) error {
	patch := fmt.Sprintf(`{"spec":{"template":{"metadata":{"annotations":{"kubectl.kubernetes.io/restartedAt":%q}}}}}`, time.Now().Format(time.RFC3339Nano))
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

// nodeEvents is the last Events about node (each remediation action and
// each page says why it acted or held), for an error that explains.
func nodeEvents(ctx context.Context, c *localcluster.Cluster, node string) string {
	evs, err := c.Client.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Node,involvedObject.name=" + node})
	if err != nil {
		return "  (the Events cannot be read: " + err.Error() + ")"
	}
	when := func(e corev1.Event) time.Time {
		if e.LastTimestamp.IsZero() {
			return e.EventTime.Time
		}
		return e.LastTimestamp.Time
	}
	items := evs.Items
	slices.SortFunc(items, func(a, b corev1.Event) int { return when(a).Compare(when(b)) })
	var b strings.Builder
	for _, e := range items[max(0, len(items)-8):] {
		fmt.Fprintf(&b, "  %s %s/%s ×%d: %s\n", when(e).UTC().Format(time.RFC3339), e.Source.Component, e.Reason, e.Count, e.Message)
	}
	if b.Len() == 0 {
		return "  (no Events about the node)"
	}
	return b.String()
}
