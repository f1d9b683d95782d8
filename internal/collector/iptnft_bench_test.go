package collector

import (
	"bytes"
	"context"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// rusage is this process's CPU and its waited-for children's.
func rusage() (self, kids time.Duration) {
	var s, k syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &s)
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &k)
	return time.Duration(s.Utime.Nano() + s.Stime.Nano()), time.Duration(k.Utime.Nano() + k.Stime.Nano())
}

// BenchmarkIPTablesRead reads a ruleset of 10k services × 10 endpoints
// (large-cluster layout; PROXYAUDIT_BENCH_SMALL=1 for 1k × 10 with
// comments), loaded into a real kernel with iptables-restore, both ways
// in each iteration, side by side: iptables-save and ip6tables-save
// parsed as they stream (the reader before this one), and the netlink
// reader's whole read. Then, with the reader fed by the change signal, a
// read of what one kube-proxy partial sync of ten services changed (its
// KUBE-SERVICES rewrite included).
func BenchmarkIPTablesRead(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec, ipt, _ := benchRules(b)
	ctx := context.Background()
	ns, err := localcluster.NewScratch(ctx, "iptread")
	if err != nil {
		b.Fatal(err)
	}
	defer ns.Close()
	load := time.Now()
	if err := ns.RestoreIPTables(ctx, ipt, false); err != nil {
		b.Fatal(err)
	}
	b.Logf("%d services × %d endpoints loaded in %s", spec.Services, spec.EndpointsPerService, time.Since(load).Round(time.Millisecond))
	want := spec.Services * spec.EndpointsPerService
	b.Run("whole", func(b *testing.B) { benchIPTWhole(b, ctx, ns, want) })
	b.Run("legacy-whole", func(b *testing.B) { benchIPTLegacyWhole(b, ctx, ipt, want) })
	b.Run("changes-10-services", func(b *testing.B) { benchIPTChanges(b, ctx, ns, spec) })
}

// endpointCount is how many endpoints a model holds.
func endpointCount(o *audit.Observed) int {
	n := 0
	for _, f := range o.Frontends {
		n += len(f.Endpoints)
	}
	return n
}

// benchIPTWhole: iptables-save parsed as it streams beside the netlink
// reader's whole read, on the nf_tables backend in ns.
func benchIPTWhole(b *testing.B, ctx context.Context, ns *localcluster.Scratch, want int) {
	inNS := func(f func() error) {
		b.Helper()
		if err := localcluster.InNetNS(ns.NetNS, f); err != nil {
			b.Fatal(err)
		}
	}

	var saveWall, saveCPU, nlWall, nlCPU time.Duration
	var alloc uint64
	for b.Loop() {
		inNS(func() error {
			s0, k0 := rusage()
			t0 := time.Now()
			text, err := NewHost().iptablesSave(Source{Mode: audit.ModeIPTables}).Read(ctx)
			if err != nil {
				return err
			}
			s1, k1 := rusage()
			t1 := time.Now()
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			nl, err := iptables.NewNFTReader(nil).Read(ctx)
			if err != nil {
				return err
			}
			runtime.ReadMemStats(&m1)
			s2, _ := rusage()
			saveWall, saveCPU = saveWall+t1.Sub(t0), saveCPU+(s1-s0)+(k1-k0)
			nlWall, nlCPU = nlWall+time.Since(t1), nlCPU+(s2-s1)
			alloc += m1.TotalAlloc - m0.TotalAlloc
			if endpointCount(nl) != want || endpointCount(text) != want {
				b.Fatalf("read %d (netlink) and %d (iptables-save) endpoints, want %d", endpointCount(nl), endpointCount(text), want)
			}
			return nil
		})
	}
	n := float64(b.N)
	b.ReportMetric(saveWall.Seconds()/n, "save+parse-s")
	b.ReportMetric(saveCPU.Seconds()/n, "save+parse-cpu-s")
	b.ReportMetric(nlWall.Seconds()/n, "netlink-s")
	b.ReportMetric(nlCPU.Seconds()/n, "netlink-cpu-s")
	b.ReportMetric(saveWall.Seconds()/nlWall.Seconds(), "x-faster")
	b.ReportMetric(float64(alloc)/n/(1<<20), "netlink-alloc-MB")

}

