package collector

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// churnRun is one run of the real collector binary on a node whose rules a
// writer keeps rewriting: what it cost and how fast it reported.
type churnRun struct {
	services, period          string
	collectorCPU, writerCPU   time.Duration
	window                    time.Duration
	peakRSS                   int64
	reports, readErrors       int
	maxGap                    time.Duration
	driftSeen, flushSeen      time.Duration
	driftSeens                []time.Duration // each drift's, when several
	driftCmd, flushCmd        time.Duration   // the tool's own run
	saveFinished              bool
	saveTook                  time.Duration
	syncs                     int
	lastRead                  *stream.ReadStats
	collectorShare, writerPct float64
}

// churnSpec says what a churn run does.
type churnSpec struct {
	spec   synth.Spec
	legacy bool
	// nftables: kube-proxy's nftables mode instead of iptables (the
	// writer rewrites ten services' chains with `nft -f`).
	nftables bool
	// period is how often the writer commits a partial sync of ten
	// services' chains (0: no writer, a quiet node); dispatch adds
	// kube-proxy's rewrite of KUBE-SERVICES to each.
	period   time.Duration
	dispatch bool
	// drifts is how many drifts by hand are made, one service each,
	// driftEvery apart (default one); driftSeen is the slowest.
	drifts     int
	driftEvery time.Duration
	// window is how long the collector's cost is measured under churn;
	// saveFor how long the text tool is given to print the table under
	// it (default 20s).
	window, saveFor time.Duration
}

// runChurn loads cs.spec's rules into a scratch namespace, starts the
// writer and the collector binary (streaming to a stub aggregator in the
// namespace), measures the collector's cost over the window, then makes a
// drift by hand on a service the churn does not touch (one endpoint's
// DNAT rewritten) and flushes the nat table, timing each until a report
// shows it. It also runs iptables-save once under the churn, to say
// whether the text tool could have read the node at all.
func runChurn(tb testing.TB, cs churnSpec) churnRun {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	ns, tool, mode := loadChurn(tb, ctx, cs)
	defer ns.Close()
	ln := listenIn(tb, ns)
	s := startStubOn(tb, ln)
	// kube-proxy's metrics, as the collector scrapes them on every node:
	// the last sync is the writer's (a drift by hand is no sync). On the
	// legacy backend they are half the change signal; without them every
	// heartbeat would read.
	w := &localcluster.Churn{}
	if cs.period > 0 { // else a quiet node
		w = localcluster.StartChurn(ctx, ns.NetNS, localcluster.ChurnConfig{Spec: cs.spec, Mode: mode, Period: cs.period, Dispatch: cs.dispatch})
		defer func() {
			if err := w.Stop(); err != nil {
				tb.Error(err)
			}
		}()
	}
	w.LastSync.Store(time.Now().UnixMilli())
	metrics := startMetricsStub(tb, ns, &w.LastSync)

	run := churnRun{services: fmt.Sprint(cs.spec.Services), period: cs.period.String()}
	run.saveTook, run.saveFinished = saveUnderChurn(tb, ctx, ns, cs, tool)

	col, started, stopCollector := startChurnCollector(tb, ctx, ns, ln, mode, metrics)
	defer stopCollector()
	// The first report: the whole read, under the churn.
	first, _ := s.wait(tb, 0, 2*time.Minute, "with the rules", func(r received) bool { return r.r.ReadError == "" && !r.r.NoRules })
	tb.Logf("first report %s after the collector started", first.at.Sub(started).Round(time.Millisecond))
	measureChurn(tb, &run, cs, col, s, w, first.at)

	// Drifts by hand on services the churn does not touch: one
	// endpoint's DNAT rewritten to another address (on nf_tables), or
	// deleted (on the legacy backend, whose change signal is the table's
	// size: a same-size rewrite is the full read's to find).
	for i := range max(1, cs.drifts) {
		if i > 0 {
			time.Sleep(cs.driftEvery)
		}
		seen, took := driftOne(tb, ctx, ns, s, cs, tool, cs.spec.Services-1-i)
		run.driftSeens = append(run.driftSeens, seen)
		run.driftSeen, run.driftCmd = max(run.driftSeen, seen), max(run.driftCmd, took)
	}
	run.flushCmd, run.flushSeen = flushUnderChurn(tb, ctx, ns, s, cs, tool)
	if p, err := localcluster.ReadProcStat(col.Process.Pid); err == nil {
		run.peakRSS = p.PeakRSS
	}
	run.collectorShare = 100 * run.collectorCPU.Seconds() / cs.window.Seconds()
	run.writerPct = 100 * run.writerCPU.Seconds() / cs.window.Seconds()
	tb.Logf("under %d syncs in %s (writer %.1f%% of a core): collector %.2f%% of a core, peak RSS %.1f MB, %d reports (%d with read errors, longest gap %s), last read %+v; drifts seen %v after the tool returned (its run up to %s), flush %s after (its run %s)",
		run.syncs, cs.window, run.writerPct, run.collectorShare, float64(run.peakRSS)/(1<<20), run.reports, run.readErrors, run.maxGap.Round(time.Millisecond),
		run.lastRead, run.driftSeens, run.driftCmd.Round(time.Millisecond), run.flushSeen.Round(time.Millisecond), run.flushCmd.Round(time.Millisecond))
	return run
}

