package realnodes

import (
	"context"
	"encoding/binary"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
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
	answers atomic.Int64
	stop    func()
}

func startResolver(t *testing.T, node *localcluster.Node, dns string) *resolver {
	t.Helper()
	var conn net.Conn
	if err := localcluster.InNetNS(node.NetNS, func() error {
		var err error
		conn, err = net.Dial("udp4", net.JoinHostPort(dns, "53"))
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
	defer helm(context.Background(), t, c, "uninstall", "proxyaudit", "--namespace", "proxyaudit", "--wait")
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
