// Package flush proves, on real kernels and against the real aggregator,
// that a flushed node is reported at once whatever the collector's read
// budget holds: the seed incident (`iptables -t nat -F`) on every backend
// (iptables-nft, iptables-legacy, nftables, IPVS in the VM), right after
// the table was rewritten whole and under kube-proxy's partial syncs.
package flush_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/fleetsim"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

func TestMain(m *testing.M) { localcluster.Main(m) }

var (
	flushServices = flag.Int("flush-services", 2500, "services (10 endpoints each) the nodes hold")
	flushBound    = flag.Duration("flush-bound", time.Second, "the most a flush may take to reach the aggregator after the command ended")
	flushBinaries = flag.String("flush-binaries", "", "a directory holding another build's proxyaudit-collector and proxyaudit-aggregator, run instead of this tree's (an older build, compared)")
	flushGroups   = flag.String("flush-groups", "namespaces,vm", "BenchmarkFlushToReport: which nodes to measure, the namespace nodes (iptables-nft, legacy, nftables) and/or the IPVS VM")
)

// The collector runs as the chart runs it but for a read budget of 1 % of
// a core (its burst is then 0.6 s of CPU): at 2,500 services one whole
// read spends most of it, so the budget is in debt where the test
// flushes, as 5 % is at 10k services. A flush must not wait for it.
var collectorArgs = []string{"--interval", "10s", "--read-budget", "0.01", "--kube-proxy-metrics", "", "--conntrack-interval", "0"}

const grace = 2 * time.Second

// backend is one kind of node under test.
type backend struct {
	name string
	mode string // the collector's --mode
	// flushes are the commands that flush the node's rules; drift
	// removes one endpoint from a service no churn touches.
	flushes map[string][]string
	drift   func(ctx context.Context) (string, error)
	// restore makes the node's rules whole again; rewrite writes them
	// whole again in one go, as kube-proxy's full sync does (a table
	// restore; IPVS: every real server edited to what it is).
	restore, rewrite func(ctx context.Context, t testing.TB)
	// run runs argv on the node; start starts the collector.
	run   func(ctx context.Context, argv ...string) (string, error)
	start func(ctx context.Context, t testing.TB)
	// churn starts kube-proxy's partial syncs on the node; its stop ends
	// them.
	churn func(ctx context.Context, t testing.TB) (stop func())
}

// rig is the cluster holding the synthetic services, the proxyaudit
// binaries and the aggregator every node reports to.
type rig struct {
	c    *localcluster.Cluster
	spec synth.Spec
	// collector are the collector's flags beside its node and aggregator.
	collector []string
	bin       string
	port      string // the aggregator's stream port, on every host address
	http      string
	agg       *localcluster.Process
}

var nodeNames = []string{"flush-ipt", "flush-legacy", "flush-nft", "flush-ipvs"}