// loadChurn loads cs.spec's rules into a new scratch namespace and says
// which tool writes them and which mode the collector reads.
func loadChurn(tb testing.TB, ctx context.Context, cs churnSpec) (ns *localcluster.Scratch, tool, mode string) {
	tb.Helper()
	var dump bytes.Buffer
	write := cs.spec.WriteIPTablesSave
	if cs.nftables {
		write = cs.spec.WriteNFTJSON
	}
	if err := write(&dump); err != nil {
		tb.Fatal(err)
	}
	ns, err := localcluster.NewScratch(ctx, "churn")
	if err != nil {
		tb.Fatal(err)
	}
	load := time.Now()
	if cs.nftables {
		if err := localcluster.LoadNFT(ctx, ns.NetNS, dump.Bytes()); err != nil {
			ns.Close()
			tb.Fatal(err)
		}
	} else if err := ns.RestoreIPTables(ctx, dump.Bytes(), cs.legacy); err != nil {
		ns.Close()
		tb.Fatal(err)
	}
	tb.Logf("%d services × %d endpoints loaded in %s", cs.spec.Services, cs.spec.EndpointsPerService, time.Since(load).Round(time.Millisecond))
	tool, mode = "iptables", "iptables"
	switch {
	case cs.legacy:
		tool, mode = "iptables-legacy", "iptables-legacy"
	case cs.nftables:
		tool, mode = "nft", "nftables"
	}
	if out, err := ns.Exec(ctx, "ip", "link", "set", "lo", "up"); err != nil {
		ns.Close()
		tb.Fatalf("%v: %s", err, out)
	}
	return ns, tool, mode
}

// saveUnderChurn runs the text tool once under the churn: does it finish
// at all?
func saveUnderChurn(tb testing.TB, ctx context.Context, ns *localcluster.Scratch, cs churnSpec, tool string) (time.Duration, bool) {
	saveFor := cmp.Or(cs.saveFor, 20*time.Second)
	limit := strconv.Itoa(int(saveFor.Seconds()))
	save := ns.Command(ctx, "timeout", limit, tool+"-save", "-t", "nat")
	if cs.nftables {
		save = ns.Command(ctx, "timeout", limit, "nft", "-j", "list", "table", "ip", "kube-proxy")
	}
	t0 := time.Now()
	out, err := save.Output()
	took := time.Since(t0)
	finished := err == nil && (bytes.Contains(out, []byte("COMMIT")) || bytes.Contains(out, []byte(`"nftables"`)))
	tb.Logf("%s under the churn: finished %v after %s (%d bytes)", strings.Join(save.Args[4:], " "), finished, took.Round(time.Millisecond), len(out))
	return took, finished
}