// benchIPTLegacyWhole: iptables-legacy-save beside the getsockopt
// reader, on the legacy backend loaded with ipt; then a read of the
// table unchanged.
func benchIPTLegacyWhole(b *testing.B, ctx context.Context, ipt []byte, want int) {

	lns, err := localcluster.NewScratch(ctx, "iptlegread")
	if err != nil {
		b.Fatal(err)
	}
	defer lns.Close()
	if err := lns.RestoreIPTables(ctx, ipt, true); err != nil {
		b.Fatal(err)
	}
	src := Source{Mode: audit.ModeIPTables, Legacy: true}
	var saveWall, saveCPU, rdWall, rdCPU time.Duration
	var alloc uint64
	var tableBytes int64
	for b.Loop() {
		if err := localcluster.InNetNS(lns.NetNS, func() error {
			s0, k0 := rusage()
			t0 := time.Now()
			text, err := NewHost().iptablesSave(src).Read(ctx)
			if err != nil {
				return err
			}
			s1, k1 := rusage()
			t1 := time.Now()
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			lr := iptables.NewLegacyReader(nil)
			got, err := lr.Read(ctx)
			if err != nil {
				return err
			}
			runtime.ReadMemStats(&m1)
			s2, _ := rusage()
			saveWall, saveCPU = saveWall+t1.Sub(t0), saveCPU+(s1-s0)+(k1-k0)
			rdWall, rdCPU = rdWall+time.Since(t1), rdCPU+(s2-s1)
			alloc += m1.TotalAlloc - m0.TotalAlloc
			tableBytes = lr.BytesRead()
			if endpointCount(got) != want || endpointCount(text) != want {
				b.Fatalf("read %d (getsockopt) and %d (iptables-legacy-save) endpoints, want %d", endpointCount(got), endpointCount(text), want)
			}
			return nil
		}); err != nil {
			b.Fatal(err)
		}
	}
	// A read of a table that did not change (kube-proxy's sync of
	// the same content replaces the whole table on this backend).
	var again time.Duration
	var againAlloc uint64
	if err := localcluster.InNetNS(lns.NetNS, func() error {
		lr := iptables.NewLegacyReader(nil)
		if _, err := lr.ReadChanges(ctx); err != nil {
			return err
		}
		for range 3 {
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			s0, _ := rusage()
			ch, err := lr.ReadChanges(ctx)
			if err != nil {
				return err
			}
			s1, _ := rusage()
			runtime.ReadMemStats(&m1)
			again, againAlloc = again+(s1-s0), againAlloc+(m1.TotalAlloc-m0.TotalAlloc)
			if ch.Whole != nil || len(ch.Frontends) > 0 {
				b.Fatalf("an unchanged table read as changed: %d frontends", len(ch.Frontends))
			}
		}
		return nil
	}); err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(again.Seconds()/3, "unchanged-read-cpu-s")
	b.ReportMetric(float64(againAlloc)/3/(1<<20), "unchanged-read-alloc-MB")
	n := float64(b.N)
	b.ReportMetric(saveWall.Seconds()/n, "save+parse-s")
	b.ReportMetric(saveCPU.Seconds()/n, "save+parse-cpu-s")
	b.ReportMetric(rdWall.Seconds()/n, "getsockopt-s")
	b.ReportMetric(rdCPU.Seconds()/n, "getsockopt-cpu-s")
	b.ReportMetric(saveWall.Seconds()/rdWall.Seconds(), "x-faster")
	b.ReportMetric(float64(alloc)/n/(1<<20), "heap-alloc-MB")
	b.ReportMetric(float64(tableBytes)/(1<<20), "table-MB")

}

// benchIPTChanges: with the reader fed by the change signal, a read of
// what one kube-proxy partial sync of ten services changed.
func benchIPTChanges(b *testing.B, ctx context.Context, ns *localcluster.Scratch, spec synth.Spec) {
	inNS := func(f func() error) {
		b.Helper()
		if err := localcluster.InNetNS(ns.NetNS, f); err != nil {
			b.Fatal(err)
		}
	}

	var r *iptables.NFTReader
	var sig *nl.GenSignal
	inNS(func() error {
		s, err := nl.OpenGenSignal(DefaultNotifyBuffer)
		if err != nil {
			return err
		}
		sig = s
		r = iptables.NewNFTReader(nil)
		sig.Feed(r)
		_, err = r.ReadChanges(ctx)
		return err
	})
	defer sig.Close()
	var sync bytes.Buffer
	services := []int{}
	for i := range 10 {
		services = append(services, i*spec.Services/10)
	}
	if err := spec.WritePartialSync(&sync, services, true); err != nil {
		b.Fatal(err)
	}
	var cpu time.Duration
	var alloc uint64
	var frontends int
	for b.Loop() {
		b.StopTimer()
		// The CPU counted is this process's from the commit on: the
		// notifications decoded as they arrive, and the read.
		cpu0, _ := rusage()
		cmd := ns.Command(ctx, "iptables-restore", "--noflush")
		cmd.Stdin = bytes.NewReader(sync.Bytes())
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("%v: %s", err, out)
		}
		tok, err := sig.Token()
		if err != nil {
			b.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); !r.CaughtUp(tok); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				b.Fatal("the sync's notifications did not arrive")
			}
		}
		b.StartTimer()
		inNS(func() error {
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			ch, err := r.ReadChanges(ctx)
			if err != nil {
				return err
			}
			s1, _ := rusage()
			runtime.ReadMemStats(&m1)
			cpu += s1 - cpu0
			alloc += m1.TotalAlloc - m0.TotalAlloc
			if ch.Whole != nil {
				b.Fatal("a whole read where the changes were known")
			}
			frontends += len(ch.Frontends)
			return nil
		})
	}
	n := float64(b.N)
	b.ReportMetric(cpu.Seconds()/n, "notes+read-cpu-s")
	b.ReportMetric(float64(alloc)/n/(1<<20), "alloc-MB")
	b.ReportMetric(float64(frontends)/n, "frontends-changed")
	b.ReportMetric(float64(r.Counts().Chains)/n, "chains-read")

}