func newRig(ctx context.Context, t testing.TB, services int, collector []string) *rig {
	c := localcluster.Shared(t)
	r := &rig{c: c, spec: synth.Spec{Services: services, EndpointsPerService: 10}, collector: collector}
	cfg := *c.RESTConfig
	cfg.QPS, cfg.Burst = 500, 1000
	start := time.Now()
	client, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fleetsim.Populate(ctx, client, r.spec, len(nodeNames), func(i int) string { return nodeNames[i] }, 16); err != nil {
		t.Fatalf("populate: %v", err)
	}
	t.Logf("%d services × %d endpoints in the API server (%s)", r.spec.Services, r.spec.EndpointsPerService, time.Since(start).Round(time.Second))
	// The synthetic rules hold the synthetic services only: default/
	// kubernetes is marked as another proxy's, which no node programs.
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:"not-in-the-synthetic-rules"}}}`, audit.LabelServiceProxyName)
	if _, err := client.CoreV1().Services("default").Patch(ctx, "kubernetes", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	r.bin = *flushBinaries
	if r.bin == "" {
		r.bin = localcluster.BuildForTest(t)
	}
	ln, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	_, r.port, _ = net.SplitHostPort(ln.Addr().String())
	ln.Close()
	r.http = freeAddr(t)
	r.agg, err = c.StartProcess("flush-aggregator", filepath.Join(r.bin, "proxyaudit-aggregator"),
		"--kubeconfig="+c.AdminKubeconfig, "--insecure-no-auth", "--leader-elect=false", "--grace="+grace.String(),
		"--stream-listen=0.0.0.0:"+r.port, "--http-listen="+r.http, "--advertise-address=127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("aggregator log:\n%s", r.agg.Tail(40))
		}
		r.agg.Stop()
	})
	return r
}

// namespaceNode adds a node of the cluster without kube-proxy, loads the
// synthetic rules and runs the collector there.
func (r *rig) namespaceNode(ctx context.Context, t testing.TB, name, mode string) *backend {
	n, err := r.c.AddNode(ctx, localcluster.NodeSpec{Name: name, Mode: localcluster.ModeIPTables, NoProxy: true})
	if err != nil {
		t.Fatal(err)
	}
	var dump bytes.Buffer
	write := r.spec.WriteIPTablesSave
	if mode == "nftables" {
		write = r.spec.WriteNFTJSON
	}
	if err := write(&dump); err != nil {
		t.Fatal(err)
	}
	b := &backend{name: name, mode: mode}
	b.run = n.Exec
	b.restore = func(ctx context.Context, t testing.TB) {
		err := localcluster.RestoreIPTablesIn(ctx, n.NetNS, dump.Bytes(), mode == "iptables-legacy")
		if mode == "nftables" {
			err = localcluster.LoadNFT(ctx, n.NetNS, dump.Bytes())
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	b.rewrite = b.restore
	b.start = func(ctx context.Context, t testing.TB) {
		p, err := n.StartProcess("collector-"+name, append([]string{filepath.Join(r.bin, "proxyaudit-collector"), "--node-name", name,
			"--aggregator", net.JoinHostPort(n.HostIP, r.port), "--mode", mode}, r.collector...)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("%s collector log:\n%s", name, p.Tail(30))
			}
			p.Stop()
		})
	}
	b.churn = func(ctx context.Context, t testing.TB) func() {
		w := localcluster.StartChurn(ctx, n.NetNS, localcluster.ChurnConfig{Spec: r.spec, Mode: mode, Period: time.Second, Dispatch: mode != "nftables"})
		return func() {
			if err := w.Stop(); err != nil {
				t.Error(err)
			}
		}
	}
	tool := map[string]string{"iptables": "iptables", "iptables-legacy": "iptables-legacy"}[mode]
	last := r.spec.Services - 1
	if mode == "nftables" {
		b.flushes = map[string][]string{"table": {"nft", "flush", "table", "ip", "kube-proxy"}}
		b.drift = func(ctx context.Context) (string, error) {
			var in bytes.Buffer
			if err := r.spec.WriteNFTPartialSync(&in, []int{last}, netip.MustParseAddrPort("198.18.250.9:8080")); err != nil {
				return "", err
			}
			cmd := exec.CommandContext(ctx, "ip", "netns", "exec", n.NetNS, "nft", "-f", "-")
			cmd.Stdin = &in
			out, err := cmd.CombinedOutput()
			return string(out), err
		}
	} else {
		b.flushes = map[string][]string{"table": {tool, "-t", "nat", "-F"}, "KUBE-SERVICES": {tool, "-t", "nat", "-F", "KUBE-SERVICES"}}
		b.drift = func(ctx context.Context) (string, error) {
			return n.Exec(ctx, tool, "-t", "nat", "-D", r.spec.SEPChain(last, 0), "2")
		}
	}
	return b
}

// vmNode adds the IPVS VM as a node without kube-proxy, fills its IPVS
// table and runs the collector there.
func (r *rig) vmNode(ctx context.Context, t testing.TB, name string) *backend {
	v, err := r.c.AddVMNode(ctx, localcluster.NodeSpec{Name: name, NoProxy: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(v.Stop)
	write := func(file string, services []int, edit bool) string {
		var in bytes.Buffer
		if err := r.spec.WriteIPVSRestore(&in, services, edit); err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(v.Dir, file)
		if err := os.WriteFile(path, in.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	whole, rewrite := write("ipvs-whole", nil, false), write("ipvs-rewrite", nil, true)
	b := &backend{name: name, mode: "ipvs", flushes: map[string][]string{"table": {"ipvsadm", "-C"}}}
	b.run = func(ctx context.Context, argv ...string) (string, error) { return v.Run(ctx, strings.Join(argv, " ")) }
	last := r.spec.Services - 1
	b.drift = func(ctx context.Context) (string, error) {
		return v.Run(ctx, fmt.Sprintf("ipvsadm -d -t %s -r %s", netip.AddrPortFrom(synth.VIP(last), 80), netip.AddrPortFrom(r.spec.EndpointAddr(last, 0), 8080)))
	}
	b.restore = func(ctx context.Context, t testing.TB) {
		if _, err := v.RunFor(ctx, 5*time.Minute, "ipvsadm -C && ipvsadm -R < "+whole); err != nil {
			t.Fatal(err)
		}
	}
	b.rewrite = func(ctx context.Context, t testing.TB) {
		if _, err := v.RunFor(ctx, 5*time.Minute, "ipvsadm -R < "+rewrite); err != nil {
			t.Fatal(err)
		}
	}
	b.start = func(ctx context.Context, t testing.TB) {
		if err := v.Start(ctx, "collector", append([]string{filepath.Join(r.bin, "proxyaudit-collector"), "--node-name", name,
			"--aggregator", net.JoinHostPort(localcluster.VMHostIP, r.port), "--mode", "ipvs"}, r.collector...)...); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("%s collector log:\n%s", name, v.Log("collector", 30))
			}
			v.StopProcess(context.Background(), "collector")
		})
	}
	b.churn = func(ctx context.Context, t testing.TB) func() {
		// Ten services' real servers rewritten a second, as IPVS-mode
		// kube-proxy's syncs touch them.
		var files []string
		for k := range 10 {
			var svcs []int
			for j := range 10 {
				svcs = append(svcs, (k*10+j)%(r.spec.Services/2))
			}
			files = append(files, write(fmt.Sprintf("ipvs-churn-%d", k), svcs, true))
		}
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for k := 0; cctx.Err() == nil; k++ {
				// Once the table is cleared the edits have nothing to
				// edit (kube-proxy would add the services back).
				if _, err := v.Run(cctx, "ipvsadm -R < "+files[k%len(files)]+` || [ -z "$(ipvsadm -Sn)" ]`); err != nil && cctx.Err() == nil {
					t.Error(err)
					return
				}
				select {
				case <-cctx.Done():
				case <-time.After(time.Second):
				}
			}
		}()
		return func() { cancel(); <-done }
	}
	return b
}

// TestE2EFlushSeenAtOnce: on each backend, a flush right after the node's
// table was rewritten whole, and a flush under kube-proxy's partial syncs
// once a second, are each seen by the real aggregator within the bound
// of the command's end (the finding's since), while the read budget is in
// debt; so is a flush of KUBE-SERVICES alone.
func TestE2EFlushSeenAtOnce(t *testing.T) {
	localcluster.NeedRoot(t, true)
	// The cases run in parallel subtests, after this function returns.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	t.Cleanup(cancel)
	r := newRig(ctx, t, *flushServices, collectorArgs)
	var mu sync.Mutex
	var results []string
	// Each node drifts alone among the four reporting (never more than
	// half of the fleet: no MassDivergence in its place). The VM boots
	// and fills its table (a minute under emulation) beside the
	// namespace nodes' cases.
	for _, group := range []string{"namespaces", "vm"} {
		t.Run(group, func(t *testing.T) {
			t.Parallel()
			r.cases(ctx, t, group, false, func(t testing.TB, name string, took, seen time.Duration) {
				mu.Lock()
				results = append(results, fmt.Sprintf("%s: the command took %s, seen %s after it ended", name, took.Round(time.Millisecond), seen.Round(time.Millisecond)))
				mu.Unlock()
				if seen > *flushBound {
					t.Errorf("the flush reached the aggregator %s after the command ended (bound %s)", seen.Round(time.Millisecond), *flushBound)
				}
			})
		})
	}
	t.Cleanup(func() { t.Logf("at %d services:\n%s", r.spec.Services, strings.Join(results, "\n")) })
}

// BenchmarkFlushToReport measures, at the anchors (10k services × 10
// endpoints; PROXYAUDIT_BENCH_SMALL=1: 2,500) and with the collector's
// defaults but for a 30 s interval, how long after the command ended the
// real aggregator dates a flush and one endpoint's rule deleted by hand,
// on each backend, right after a whole rewrite and under kube-proxy's
// partial syncs (make bench-flush).
func BenchmarkFlushToReport(b *testing.B) {
	if err := localcluster.CanRunVM(); err != nil {
		b.Skip(err)
	}
	services := 10000
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		services = 2500
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()
	r := newRig(ctx, b, services, []string{"--interval", "30s", "--kube-proxy-metrics", "", "--conntrack-interval", "0"})
	for b.Loop() {
		for _, group := range strings.Split(*flushGroups, ",") {
			r.cases(ctx, b, group, true, func(_ testing.TB, name string, took, seen time.Duration) {
				b.Logf("%s: the command took %s, seen %s after it ended", name, took.Round(time.Millisecond), seen.Round(time.Millisecond))
				b.ReportMetric(seen.Seconds(), strings.NewReplacer("flush-", "", "/", "-").Replace(name)+"-s")
			})
		}
	}
}

// cases adds the group's nodes (the namespace nodes, or the IPVS VM),
// brings them in sync, and runs each flush case on each (and with drift
// one endpoint's rule deleted by hand, in each state), reporting each.
func (r *rig) cases(ctx context.Context, t testing.TB, group string, drift bool, report func(t testing.TB, name string, took, seen time.Duration)) {
	var backends []*backend
	if group == "vm" {
		backends = append(backends, r.vmNode(ctx, t, "flush-ipvs"))
	} else {
		backends = append(backends, r.namespaceNode(ctx, t, "flush-ipt", "iptables"), r.namespaceNode(ctx, t, "flush-legacy", "iptables-legacy"),
			r.namespaceNode(ctx, t, "flush-nft", "nftables"))
	}
	for _, b := range backends {
		b.restore(ctx, t)
		b.start(ctx, t)
	}
	for _, b := range backends {
		r.waitInSync(ctx, t, b.name, 30*time.Minute)
	}
	for bi, b := range backends {
		type one struct {
			state, what string
			argv        []string
		}
		var cs []one
		for _, state := range []string{"churn", "rewritten"} {
			if drift {
				cs = append(cs, one{state, "endpoint", nil})
			}
			for _, what := range slices.Sorted(maps.Keys(b.flushes)) {
				if state == "rewritten" || what == "table" {
					cs = append(cs, one{state, what, b.flushes[what]})
				}
			}
		}
		for ci, c := range cs {
			// The last case leaves its node flushed.
			last := bi == len(backends)-1 && ci == len(cs)-1
			name := b.name + "/" + c.state + "/" + c.what
			run(t, name, func(t testing.TB) {
				took, seen := r.flushCase(ctx, t, b, c.state, c.argv, last)
				report(t, name, took, seen)
			})
		}
	}
}

// run runs f as a subtest of a test, and in place in a benchmark (whose
// b.Run would run it b.N times).
func run(t testing.TB, name string, f func(testing.TB)) {
	if tt, ok := t.(*testing.T); ok {
		tt.Run(name, func(t *testing.T) { f(t) })
		return
	}
	f(t)
}

// flushCase puts node b in state, then flushes it with argv (deletes one
// endpoint's rule, when argv is nil) and returns the command's run and
// how long after it ended the aggregator dated the drift (the earliest
// since of the findings it caused); the node is put back in sync after
// unless it is the last.
func (r *rig) flushCase(ctx context.Context, t testing.TB, b *backend, state string, argv []string, last bool) (took, seen time.Duration) {
	stopChurn := func() {}
	switch state {
	case "rewritten":
		// The whole table written again and read: the read budget pays
		// for a whole read right before the flush.
		before := r.reads(t, b.name)
		b.rewrite(ctx, t)
		r.waitFor(ctx, t, b.name, 10*time.Minute, "the rewrite read", func(st api.NodeResponse) bool { return readCount(st) > before })
	case "churn":
		var once sync.Once
		churning := b.churn(ctx, t)
		stopChurn = func() { once.Do(churning) }
		defer stopChurn()
		// A few syncs, and reads of them.
		time.Sleep(5 * time.Second)
	}
	what := "delete one endpoint's rule"
	if argv != nil {
		what = strings.Join(argv, " ")
	}
	start := time.Now()
	var out string
	var err error
	if argv == nil {
		out, err = b.drift(ctx)
	} else {
		out, err = b.run(ctx, argv...)
	}
	if err != nil {
		t.Fatalf("%s: %v: %s", what, err, out)
	}
	end := time.Now()
	st := r.waitFor(ctx, t, b.name, 2*time.Minute, "findings of the change", func(st api.NodeResponse) bool { return len(flushFindings(st, start)) > 0 })
	since := flushFindings(st, start)[0].Since
	t.Logf("%s: %s took %s; earliest finding %s since %s after it ended (reads %v)", b.name, what,
		end.Sub(start).Round(time.Millisecond), flushFindings(st, start)[0].Kind, since.Sub(end).Round(time.Millisecond), st.Collector.Reads)
	// The churn ends before the node is put back: in the IPVS VM (software
	// emulation) a 10k-service read under the churn outlasted the
	// interval, and the node never came back in sync.
	stopChurn()
	if t.Failed() || last {
		return end.Sub(start), since.Sub(end)
	}
	b.restore(ctx, t)
	r.waitInSync(ctx, t, b.name, 10*time.Minute)
	return end.Sub(start), since.Sub(end)
}

// flushFindings are node st's rule findings that began after start,
// earliest first.
func flushFindings(st api.NodeResponse, start time.Time) []audit.TimedFinding {
	var out []audit.TimedFinding
	for _, f := range st.Findings {
		switch f.Kind {
		case audit.NoRules, audit.MissingService, audit.MissingEndpoint, audit.StaleEndpoint:
			if !f.Since.Before(start) {
				out = append(out, f)
			}
		}
	}
	slices.SortFunc(out, func(a, b audit.TimedFinding) int { return a.Since.Compare(b.Since) })
	return out
}

func (r *rig) reads(t testing.TB, node string) uint64 {
	st, err := r.node(node)
	if err != nil {
		t.Fatal(err)
	}
	return readCount(st)
}

func readCount(st api.NodeResponse) uint64 {
	var n uint64
	if st.Collector != nil {
		for _, v := range st.Collector.Reads {
			n += v
		}
	}
	return n
}

func (r *rig) waitInSync(ctx context.Context, t testing.TB, node string, d time.Duration) {
	t.Helper()
	r.waitFor(ctx, t, node, d, "in sync", func(st api.NodeResponse) bool { return st.State == audit.NodeInSync && len(st.Findings) == 0 })
}

// waitFor polls the aggregator for node until cond holds.
func (r *rig) waitFor(ctx context.Context, t testing.TB, node string, d time.Duration, what string, cond func(api.NodeResponse) bool) api.NodeResponse {
	t.Helper()
	var st api.NodeResponse
	var err error
	testkit.Await(t, d, node+" "+what, func() bool {
		st, err = r.node(node)
		return ctx.Err() == nil && err == nil && cond(st)
	}, func() string {
		return fmt.Sprintf("state %s, %d findings, reads %v, error %v, context %v", st.State, len(st.Findings), st.Collector, err, ctx.Err())
	})
	return st
}

func (r *rig) node(name string) (api.NodeResponse, error) {
	var nr api.NodeResponse
	resp, err := http.Get("http://" + r.http + "/api/v1/nodes/" + name)
	if err != nil {
		return nr, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return nr, fmt.Errorf("%s: %s", resp.Status, b)
	}
	err = json.NewDecoder(resp.Body).Decode(&nr)
	return nr, err
}

func freeAddr(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