// startChurnCollector starts the collector binary in ns, streaming to ln;
// stop kills it (its log shown if the test failed).
func startChurnCollector(tb testing.TB, ctx context.Context, ns *localcluster.Scratch, ln net.Listener, mode, metrics string) (col *exec.Cmd, started time.Time, stop func()) {
	bin := collectorBinary(tb)
	if b := os.Getenv("PROXYAUDIT_BENCH_COLLECTOR"); b != "" {
		bin = b // another build, measured under the same churn
	}
	cargs := []string{bin, "--node-name", "churn", "--aggregator", ln.Addr().String(), "--mode", mode,
		"--kube-proxy-metrics", metrics, "--interval", "10s", "--conntrack-interval", "0"}
	cargs = append(cargs, strings.Fields(os.Getenv("PROXYAUDIT_BENCH_COLLECTOR_ARGS"))...)
	col = ns.Command(ctx, cargs...)
	var stderr bytes.Buffer
	col.Stderr = &stderr
	col.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	started = time.Now()
	if err := col.Start(); err != nil {
		tb.Fatal(err)
	}
	return col, started, func() {
		col.Process.Kill()
		col.Wait()
		if tb.Failed() {
			tb.Logf("collector log:\n%s", stderr.String())
		}
	}
}

// measureChurn measures the collector's CPU and its reports over the
// window, from its first report at first.
func measureChurn(tb testing.TB, run *churnRun, cs churnSpec, col *exec.Cmd, s *stub, w *localcluster.Churn, first time.Time) {
	base, err := localcluster.ReadProcStat(col.Process.Pid)
	if err != nil {
		tb.Fatal(err)
	}
	w0, s0 := w.Done()
	from := s.count()
	time.Sleep(cs.window)
	end, err := localcluster.ReadProcStat(col.Process.Pid)
	if err != nil {
		tb.Fatal(err)
	}
	w1, s1 := w.Done()
	run.writerCPU, run.syncs = w1-w0, s1-s0
	run.window = cs.window
	run.collectorCPU = (end.CPU + end.ChildCPU) - (base.CPU + base.ChildCPU)
	s.mu.Lock()
	reports := slices.Clone(s.reports[from:])
	s.mu.Unlock()
	run.reports = len(reports)
	last := first
	for _, r := range reports {
		if r.r.ReadError != "" {
			run.readErrors++
		}
		run.maxGap = max(run.maxGap, r.at.Sub(last))
		last = r.at
		if r.r.Reads != nil {
			run.lastRead = r.r.Reads
		}
	}
}

