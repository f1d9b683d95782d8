package conntrack

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// ctScratch is a namespace with a node address, a "pod" address that
// answers, and DNAT rules of the kind kube-proxy writes (in OUTPUT, as
// for a node's own clients): cluster IP 198.19.0.10 53/UDP and 80/TCP
// to the pod, 198.19.0.11 53/UDP to an address nothing answers at, node
// port 30053/UDP to the pod, and a DNAT that is not kube-proxy's.
func ctScratch(t testing.TB) *localcluster.Scratch {
	t.Helper()
	localcluster.NeedRoot(t, false)
	ctx := context.Background()
	ns, err := localcluster.NewScratch(ctx, "conntrack")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ns.Close() })
	setupCTScratch(t, ns)
	return ns
}

func setupCTScratch(t testing.TB, ns *localcluster.Scratch) {
	t.Helper()
	ctx := context.Background()
	for _, cmd := range [][]string{
		{"ip", "link", "set", "lo", "up"},
		{"ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1"}, // no dummy driver in every kernel
		{"ip", "link", "set", "d1", "up"},
		{"ip", "addr", "add", "198.18.77.1/24", "dev", "d0"},
		{"ip", "addr", "add", "198.18.77.2/32", "dev", "d0"},
		{"ip", "link", "set", "d0", "up"},
		{"ip", "route", "add", "198.19.0.0/16", "dev", "d0"},
		{"sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout=600"},
		{"iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.19.0.10/32", "-p", "udp", "--dport", "53", "-j", "DNAT", "--to-destination", "198.18.77.2:5353"},
		{"iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.19.0.10/32", "-p", "tcp", "--dport", "80", "-j", "DNAT", "--to-destination", "198.18.77.2:8080"},
		{"iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.19.0.11/32", "-p", "udp", "--dport", "53", "-j", "DNAT", "--to-destination", "198.18.77.3:5353"},
		{"iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.18.77.1/32", "-p", "udp", "--dport", "30053", "-j", "DNAT", "--to-destination", "198.18.77.2:5353"},
		{"iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.19.9.9/32", "-p", "udp", "--dport", "53", "-j", "DNAT", "--to-destination", "198.18.77.2:5353"},
	} {
		if out, err := ns.Exec(ctx, cmd...); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(cmd, " "), err, out)
		}
	}
}

// servePod answers as the scratch's "pod" does: UDP echo on
// 198.18.77.2:5353, TCP accepted on 198.18.77.2:8080. Call it in the
// namespace; stop closes both.
func servePod() (stop func(), err error) {
	udp, err := net.ListenPacket("udp4", "198.18.77.2:5353")
	if err != nil {
		return nil, err
	}
	tcp, err := net.Listen("tcp4", "198.18.77.2:8080")
	if err != nil {
		udp.Close()
		return nil, err
	}
	go func() {
		buf := make([]byte, 512)
		for {
			n, from, err := udp.ReadFrom(buf)
			if err != nil {
				return
			}
			udp.WriteTo(buf[:n], from)
		}
	}()
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := tcp.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	return func() {
		udp.Close()
		tcp.Close()
		<-done
		for _, c := range conns {
			c.Close()
		}
	}, nil
}

func ctKeys(o *audit.Observed) []audit.FrontendKey {
	var out []audit.FrontendKey
	for _, f := range o.Frontends {
		out = append(out, f.FrontendKey)
	}
	return out
}

func ctFrontends() *audit.Observed {
	fe := func(ip string, proto string, port uint16) audit.ObservedFrontend {
		return audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: netip.MustParseAddr(ip), Protocol: proto, Port: port}}
	}
	return &audit.Observed{Mode: audit.ModeIPTables, Families: []int{4}, Frontends: []audit.ObservedFrontend{
		fe("198.19.0.10", "UDP", 53), fe("198.19.0.10", "TCP", 80), fe("198.19.0.11", "UDP", 53),
		{FrontendKey: audit.NodePortKey(4, "UDP", 30053)},
	}}
}

// askUDP sends one datagram to to and waits up to 2 s for the answer.
func askUDP(to string) error {
	c, err := net.Dial("udp4", to)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := c.Write([]byte("q")); err != nil {
		return err
	}
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	_, err = c.Read(make([]byte, 8))
	return err
}

