package realnodes

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// dnsQuery is a DNS query for name's A record.
func dnsQuery(id uint16, name string) []byte {
	b := binary.BigEndian.AppendUint16(nil, id)
	b = append(b, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0) // recursion desired, one question
	for _, l := range strings.Split(name, ".") {
		b = append(b, byte(len(l)))
		b = append(b, l...)
	}
	return append(b, 0, 0, 1, 0, 1)
}

// resolver is a DNS client on a node that keeps asking kube-dns from one
// socket (one source port: one conntrack entry), as a node-local cache or
// a statsd client keeps sending: the flow outlives any pod it was DNATed
// to unless something deletes its entry.
type resolver struct {
	// answers counts replies; refused the ICMP port unreachable a
	// service without endpoints answers with (kube-proxy's REJECT).
	answers, refused atomic.Int64
	stop             func()
}

func startResolver(t *testing.T, node *localcluster.Node, dns string) *resolver {
	t.Helper()
	return startResolverAt(t, node, net.JoinHostPort(dns, "53"))
}

// startResolverAt is startResolver asking addr (a node port: ip:port).
func startResolverAt(t *testing.T, node *localcluster.Node, addr string) *resolver {
	t.Helper()
	var conn net.Conn
	if err := localcluster.InNetNS(node.NetNS, func() error {
		var err error
		conn, err = net.Dial("udp4", addr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	r := &resolver{}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		buf := make([]byte, 512)
		for {
			if _, err := conn.Read(buf); err != nil {
				if ctx.Err() != nil {
					return
				}
				if errors.Is(err, syscall.ECONNREFUSED) {
					r.refused.Add(1)
				}
				continue
			}
			r.answers.Add(1)
		}
	}()
	go func() {
		for id := uint16(1); ctx.Err() == nil; id++ {
			conn.Write(dnsQuery(id, "kubernetes.default.svc.cluster.local"))
			time.Sleep(300 * time.Millisecond)
		}
	}()
	r.stop = func() { cancel(); conn.Close() }
	t.Cleanup(r.stop)
	return r
}

// The DNS blackhole on real nodes: two nodes' resolvers keep asking
// kube-dns (real packets through kube-proxy's real rules to the real
// CoreDNS pod). One node's kube-proxy hangs; the CoreDNS pod is replaced.
// The healthy node's kube-proxy deletes its resolver's entry and the next
// query reaches the new pod: nothing is reported there. The hung node's
// resolver stays pinned to the pod that is gone: StaleConntrack, with the
// flow and the dead endpoint. kube-proxy restarted, it clears the entry
// and the finding goes.
func TestE2EStaleConntrackOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	pods := waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	old := pods[0]
	svc, err := c.Client.CoreV1().Services("kube-system").Get(ctx, "kube-dns", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace=10s", "--set", "collector.interval=5s", "--set", "collector.conntrackInterval=5s")
	defer uninstall(t, c)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
	waitInSync(ctx, t, c, 3*time.Minute, time.Time{}, "after helm install")

	hung, healthy := c.Node("real-ipt-a"), c.Node("real-nft-a")
	rh := startResolver(t, hung, svc.Spec.ClusterIP)
	rk := startResolver(t, healthy, svc.Spec.ClusterIP)
	deadline := time.Now().Add(time.Minute)
	for rh.answers.Load() == 0 || rk.answers.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("CoreDNS does not answer through kube-dns (%d, %d answers)", rh.answers.Load(), rk.answers.Load())
		}
		time.Sleep(200 * time.Millisecond)
	}
	thaw, err := hung.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer thaw(context.Background())
	if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Logf("CoreDNS pod %s (%s) deleted; %s's kube-proxy frozen", old.Name, old.Status.PodIP, hung.Name)
	stale := func(r *fleetReport, node string) *audit.TimedFinding {
		for i, f := range r.Findings {
			if f.Kind == audit.StaleConntrack && f.Node == node {
				return &r.Findings[i]
			}
		}
		return nil
	}
	var found *audit.TimedFinding
	var last string
	for deadline := time.Now().Add(3 * time.Minute); found == nil; time.Sleep(time.Second) {
		if time.Now().After(deadline) {
			t.Fatalf("no StaleConntrack on %s; last report:\n%s", hung.Name, clip(last))
		}
		r, raw, err := report(ctx, t, c)
		if err != nil {
			continue
		}
		last = raw
		found = stale(r, hung.Name)
		if f := stale(r, healthy.Name); f != nil {
			t.Fatalf("StaleConntrack on %s, whose kube-proxy is healthy: %+v", healthy.Name, f)
		}
	}
	if found.Service != "kube-system/kube-dns" || found.Port != "dns" || found.Protocol != "UDP" || found.Endpoint != net.JoinHostPort(old.Status.PodIP, "53") ||
		found.Flows < 1 || !strings.Contains(found.Detail, "still DNATed to "+found.Endpoint) {
		t.Errorf("finding: %+v", found)
	}
	t.Logf("found: %s", found.Detail)
	before := rk.answers.Load()
	time.Sleep(2 * time.Second)
	if rk.answers.Load() == before {
		t.Errorf("the healthy node's resolver gets no answers from the new CoreDNS pod")
	}
	// Repaired by hand, as an SRE would: kube-proxy restarted, which
	// clears the entries of endpoints that are gone.
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	if p := kubeProxyPod(ctx, t, c, hung.Name); p != nil {
		if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(time.Second) {
		r, raw, err := report(ctx, t, c)
		if err == nil && stale(r, hung.Name) == nil && inSync(r) == len(fleet) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stale flow outlived kube-proxy's restart:\n%s", clip(raw))
		}
	}
	before = rh.answers.Load()
	for deadline := time.Now().Add(30 * time.Second); rh.answers.Load() == before; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s's resolver still gets no answer after kube-proxy's restart", hung.Name)
		}
	}
}