// flushUnderChurn flushes the nat table and returns the tool's run and
// how long after it a report showed the flush.
func flushUnderChurn(tb testing.TB, ctx context.Context, ns *localcluster.Scratch, s *stub, cs churnSpec, tool string) (took, seen time.Duration) {
	from := s.count()
	t2 := time.Now()
	defer func() {
		if !tb.Failed() {
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, r := range s.reports[from:] {
			empty := 0
			for _, f := range r.r.Frontends {
				if len(f.Endpoints) == 0 {
					empty++
				}
			}
			tb.Logf("report after the flush: %d frontends (%d without endpoints), %d removed, no rules %v, read error %q", len(r.r.Frontends), empty, len(r.r.Removed), r.r.NoRules, r.r.ReadError)
		}
	}()
	flush := []string{tool, "-t", "nat", "-F"}
	if cs.nftables {
		flush = []string{"nft", "flush", "table", "ip", "kube-proxy"}
	}
	if out, err := ns.Exec(ctx, flush...); err != nil {
		tb.Fatalf("flush: %v: %s", err, out)
	}
	took, t2 = time.Since(t2), time.Now()
	// Reported: no rules, or (when the writer's next sync already wrote
	// KUBE-SERVICES again) nearly every frontend gone or without
	// endpoints.
	got, _ := s.wait(tb, from, 30*time.Second, "of the flushed table", func(r received) bool {
		empty := 0
		for _, f := range r.r.Frontends {
			if len(f.Endpoints) == 0 {
				empty++
			}
		}
		return r.r.NoRules || len(r.r.Removed)+empty >= cs.spec.Services/2
	})
	return took, max(0, got.at.Sub(t2))
}

// driftOne makes one drift by hand on service drift and returns how long
// after the tool returned a report showed it (0: before it returned), and
// the tool's own run.
func driftOne(tb testing.TB, ctx context.Context, ns *localcluster.Scratch, s *stub, cs churnSpec, tool string, drift int) (seen, took time.Duration) {
	tb.Helper()
	key := fmt.Sprintf("%s:80/TCP", synth.VIP(drift))
	target := "198.18.250.9:8080"
	old := netip.AddrPortFrom(cs.spec.EndpointAddr(drift, 0), 8080).String()
	from := s.count()
	t1 := time.Now()
	drifted := func(f stream.Frontend) bool { return slices.Contains(f.Endpoints, target) }
	args := []string{tool, "-t", "nat", "-R", cs.spec.SEPChain(drift, 0), "2", "-p", "tcp", "-m", "tcp", "-j", "DNAT", "--to-destination", target}
	var stdin []byte
	switch {
	case cs.legacy:
		drifted = func(f stream.Frontend) bool { return !slices.Contains(f.Endpoints, old) }
		args = []string{tool, "-t", "nat", "-D", cs.spec.SEPChain(drift, 0), "2"}
	case cs.nftables:
		var in bytes.Buffer
		if err := cs.spec.WriteNFTPartialSync(&in, []int{drift}, netip.MustParseAddrPort(target)); err != nil {
			tb.Fatal(err)
		}
		args, stdin = []string{"nft", "-f", "-"}, in.Bytes()
	}
	dcmd := ns.Command(ctx, args...)
	dcmd.Stdin = bytes.NewReader(stdin)
	if out, err := dcmd.CombinedOutput(); err != nil {
		tb.Fatalf("drift: %v: %s", err, out)
	}
	// Timed from when the change is in the kernel: the tool's own run
	// (at the anchors, seconds for a flush) is not the collector's.
	took, t1 = time.Since(t1), time.Now()
	got, _ := s.wait(tb, from, 30*time.Second, "with the drifted endpoint", func(r received) bool {
		for _, f := range r.r.Frontends {
			if f.Key == key && drifted(f) {
				return true
			}
		}
		return false
	})
	return max(0, got.at.Sub(t1)), took
}

// listenIn listens on a loopback port inside ns.
func listenIn(tb testing.TB, ns *localcluster.Scratch) net.Listener {
	tb.Helper()
	var ln net.Listener
	if err := localcluster.InNetNS(ns.NetNS, func() error {
		var err error
		ln, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	return ln
}

// startMetricsStub serves kube-proxy's sync gauges in ns, the last sync
// at *lastSync (Unix milliseconds), and returns their URL.
func startMetricsStub(tb testing.TB, ns *localcluster.Scratch, lastSync *atomic.Int64) string {
	tb.Helper()
	ln := listenIn(tb, ns)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		at := float64(lastSync.Load()) / 1000
		fmt.Fprintf(w, "kubeproxy_sync_proxy_rules_last_timestamp_seconds %.3f\nkubeproxy_sync_proxy_rules_last_queued_timestamp_seconds %.3f\n", at, at)
	})}
	go srv.Serve(ln)
	tb.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String() + "/metrics"
}

// startStubOn serves the stub aggregator on ln.
func startStubOn(tb testing.TB, ln net.Listener) *stub {
	s := &stub{ln: ln, changed: make(chan struct{}, 1)}
	tb.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.serve(c)
		}
	}()
	return s
}

// On a node whose rules a writer rewrites faster than iptables-save can
// dump them, the collector stays audited (every report read, none missing
// for long), reports a drift on a service the churn does not touch and a
// flushed table within seconds, in both iptables backends and in nftables
// mode.
func TestE2EChurnFasterThanTheDump(t *testing.T) {
	localcluster.NeedRoot(t, false)
	for _, mode := range []string{"nf_tables", "legacy", "nftables-mode"} {
		legacy := mode == "legacy"
		t.Run(mode, func(t *testing.T) {
			run := runChurn(t, churnSpec{spec: synth.Spec{Services: 2500, EndpointsPerService: 10}, legacy: legacy, nftables: mode == "nftables-mode",
				period: 200 * time.Millisecond, window: 12 * time.Second, saveFor: 8 * time.Second})
			if run.readErrors > 0 {
				t.Errorf("%d reports carried read errors: the aggregator would call the node CollectorMissing", run.readErrors)
			}
			if run.maxGap > 15*time.Second {
				t.Errorf("%s between two reports", run.maxGap)
			}
			if mode == "nf_tables" && run.saveFinished {
				t.Errorf("iptables-save finished under the churn (%s): the test is not where the text tool cannot read", run.saveTook)
			}
			if run.driftSeen > 5*time.Second || run.flushSeen > 5*time.Second {
				t.Errorf("drift reported after %s, flush after %s", run.driftSeen, run.flushSeen)
			}
			if run.syncs < 12 {
				t.Errorf("the writer made only %d syncs in %s", run.syncs, run.window)
			}
		})
	}
}

