package conntrack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// A flush in a real kernel deletes exactly the entries of the pairs it
// names: the stale UDP flow goes (and its client's next packet takes the
// rules as they are now and is answered), a live flow of the same
// frontend stays, an answered TCP connection is never deleted even when
// TCP is asked, a connection attempt nothing answered is deleted only
// when TCP is asked, and a node port's flow on the node's address goes.
func TestConntrackFlushOnRealFlows(t *testing.T) {
	ns := ctScratch(t)
	ctx := context.Background()
	if out, err := ns.Exec(ctx, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", "198.19.0.12/32", "-p", "tcp", "--dport", "80", "-j", "DNAT", "--to-destination", "198.18.77.3:8080"); err != nil {
		t.Fatal(err, out)
	}
	keys := append(ctKeys(ctFrontends()), audit.FrontendKey{IP: netip.MustParseAddr("198.19.0.12"), Protocol: "TCP", Port: 80})
	fe := func(s string) audit.FrontendKey { return mustKey(t, s) }
	ap := netip.MustParseAddrPort
	err := localcluster.InNetNS(ns.NetNS, func() error {
		stop, err := servePod()
		if err != nil {
			return err
		}
		defer stop()
		asked := askOn
		// The stale client: it asked while the service's endpoint was
		// 198.18.77.3 (which is gone: nothing answers there).
		stale, err := net.Dial("udp4", "198.19.0.11:53")
		if err != nil {
			return err
		}
		defer stale.Close()
		if err := asked(stale); !errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("asked the gone endpoint: %v, want no answer", err)
		}
		// A live client of another frontend, answered.
		live, err := net.Dial("udp4", "198.19.0.10:53")
		if err != nil {
			return err
		}
		defer live.Close()
		if err := asked(live); err != nil {
			return fmt.Errorf("live client: %w", err)
		}
		np, err := net.Dial("udp4", "198.18.77.1:30053")
		if err != nil {
			return err
		}
		defer np.Close()
		if err := asked(np); err != nil {
			return fmt.Errorf("node port client: %w", err)
		}
		est, err := net.Dial("tcp4", "198.19.0.10:80")
		if err != nil {
			return err
		}
		defer est.Close()
		// A connection attempt nothing answers (SYN_SENT; its entry stays
		// after the client gives up). On this goroutine: it is the one in
		// the namespace.
		if c, err := net.DialTimeout("tcp4", "198.19.0.12:80", 300*time.Millisecond); err == nil {
			c.Close()
			return errors.New("a connection to nothing was answered")
		}
		// kube-proxy moves the service to the live pod: the rules are right
		// now, and the stale client's flow still goes to the gone one.
		if out, err := ns.Exec(ctx, "iptables", "-t", "nat", "-R", "OUTPUT", "3", "-d", "198.19.0.11/32", "-p", "udp", "--dport", "53", "-j", "DNAT", "--to-destination", "198.18.77.2:5353"); err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		if err := asked(stale); !errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("after the rule moved, the stale flow: %v, want no answer (conntrack keeps it on the gone pod)", err)
		}
		r := &Reader{}
		// Another service's external IP is this node's address, on the node
		// port's port: the flow to 198.18.77.1:30053 is that frontend's, and
		// a flush naming the node port with its live endpoint (what a
		// compromised aggregator would ask) leaves it alone.
		other := audit.FrontendKey{IP: netip.MustParseAddr("198.18.77.1"), Protocol: "UDP", Port: 30053}
		if got, err := r.Delete(ctx, []FlushTarget{{Frontend: fe("nodeport:30053/UDP"), Dest: ap("198.18.77.2:5353"),
			Explicit: map[audit.FrontendKey]bool{other: true}}}); err != nil || fmt.Sprint(got) != "[0]" {
			return fmt.Errorf("a node port's flush beside a frontend of the node's address on its port: deleted %v (%v), want [0]", got, err)
		}
		targets := []FlushTarget{
			{Frontend: fe("198.19.0.11:53/UDP"), Dest: ap("198.18.77.3:5353")},
			{Frontend: fe("198.19.0.10:80/TCP"), Dest: ap("198.18.77.2:8080"), TCP: true},
			{Frontend: fe("198.19.0.12:80/TCP"), Dest: ap("198.18.77.3:8080")},
			{Frontend: fe("nodeport:30053/UDP"), Dest: ap("198.18.77.2:5353")},
		}
		got, err := r.Delete(ctx, targets)
		if err != nil {
			return err
		}
		if fmt.Sprint(got) != "[1 0 0 1]" {
			return fmt.Errorf("deleted %v, want [1 0 0 1]: the stale UDP flow and the node port's; never the established TCP; no TCP unless asked", got)
		}
		targets[2].TCP = true
		if got, err := r.Delete(ctx, targets[2:3]); err != nil || fmt.Sprint(got) != "[1]" {
			return fmt.Errorf("the unanswered connection attempt, TCP asked: %v %v", got, err)
		}
		left, err := flowsLeft(ctx, r, keys)
		if err != nil {
			return err
		}
		want := map[string]int{"198.19.0.10:53/UDP -> 198.18.77.2:5353": 1, "198.19.0.10:80/TCP -> 198.18.77.2:8080": 1}
		if fmt.Sprint(left) != fmt.Sprint(want) {
			return fmt.Errorf("after the flushes the table holds %v, want %v", left, want)
		}
		// The stale client's next packet takes the rules: answered.
		if err := asked(stale); err != nil {
			return fmt.Errorf("the stale client after the flush: %w, want an answer from the live pod", err)
		}
		if err := asked(live); err != nil {
			return fmt.Errorf("the live client after the flush: %w", err)
		}
		if _, err := est.Write([]byte("still here")); err != nil {
			return fmt.Errorf("the established connection: %w", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// conntrack(8) agrees: nothing is DNATed to the gone address any more.
	if out, err := ns.Exec(ctx, "conntrack", "-L", "-o", "extended", "--dst-nat"); err != nil || strings.Contains(out, "src=198.18.77.3 ") {
		t.Errorf("conntrack -L after the flushes (%v):\n%s", err, out)
	}
}

// askOn sends one datagram on c and waits up to 0.7 s for the answer.
func askOn(c net.Conn) error {
	if _, err := c.Write([]byte("q")); err != nil {
		return err
	}
	c.SetReadDeadline(time.Now().Add(700 * time.Millisecond))
	_, err := c.Read(make([]byte, 8))
	return err
}

// flowsLeft reads the table: the flows of each frontend and destination.
func flowsLeft(ctx context.Context, r *Reader, keys []audit.FrontendKey) (map[string]int, error) {
	after, err := r.Read(ctx, keys)
	if err != nil {
		return nil, err
	}
	left := map[string]int{}
	for _, f := range after.Flows {
		left[f.Frontend.String()+" -> "+f.Dest.String()] = f.Total()
	}
	return left, nil
}

func mustKey(t *testing.T, s string) audit.FrontendKey {
	t.Helper()
	k, err := audit.ParseFrontendKey(s)
	if err != nil {
		t.Fatal(err)
	}
	return k
}
