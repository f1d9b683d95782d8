package conntrack

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// ctFill makes n DNATed UDP entries in the namespace's conntrack table with
// real packets: a raw socket sends one datagram per (cluster IP, source
// port) to 16 cluster IPs DNATed to addresses nothing answers at, so each
// is an unreplied entry with IPS_DST_NAT, as a stuck client's would be.
// The machine-wide table limit is raised for it and put back after.
func ctFill(t testing.TB, ns *localcluster.Scratch, n int) *audit.Observed {
	t.Helper()
	ctx := context.Background()
	const maxPath = "/proc/sys/net/netfilter/nf_conntrack_max"
	old, err := os.ReadFile(maxPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(maxPath, []byte(strconv.Itoa(n+n/4+1000)), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.WriteFile(maxPath, old, 0o644) })
	// One destination per cluster IP: flows of one client port to two
	// cluster IPs DNATed to one address would have one reply tuple, and
	// NAT would have to move their ports.
	for i := range 16 {
		if out, err := ns.Exec(ctx, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", fmt.Sprintf("198.19.1.%d/32", i), "-p", "udp", "--dport", "53", "-j", "DNAT",
			"--to-destination", fmt.Sprintf("198.18.77.%d:5353", 16+i)); err != nil {
			t.Fatal(err, out)
		}
		// A neighbour that never answers, known: no ARP queue to fill.
		if out, err := ns.Exec(ctx, "ip", "neigh", "replace", fmt.Sprintf("198.18.77.%d", 16+i), "lladdr", fmt.Sprintf("02:00:00:00:00:%02x", 16+i),
			"dev", "d0", "nud", "permanent"); err != nil {
			t.Fatal(err, out)
		}
	}
	o := ctFrontends()
	for i := range 16 {
		o.Frontends = append(o.Frontends, audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: netip.AddrFrom4([4]byte{198, 19, 1, byte(i)}), Protocol: "UDP", Port: 53}})
	}
	start := time.Now()
	err = localcluster.InNetNS(ns.NetNS, func() error {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_UDP)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		pkt := make([]byte, 9) // UDP header and one byte
		binary.BigEndian.PutUint16(pkt[4:], uint16(len(pkt)))
		for i := range n {
			ip := [4]byte{198, 19, 1, byte(i % 16)}
			binary.BigEndian.PutUint16(pkt[0:], uint16(1024+i/16%60000))
			binary.BigEndian.PutUint16(pkt[2:], 53)
			if i > 0 && i%960000 == 0 {
				// Every source port used: another source address, or
				// the next packets would land on existing entries.
				n := i / 960000
				if out, err := exec.Command("ip", "addr", "add", fmt.Sprintf("198.18.78.%d/32", n), "dev", "d0").CombinedOutput(); err != nil {
					return fmt.Errorf("%v: %s", err, out)
				}
				if out, err := exec.Command("ip", "route", "replace", "198.19.1.0/28", "dev", "d0", "src", fmt.Sprintf("198.18.78.%d", n)).CombinedOutput(); err != nil {
					return fmt.Errorf("%v: %s", err, out)
				}
			}
			if err := unix.Sendto(fd, pkt, 0, &unix.SockaddrInet4{Addr: ip}); err != nil {
				return fmt.Errorf("packet %d: %w", i, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	out, err := ns.Exec(ctx, "conntrack", "-C")
	if err != nil {
		t.Fatal(err, out)
	}
	if c, _ := strconv.Atoi(strings.TrimSpace(out)); c < n {
		t.Fatalf("the table holds %s entries, want %d", strings.TrimSpace(out), n)
	}
	t.Logf("%d conntrack entries made in %s", n, time.Since(start).Round(time.Millisecond))
	return o
}

// BenchmarkConntrackMillion reads a table of a million DNATed entries:
// proxyaudit's streaming netlink reader beside `conntrack -L -o extended`
// (what a person or a script would run), in the same namespace. B/op is
// everything the reader allocated for one read; the tool's peak RSS is
// reported as tool-maxrss-MB.
func BenchmarkConntrackMillion(b *testing.B) {
	localcluster.NeedRoot(b, false)
	ns, err := localcluster.NewScratch(context.Background(), "ctmillion")
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	setupCTScratch(b, ns)
	n := 1_000_000
	if s := os.Getenv("PROXYAUDIT_CT_ENTRIES"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	o := ctFill(b, ns, n)
	b.Run("netlink-stream", func(b *testing.B) {
		b.ReportAllocs()
		var got *audit.Conntrack
		var peak uint64
		reader := &Reader{} // kept, as the collector keeps it
		for b.Loop() {
			err := localcluster.InNetNS(ns.NetNS, func() error {
				var err error
				got, err = reader.Read(context.Background(), ctKeys(o))
				return err
			})
			if err != nil {
				b.Fatal(err)
			}
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse)
		}
		if got.Entries < n {
			b.Fatalf("read %d entries of %d", got.Entries, n)
		}
		b.ReportMetric(float64(got.Entries), "entries")
		b.ReportMetric(float64(len(got.Flows)), "pairs")
		b.ReportMetric(float64(peak)/1e6, "heap-inuse-MB")
	})
	b.Run("conntrack-L", func(b *testing.B) {
		var rss int64
		for b.Loop() {
			cmd := ns.Command(context.Background(), "conntrack", "-L", "-o", "extended", "--dst-nat")
			cmd.Stdout = io.Discard
			if err := cmd.Run(); err != nil {
				b.Fatal(err)
			}
			if ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage); ok {
				rss = max(rss, ru.Maxrss)
			}
		}
		b.ReportMetric(float64(rss)/1024, "tool-maxrss-MB")
	})
}