// Conntrack remediation on real nodes, where kube-proxy is healthy and
// still leaves flows stale: kube-proxy's cleanup skips a node port with
// no serving endpoints (pkg/proxy/conntrack/cleanup.go: 1.36 and before
// skip any service without endpoints, the statsd blackhole of
// kubernetes#139628; 1.37 cleans a service IP's entries then, but not a
// node port's, whose match would take unrelated flows). Resolvers on two
// nodes keep asking CoreDNS through a UDP node port of their own node's
// address; CoreDNS is scaled to zero. In dry-run proxyaudit finds the
// flows still DNATed to the gone pod on both nodes, says what it would
// delete, and the entries stay (the resolvers hear nothing: a blackhole).
// CoreDNS back, then scaled to zero again and the mode switched to
// restart while it is (the aggregator pods are all replaced; the
// collectors, unable to resolve them, reach the new pods by the
// addresses the old ones sent): each node's collector deletes the stale entries, kube-proxy
// is not restarted (the rules are right), and the resolvers' next queries
// meet the node port's REJECT (they learn it is down). CoreDNS back, their
// next queries reach the live pod.
func TestE2EConntrackRemediationOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	// CoreDNS behind a UDP node port, as a node-local DNS cache or a
	// syslog relay is reached from outside the cluster.
	svc, err := c.Client.CoreV1().Services("kube-system").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "dns-nodeport"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort, Selector: map[string]string{"k8s-app": "kube-dns"},
			Ports: []corev1.ServicePort{{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(53)}}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Client.CoreV1().Services("kube-system").Delete(context.Background(), svc.Name, metav1.DeleteOptions{})
	nodePort := strconv.Itoa(int(svc.Spec.Ports[0].NodePort))
	frontend := audit.NodePortKey(4, "UDP", uint16(svc.Spec.Ports[0].NodePort)).Wire()
	scale := func(ctx context.Context, n int) error {
		_, err := c.Client.AppsV1().Deployments("kube-system").Patch(ctx, "coredns", types.MergePatchType,
			[]byte(fmt.Sprintf(`{"spec":{"replicas":%d}}`, n)), metav1.PatchOptions{})
		return err
	}
	defer scale(context.Background(), 1)
	// Three nodes may be flushed at once, and one after the other (the
	// default budget, 10 % of three nodes, is none).
	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace=10s", "--set", "collector.interval=5s", "--set", "collector.conntrackInterval=5s",
		"--set", "remediation.mode=dry-run", "--set", "remediation.conntrack.enabled=true",
		"--set", "remediation.maxNodes=3", "--set", "remediation.maxUnhealthy=100%", "--set", "remediation.breakerShare=1")
	defer uninstall(t, c)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
	waitInSync(ctx, t, c, 3*time.Minute, time.Time{}, "after helm install")
	nodes := []*localcluster.Node{c.Node("real-ipt-a"), c.Node("real-nft-a")}
	var started time.Time
	events := func(node, reason string) []string {
		evs, err := c.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + node + ",reason=" + reason})
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range evs.Items {
			if !e.LastTimestamp.Time.Before(started.Truncate(time.Second)) {
				out = append(out, e.Message)
			}
		}
		return out
	}
	until := func(limit time.Duration, what string, ok func() bool) {
		t.Helper()
		if _, err := testkit.Poll(limit, ok); err != nil {
			var why []string
			if r, _, err := report(ctx, t, c); err == nil {
				for _, f := range r.Findings {
					why = append(why, fmt.Sprintf("%s %s %s %s: %s", f.Kind, f.Node, f.Service, f.Endpoint, f.Detail))
				}
			}
			for _, n := range nodes {
				out, _ := n.Exec(ctx, "conntrack", "-L", "-p", "udp", "--orig-port-dst", nodePort)
				why = append(why, n.Name+" conntrack:\n"+out, n.Name+"'s collector:\n"+collectorLog(ctx, c, n.Name, 15))
			}
			t.Fatalf("%s", testkit.Waiting(limit, what, "findings and tables:\n"+strings.Join(why, "\n")+"\naggregators:\n"+aggregatorLogs(ctx, c, what)))
		}
	}
	// pinned counts a node's UDP entries to its own node port DNATed to
	// ip (conntrack -L in its network namespace): the resolver's. Not
	// flows addressed to ip itself: on the node that ran the gone pod,
	// other nodes' flows to it (DNATed there) pass through conntrack too,
	// and they are no business of this node's collector.
	pinned := func(n *localcluster.Node, ip string) int {
		out, err := n.Exec(ctx, "conntrack", "-L", "-p", "udp", "--orig-dst", n.IP, "--orig-port-dst", nodePort, "--reply-src", ip)
		if err != nil && !strings.Contains(out, "0 flow entries") {
			t.Fatalf("conntrack -L on %s: %v\n%s", n.Name, err, out)
		}
		k := 0
		for _, l := range strings.Split(out, "\n") {
			if strings.HasPrefix(l, "udp ") {
				k++
			}
		}
		return k
	}
	rs := map[string]*resolver{}
	for _, n := range nodes {
		rs[n.Name] = startResolverAt(t, n, net.JoinHostPort(n.IP, nodePort))
	}
	// toZero scales CoreDNS to zero once the resolvers are answered, and
	// returns where its pod was.
	toZero := func() string {
		t.Helper()
		pods := waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
		for _, n := range nodes {
			was := rs[n.Name].answers.Load()
			until(time.Minute, "CoreDNS answering "+n.Name+"'s resolver", func() bool { return rs[n.Name].answers.Load() > was })
		}
		started = time.Now()
		if err := scale(ctx, 0); err != nil {
			t.Fatal(err)
		}
		until(2*time.Minute, "the CoreDNS pod gone", func() bool {
			p, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-dns"})
			return err == nil && len(p.Items) == 0
		})
		t.Logf("CoreDNS scaled to zero; its pod %s was at %s", pods[0].Name, pods[0].Status.PodIP)
		return pods[0].Status.PodIP
	}
	back := func() {
		t.Helper()
		if err := scale(ctx, 1); err != nil {
			t.Fatal(err)
		}
		for _, n := range nodes {
			was := rs[n.Name].answers.Load()
			until(2*time.Minute, n.Name+"'s resolver answered by a new CoreDNS pod", func() bool { return rs[n.Name].answers.Load() > was })
		}
	}

	t.Run("dry-run finds the flows kube-proxy leaves and deletes nothing", func(t *testing.T) {
		ip := toZero()
		dead := net.JoinHostPort(ip, "53")
		for _, n := range nodes {
			until(3*time.Minute, "a dry-run flush on "+n.Name, func() bool {
				for _, m := range events(n.Name, "ProxyauditDryRun") {
					if strings.Contains(m, "would FlushConntrack") && strings.Contains(m, nodePort+"/UDP") && strings.Contains(m, "→ "+dead) {
						return true
					}
				}
				return false
			})
			if k := pinned(n, ip); k < 1 {
				t.Errorf("%s: no entry DNATed to the gone pod in dry-run (kube-proxy leaves them: the service has no endpoints)", n.Name)
			}
		}
		r, raw, err := report(ctx, t, c)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range nodes {
			found := false
			for _, f := range r.Findings {
				found = found || (f.Kind == audit.StaleConntrack && f.Node == n.Name && f.Endpoint == dead && f.Frontend == frontend)
			}
			if !found {
				t.Errorf("no StaleConntrack on %s to %s:\n%s", n.Name, dead, clip(raw))
			}
		}
		// The collector restarted (a chart upgrade, an eviction) while the
		// node port has no endpoints, so no longer in the node's rules: it
		// still counts the flows pinned to the gone pod, and the finding
		// stays on the new collector's reports. On the iptables node by the
		// frontends it kept on the node (--conntrack-file); on the nftables
		// node, its file deleted first (as at a first install), by the
		// rules' own no-endpoint-nodeports map. (The real nodes share the
		// host's filesystem: the chart's hostPath is /var/lib/proxyaudit.)
		for _, rc := range []struct {
			n      *localcluster.Node
			noFile bool
		}{{nodes[0], false}, {nodes[1], true}} {
			n0 := rc.n
			cps, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=collector",
				FieldSelector: "spec.nodeName=" + n0.Name})
			if err != nil || len(cps.Items) != 1 {
				t.Fatalf("%s's collector pod: %v (%d pods)", n0.Name, err, len(cps.Items))
			}
			if rc.noFile {
				// The old collector writes it only when its frontends
				// change, and nothing changes while CoreDNS is at zero (the
				// new one's log says whether it found one).
				if err := os.Remove("/var/lib/proxyaudit/proxyaudit.proxyaudit." + n0.Name + ".conntrack.json"); err != nil {
					t.Fatalf("%s's conntrack file: %v", n0.Name, err)
				}
			}
			restarted := time.Now()
			if err := c.Client.CoreV1().Pods("proxyaudit").Delete(ctx, cps.Items[0].Name, metav1.DeleteOptions{}); err != nil {
				t.Fatal(err)
			}
			// The old pod gone (a pod being deleted is not counted) and the
			// new one Ready.
			waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=collector", len(fleet), 2*time.Minute)
			ready := time.Now()
			until(2*time.Minute, "StaleConntrack on "+n0.Name+" from the restarted collector's reports", func() bool {
				r, _, err := report(ctx, t, c)
				if err != nil {
					return false
				}
				fresh := false
				for _, n := range r.Nodes {
					// Two conntrack reads (5 s apart) of the new collector.
					fresh = fresh || (n.Node == n0.Name && n.LastReport.After(ready.Add(12*time.Second)) && n.State != audit.NodeMissing)
				}
				if !fresh {
					return false
				}
				for _, f := range r.Findings {
					if f.Kind == audit.StaleConntrack && f.Node == n0.Name && f.Endpoint == dead {
						return true
					}
				}
				t.Fatalf("%s's restarted collector no longer reports the flows pinned to %s:\n%s\n%s", n0.Name, dead, clip(fmt.Sprint(r.Findings)), collectorLog(ctx, c, n0.Name, 20))
				return false
			})
			log := collectorLog(ctx, c, n0.Name, 200)
			if kept := strings.Contains(log, "conntrack frontends kept from before"); kept == rc.noFile {
				t.Errorf("%s's new collector started from kept frontends: %v, want %v:\n%s", n0.Name, kept, !rc.noFile, log)
			}
			t.Logf("%s's collector restarted (its file removed: %v): StaleConntrack to %s still reported %s later", n0.Name, rc.noFile, dead, time.Since(restarted).Round(time.Second))
		}
		r0 := rs[nodes[0].Name]
		before := r0.answers.Load() + r0.refused.Load()
		time.Sleep(2 * time.Second)
		if got := r0.answers.Load() + r0.refused.Load(); got != before {
			t.Errorf("in dry-run the resolver heard %d answers or refusals: its flow should still go to the gone pod", got-before)
		}
		back()
	})

	t.Run("restart mode, rolled out while DNS is down, deletes the stale entries, not kube-proxy", func(t *testing.T) {
		proxies := map[string]string{}
		for _, n := range nodes {
			proxies[n.Name] = kubeProxyPod(ctx, t, c, n.Name).Name
		}
		ip := toZero()
		dead := net.JoinHostPort(ip, "53")
		// Every aggregator pod is replaced while no node can resolve the
		// aggregators' name (below, the new leader is killed too): the
		// collectors reach the new pods by the addresses the old ones
		// sent them (stream.Peers). Only the new pods flush.
		old := map[string]bool{}
		for _, p := range waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, time.Minute) {
			old[p.Name] = true
		}
		helm(ctx, t, c, "upgrade", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--reuse-values", "--set", "remediation.mode=restart")
		until(3*time.Minute, "every aggregator pod replaced", func() bool {
			ps, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=aggregator"})
			if err != nil {
				return false
			}
			for _, p := range ps.Items {
				if old[p.Name] {
					return false
				}
			}
			return len(ps.Items) == 2
		})
		waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
		for _, n := range nodes {
			until(4*time.Minute, "the flush on "+n.Name, func() bool {
				for _, m := range events(n.Name, "ProxyauditFlushConntrack") {
					if strings.Contains(m, nodePort+"/UDP") && strings.Contains(m, "→ "+dead) {
						if !strings.Contains(m, "(deleted ") || strings.Contains(m, "(deleted 0 entries)") {
							t.Fatalf("flush on %s: %s", n.Name, m)
						}
						t.Logf("%s: %s", n.Name, m)
						return true
					}
				}
				return false
			})
			until(30*time.Second, "no entry left DNATed to the gone pod on "+n.Name, func() bool { return pinned(n, ip) == 0 })
			if p := kubeProxyPod(ctx, t, c, n.Name); p.Name != proxies[n.Name] {
				t.Errorf("%s's kube-proxy was restarted (%s → %s): its rules were right", n.Name, proxies[n.Name], p.Name)
			}
		}
		for _, n := range nodes {
			until(30*time.Second, n.Name+"'s resolver told the node port is down (REJECT), not left in a blackhole", func() bool { return rs[n.Name].refused.Load() > 0 })
		}
		until(2*time.Minute, "the StaleConntrack findings gone", func() bool {
			r, _, err := report(ctx, t, c)
			if err != nil {
				return false
			}
			for _, f := range r.Findings {
				if f.Kind == audit.StaleConntrack {
					return false
				}
			}
			return true
		})
		// Still without DNS, the new leader dies: what the collectors know
		// of the other new pod came only from the aggregators (DNS last
		// named the old pods, the redirect the dead leader).
		leader := ""
		until(time.Minute, "a leader among the new aggregator pods", func() bool { leader = leaderPod(ctx, c); return leader != "" })
		killed := time.Now()
		if err := c.Client.CoreV1().Pods("proxyaudit").Delete(ctx, leader, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
			t.Fatal(err)
		}
		// The other pod leads once the Lease expires; only what it heard
		// after that counts (the killed pod may answer for a moment).
		next := ""
		until(time.Minute, "the other new aggregator pod leading", func() bool { next = leaderPod(ctx, c); return next != "" && next != leader })
		led := time.Now()
		until(2*time.Minute, "every node heard by "+next+" after the leader "+leader+" was killed, without DNS", func() bool {
			r, _, err := report(ctx, t, c)
			return err == nil && len(r.Nodes) == len(fleet) && heardSince(r, led) == len(fleet)
		})
		t.Logf("leader %s killed without DNS: %s led %s later, every node heard by it %s after that", leader, next,
			led.Sub(killed).Round(time.Second), time.Since(led).Round(time.Second))
		back()
	})
}