// Real traffic through real DNAT rules in a real kernel's conntrack: the
// reader counts each frontend's flows per destination, UDP and TCP by
// state, the unanswered ones, and leaves out what is not kube-proxy's.
func TestReaderOnRealFlows(t *testing.T) {
	ns := ctScratch(t)
	ctx := context.Background()
	var got *audit.Conntrack
	var stamped *audit.Conntrack
	err := localcluster.InNetNS(ns.NetNS, func() error {
		stop, err := servePod()
		if err != nil {
			return err
		}
		defer stop()
		ask := askUDP
		for range 3 {
			if err := ask("198.19.0.10:53"); err != nil {
				return fmt.Errorf("a DNS-like client through the cluster IP: %w", err)
			}
		}
		if err := ask("198.18.77.1:30053"); err != nil {
			return fmt.Errorf("through the node port: %w", err)
		}
		if err := ask("198.19.9.9:53"); err != nil {
			return fmt.Errorf("through a DNAT that is not kube-proxy's: %w", err)
		}
		for range 2 { // nothing answers there
			c, err := net.Dial("udp4", "198.19.0.11:53")
			if err != nil {
				return err
			}
			c.Write([]byte("q"))
			c.Close()
		}
		conn, err := net.Dial("tcp4", "198.19.0.10:80")
		if err != nil {
			return err
		}
		defer conn.Close()
		r := &Reader{}
		if got, err = r.Read(ctx, ctKeys(ctFrontends())); err != nil {
			return err
		}
		if r.BytesRead() == 0 {
			return fmt.Errorf("no bytes read")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"198.19.0.10:53/UDP -> 198.18.77.2:5353":  "udp 3 unreplied 0",
		"198.19.0.10:80/TCP -> 198.18.77.2:8080":  "tcp map[ESTABLISHED:1] unreplied 0",
		"198.19.0.11:53/UDP -> 198.18.77.3:5353":  "udp 2 unreplied 2",
		"node port 30053/UDP -> 198.18.77.2:5353": "udp 1 unreplied 0",
	}
	seen := map[string]string{}
	for _, f := range got.Flows {
		s := fmt.Sprintf("udp %d unreplied %d", f.UDP, f.Unreplied)
		if len(f.TCP) > 0 {
			s = fmt.Sprintf("tcp %v unreplied %d", f.TCP, f.Unreplied)
		}
		seen[f.Frontend.String()+" -> "+f.Dest.String()] = s
		if len(f.Samples) == 0 || !f.Samples[0].Addr().IsValid() {
			t.Errorf("%v: no client sample", f)
		}
	}
	if fmt.Sprint(seen) != fmt.Sprint(want) || got.Entries != 7 || got.Dropped != 0 {
		t.Errorf("read %d entries (%d dropped):\n%v\nwant\n%v", got.Entries, got.Dropped, seen, want)
	}
	// The conntrack tool sees the same table.
	out, err := ns.Exec(ctx, "conntrack", "-L", "-o", "extended", "--dst-nat")
	if err != nil {
		t.Fatal(err, out)
	}
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "ipv4 ") {
			n++
		}
	}
	if n != 8 { // the 7 and the DNAT that is not kube-proxy's
		t.Errorf("conntrack -L --dst-nat lists %d entries:\n%s", n, out)
	}

	// With the kernel's timestamps on, the oldest flow's start is exact.
	if out, err := ns.Exec(ctx, "sysctl", "-qw", "net.netfilter.nf_conntrack_timestamp=1"); err != nil {
		t.Fatal(err, out)
	}
	before := time.Now()
	err = localcluster.InNetNS(ns.NetNS, func() error {
		c, err := net.Dial("udp4", "198.19.0.11:53")
		if err != nil {
			return err
		}
		c.Write([]byte("q"))
		c.Close()
		stamped, err = (&Reader{}).Read(ctx, ctKeys(ctFrontends()))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range stamped.Flows {
		if f.Dest.String() == "198.18.77.3:5353" {
			if !stamped.Timestamps || f.Oldest.Before(before.Add(-time.Second)) || f.Oldest.After(time.Now()) || f.UDP != 3 {
				t.Errorf("timestamped read: %+v (timestamps %v)", f, stamped.Timestamps)
			}
		}
	}
}

// The bound on distinct pairs holds: what falls beyond it is counted as
// dropped, not kept.
func TestReaderBound(t *testing.T) {
	ns := ctScratch(t)
	ctx := context.Background()
	err := localcluster.InNetNS(ns.NetNS, func() error {
		for range 3 {
			c, err := net.Dial("udp4", "198.19.0.11:53")
			if err != nil {
				return err
			}
			c.Write([]byte("q"))
			c.Close()
		}
		c, err := net.Dial("udp4", "198.18.77.1:30053")
		if err != nil {
			return err
		}
		c.Write([]byte("q"))
		c.Close()
		got, err := (&Reader{MaxPairs: 1}).Read(ctx, ctKeys(ctFrontends()))
		if err != nil {
			return err
		}
		if len(got.Flows) != 1 || got.Entries != 4 || got.Dropped == 0 || got.Flows[0].Total()+got.Dropped != 4 {
			return fmt.Errorf("bounded to one pair: %+v", got)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
