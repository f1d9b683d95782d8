package conntrack

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// On a real kernel, flows to destinations that left their service, side
// by side: a UDP client that keeps sending and one that stopped; a
// connection attempt the kernel keeps retrying and one its client gave
// up, both begun before the pod left; and an attempt begun after grace
// past its leaving (the DNAT then made by rules that were stale). The
// reader dates each entry's last packet from its remaining timeout (the
// namespace's UDP timeout is 600 s: the sysctls are read, not assumed),
// and the judge calls stale only the client still sending and the late
// attempt: the others only count down to their timeouts (issue #58:
// rollouts made StaleConntrack on 82 % of healthy nodes' reports).
//
// The kernel does not refresh a SYN_SENT entry's timeout when the SYN is
// sent again (seen here, Linux 6.18: 117, 115, … 103 s left while the SYN
// went out at 1, 3, 7 and 15 s), so an attempt is dated by its first SYN
// and a retried one cannot be told from an abandoned one: both are
// attempts begun while the pod was there, which a healthy node's rules
// sent to it.
func TestE2EConntrackLiveAndDyingFlows(t *testing.T) {
	ns := ctScratch(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The gone pods' addresses resolve (as a pod's does on its node's
	// bridge) and nothing answers there: packets go out and vanish. Without
	// the neighbours the kernel would fail the sockets (no route to host)
	// and end the clients' retries itself.
	for _, a := range []string{"198.18.77.4", "198.18.77.5", "198.18.77.6"} {
		if out, err := ns.Exec(ctx, "ip", "neigh", "replace", a, "lladdr", "02:00:00:00:00:0"+a[len(a)-1:], "dev", "d0", "nud", "permanent"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	// Four services' frontends, DNATed to addresses nothing answers at
	// (their pods are gone): .12 and .13, each with 53/UDP and 80/TCP.
	for _, r := range [][]string{
		{"198.19.0.12", "udp", "53", "198.18.77.4:5353"}, {"198.19.0.13", "udp", "53", "198.18.77.5:5353"},
		{"198.19.0.12", "tcp", "80", "198.18.77.4:8080"}, {"198.19.0.13", "tcp", "80", "198.18.77.5:8080"},
		{"198.19.0.14", "tcp", "80", "198.18.77.6:8080"},
	} {
		if out, err := ns.Exec(ctx, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", r[0]+"/32", "-p", r[1], "--dport", r[2], "-j", "DNAT", "--to-destination", r[3]); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	const grace = 10 * time.Second
	start := time.Now()
	left := start.Add(3 * time.Second) // the pods leave their services 3 s in
	var stopSending func()
	var retried, abandoned, late int
	connect := func(to string) (int, error) {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		ap := netip.MustParseAddrPort(to)
		if err := syscall.Connect(fd, &syscall.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}); err != nil && err != syscall.EINPROGRESS {
			syscall.Close(fd)
			return -1, err
		}
		return fd, nil
	}
	err := localcluster.InNetNS(ns.NetNS, func() error {
		// The UDP client that keeps sending, on one socket (one flow).
		live, err := net.Dial("udp4", "198.19.0.12:53")
		if err != nil {
			return err
		}
		sctx, scancel := context.WithCancel(ctx)
		stopSending = func() { scancel(); live.Close() }
		go func() {
			t := time.NewTicker(500 * time.Millisecond)
			defer t.Stop()
			for sctx.Err() == nil {
				live.Write([]byte("q"))
				<-t.C
			}
		}()
		// The UDP client that stopped after a second.
		dead, err := net.Dial("udp4", "198.19.0.13:53")
		if err != nil {
			return err
		}
		dead.Write([]byte("q"))
		time.Sleep(time.Second)
		dead.Write([]byte("q"))
		dead.Close()
		// The connection attempts: non-blocking connects the kernel
		// retries (SYN at 0, 1, 3, 7, 15, 31 s…); the second is closed
		// after 2 s, as a client whose timeout ran out.
		if retried, err = connect("198.19.0.12:80"); err != nil {
			return err
		}
		if abandoned, err = connect("198.19.0.13:80"); err != nil {
			return err
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stopSending()
	defer syscall.Close(retried)
	time.Sleep(2 * time.Second)
	syscall.Close(abandoned)
	// The late attempt, past grace after the pods left.
	time.Sleep(time.Until(left.Add(grace + 2*time.Second)))
	if err := localcluster.InNetNS(ns.NetNS, func() error {
		var err error
		late, err = connect("198.19.0.14:80")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(late)

	// The services as the API had them: both pods until left.
	svc := func(ip string, eps ...string) audit.Service {
		var es []audit.SliceEndpoint
		for _, a := range eps {
			es = append(es, audit.SliceEndpoint{Addr: netip.MustParseAddr(a), Ready: true, Serving: true})
		}
		return audit.Service{Namespace: "web", Name: ip, ClusterIPs: []netip.Addr{netip.MustParseAddr(ip)},
			Ports:  []corev1.ServicePort{{Name: "u", Protocol: corev1.ProtocolUDP, Port: 53}, {Name: "t", Protocol: corev1.ProtocolTCP, Port: 80}},
			Slices: []audit.Slice{{Family: 4, Ports: []audit.SlicePort{{Name: "u", Protocol: "UDP", Port: 5353}, {Name: "t", Protocol: "TCP", Port: 8080}}, Endpoints: es}}}
	}
	h := audit.NewHistory(10 * time.Minute)
	h.Update(&audit.State{Services: []audit.Service{svc("198.19.0.12", "198.18.77.4"), svc("198.19.0.13", "198.18.77.5"), svc("198.19.0.14", "198.18.77.6")}}, start.Add(-time.Minute))
	h.Update(&audit.State{Services: []audit.Service{svc("198.19.0.12"), svc("198.19.0.13"), svc("198.19.0.14")}}, left)

	// Read once the retried SYN went out again past grace (15 s in).
	time.Sleep(time.Until(start.Add(18 * time.Second)))
	var ct *audit.Conntrack
	keys := []audit.FrontendKey{}
	for _, ip := range []string{"198.19.0.12", "198.19.0.13", "198.19.0.14"} {
		keys = append(keys, audit.FrontendKey{IP: netip.MustParseAddr(ip), Protocol: "UDP", Port: 53}, audit.FrontendKey{IP: netip.MustParseAddr(ip), Protocol: "TCP", Port: 80})
	}
	if err := localcluster.InNetNS(ns.NetNS, func() error {
		var err error
		ct, err = (&Reader{}).Read(ctx, keys)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for _, f := range ct.Flows {
		t.Logf("%s -> %s: udp %d tcp %v, last packet %.1f s after the pod left", f.Frontend, f.Dest, f.UDP, f.TCP, f.Active.Sub(left).Seconds())
	}
	stale := map[string]bool{}
	for _, f := range audit.JudgeConntrack("n1", ct, h, audit.ModeIPTables, now, grace) {
		stale[f.Frontend] = true
		t.Logf("stale: %s", f.Detail)
	}
	want := map[string]bool{"198.19.0.12:53/UDP": true, "198.19.0.14:80/TCP": true}
	if fmt.Sprint(stale) != fmt.Sprint(want) {
		t.Errorf("stale %v, want %v (the stopped client and the attempts begun before the pods left only count down)", stale, want)
	}
	for _, f := range ct.Flows {
		if f.Frontend.String() == "198.19.0.12:80/TCP" && f.Active.After(start.Add(5*time.Second)) {
			t.Logf("this kernel refreshed a SYN_SENT entry's timeout when the SYN was sent again (last packet %s after the first): the retried attempt could be told apart", f.Active.Sub(start))
		}
	}
	// Without the dates (an older collector), all five are stale: the
	// false findings of a rollout.
	for i := range ct.Flows {
		ct.Flows[i].Active = time.Time{}
	}
	if n := len(audit.JudgeConntrack("n1", ct, h, audit.ModeIPTables, now, grace)); n != 5 {
		t.Errorf("undated, %d stale pairs, want 5: the test does not meet what it is about", n)
	}
}