// BenchmarkIPTablesUnderChurn runs the collector binary at the anchors
// (PROXYAUDIT_BENCH_COLLECTOR: another build of it, measured the same way)
// (10k services × 10 endpoints; PROXYAUDIT_BENCH_SMALL=1: 1k) under one
// sync a second for PROXYAUDIT_BENCH_WINDOW (default 60s): the churn of
// ../shared/TESTBED.md (ten services' chains rewritten with their same
// content) and kube-proxy's (the same plus its KUBE-SERVICES rewrite), on
// both backends. It reports the collector's CPU beside the writer's, its
// peak RSS, and how fast a drift by hand and a flushed table reached the
// stub aggregator.
func BenchmarkIPTablesUnderChurn(b *testing.B) {
	if err := localcluster.CanRun(); err != nil {
		b.Skipf("needs root, iptables and nft: %v", err)
	}
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		spec = synth.Spec{Services: 1000, EndpointsPerService: 10}
	}
	window := 60 * time.Second
	if w, err := time.ParseDuration(os.Getenv("PROXYAUDIT_BENCH_WINDOW")); err == nil {
		window = w
	}
	for _, backend := range []struct {
		name             string
		legacy, nftables bool
	}{{"nf_tables", false, false}, {"legacy", true, false}, {"nftables-mode", false, true}} {
		for _, shape := range []struct {
			name     string
			period   time.Duration
			dispatch bool
			drifts   int
		}{{"ten-services", time.Second, false, 1}, {"kube-proxy", time.Second, true, 1}, {"quiet", 0, false, 20}} {
			if backend.nftables && shape.dispatch {
				continue // nftables mode keeps its frontends in a map kube-proxy updates by element
			}
			b.Run(backend.name+"/"+shape.name, func(b *testing.B) {
				var run churnRun
				cs := churnSpec{spec: spec, legacy: backend.legacy, nftables: backend.nftables, period: shape.period, dispatch: shape.dispatch, window: window,
					drifts: shape.drifts, driftEvery: 2 * time.Second}
				if shape.period == 0 {
					cs.window = min(window, 20*time.Second)
					if backend.legacy {
						// A legacy read costs 0.4-0.8 s of CPU at the
						// anchors: the read budget spaces reads that far
						// apart (see --read-budget).
						cs.driftEvery = 20 * time.Second
					}
				}
				for b.Loop() {
					run = runChurn(b, cs)
				}
				sorted := slices.Sorted(slices.Values(run.driftSeens))
				b.ReportMetric(sorted[len(sorted)/2].Seconds(), "drift-p50-s")
				b.ReportMetric(run.collectorShare, "collector-%core")
				b.ReportMetric(run.writerPct, "writer-%core")
				b.ReportMetric(float64(run.peakRSS)/(1<<20), "peak-RSS-MB")
				b.ReportMetric(run.driftSeen.Seconds(), "drift-max-s")
				b.ReportMetric(run.flushSeen.Seconds(), "flush-s")
				b.ReportMetric(run.flushCmd.Seconds(), "flush-tool-s")
				b.ReportMetric(float64(run.readErrors), "read-errors")
				b.ReportMetric(run.maxGap.Seconds(), "max-report-gap-s")
				saved := 0.0
				if run.saveFinished {
					saved = 1
				}
				b.ReportMetric(saved, "iptables-save-finished")
			})
		}
	}
}
