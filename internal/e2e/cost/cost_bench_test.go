package cost

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/fleetsim"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

func TestMain(m *testing.M) { localcluster.Main(m) }

// env reads a duration from the environment, or def.
func env(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil {
		return d
	}
	return def
}

// anchors is the cluster of the Kubernetes scalability thresholds: 10k
// services of 10 endpoints (PROXYAUDIT_BENCH_SMALL=1: 1k).
func anchors() synth.Spec {
	if os.Getenv("PROXYAUDIT_BENCH_SMALL") != "" {
		return synth.Spec{Services: 1000, EndpointsPerService: 10}
	}
	return synth.Spec{Services: 10000, EndpointsPerService: 10}
}

// rig is the shared cluster holding the anchors, the proxyaudit binaries
// and a real aggregator.
type rig struct {
	c      *localcluster.Cluster
	client kubernetes.Interface
	spec   synth.Spec
	slices []*discoveryv1.EndpointSlice
	bin    string
	agg    *localcluster.Process
	stream string // the aggregator's stream address, on the host end of the nodes' links
	http   string
}

// nodeNames are the nodes the benchmarks add, with genuine kube-proxies.
var nodeNames = []string{"cost-ipt", "cost-nft", "cost-ipt2"}

// theRig is built once per run: the benchmarks share the cluster, its
// anchors and its nodes (populating twice would find the nodes there).
var theRig struct {
	sync.Mutex
	r *rig
}

func newRig(b *testing.B) *rig {
	b.Helper()
	theRig.Lock()
	defer theRig.Unlock()
	if theRig.r != nil {
		return theRig.r
	}
	c := localcluster.Shared(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cfg := *c.RESTConfig
	cfg.QPS, cfg.Burst = 2000, 4000
	client, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		b.Fatal(err)
	}
	r := &rig{c: c, client: client, spec: anchors()}
	// Endpoints spread over the benchmark's own nodes, which register
	// themselves below with a genuine kube-proxy each.
	start := time.Now()
	if r.slices, err = fleetsim.Populate(ctx, client, r.spec, len(nodeNames), func(i int) string { return nodeNames[i] }, 32); err != nil {
		b.Fatalf("populate: %v", err)
	}
	b.Logf("the anchors in the API server: %d services, %d endpoints (%s)", r.spec.Services, r.spec.Services*r.spec.EndpointsPerService,
		time.Since(start).Round(time.Second))
	if r.bin, err = os.MkdirTemp("", "proxyaudit-cost-"); err != nil {
		b.Fatal(err)
	}
	if err := localcluster.BuildProxyaudit(r.bin); err != nil {
		b.Fatal(err)
	}
	theRig.r = r
	return r
}

// node adds a node with a genuine kube-proxy and waits until it has
// programmed every service.
func (r *rig) node(b *testing.B, spec localcluster.NodeSpec) *localcluster.Node {
	b.Helper()
	if n := r.c.Node(spec.Name); n != nil {
		return n
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	start := time.Now()
	spec.ProxyReady = 15 * time.Minute // the first sync programs all of the anchors
	n, err := r.c.AddNode(ctx, spec)
	if err != nil {
		b.Fatal(err)
	}
	last := r.spec.Services - 1
	if err := n.WaitRules(ctx, 20*time.Minute, "every service programmed", func(rules string) bool {
		return strings.Contains(rules, synth.VIP(last).String())
	}); err != nil {
		b.Fatal(err)
	}
	b.Logf("%s: kube-proxy (%s) programmed %d services in %s", n.Name, spec.Mode, r.spec.Services, time.Since(start).Round(time.Second))
	return n
}

// aggregator starts the real aggregator once, listening on the host end of
// the first node's link (every node's namespace routes there).
func (r *rig) aggregator(b *testing.B, host string) {
	b.Helper()
	if r.agg != nil {
		return
	}
	r.stream, r.http = freeAddr(b, host), freeAddr(b, "127.0.0.1")
	agg, err := r.c.StartProcess("cost-aggregator", filepath.Join(r.bin, "proxyaudit-aggregator"),
		"--kubeconfig="+r.c.AdminKubeconfig, "--insecure-no-auth", "--leader-elect=false",
		"--stream-listen="+r.stream, "--http-listen="+r.http, "--advertise-address=127.0.0.1")
	if err != nil {
		b.Fatal(err)
	}
	r.agg = agg
}

// collector starts the real collector on n, streaming to the aggregator.
func (r *rig) collector(b *testing.B, n *localcluster.Node, args ...string) *localcluster.Process {
	b.Helper()
	// PROXYAUDIT_BENCH_PROFILE=DIR: a CPU profile of each collector run,
	// DIR/collector-NODE.pprof.
	if dir := os.Getenv("PROXYAUDIT_BENCH_PROFILE"); dir != "" {
		args = append(args, "--cpu-profile", filepath.Join(dir, "collector-"+n.Name+".pprof"))
	}
	p, err := n.StartProcess("cost-collector-"+n.Name, append([]string{filepath.Join(r.bin, "proxyaudit-collector"),
		"--node-name", n.Name, "--aggregator", r.stream}, args...)...)
	if err != nil {
		b.Fatal(err)
	}
	return p
}

// nodeStatus asks the aggregator for one node.
func (r *rig) nodeStatus(name string) (audit.NodeStatus, error) {
	resp, err := http.Get("http://" + r.http + "/api/v1/nodes/" + name)
	if err != nil {
		return audit.NodeStatus{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return audit.NodeStatus{}, fmt.Errorf("%s: %s", resp.Status, b)
	}
	var nr api.NodeResponse
	err = json.NewDecoder(resp.Body).Decode(&nr)
	return nr.NodeStatus, err
}

// waitRead waits until the aggregator has the node's first read.
func (r *rig) waitRead(b *testing.B, name string, d time.Duration) audit.NodeStatus {
	b.Helper()
	deadline := time.Now().Add(d)
	for {
		st, err := r.nodeStatus(name)
		if err == nil && st.Collector != nil && len(st.Collector.Reads) > 0 && st.Mode != "" {
			return st
		}
		if time.Now().After(deadline) {
			b.Fatalf("%s: no read reached the aggregator within %s (last: %+v, %v)\n%s", name, d, st, err, r.agg.Tail(20))
		}
		time.Sleep(time.Second)
	}
}

func reads(c *audit.CollectorCost) uint64 {
	var n uint64
	if c != nil {
		for _, v := range c.Reads {
			n += v
		}
	}
	return n
}

func freeAddr(b *testing.B, host string) string {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// cpuOf is the process's CPU with its children's (kube-proxy's
// iptables-restore and nft, the collector's iptables-save): what it costs
// the node.
func cpuOf(b *testing.B, pid int) time.Duration {
	ps, err := localcluster.ReadProcStat(pid)
	if err != nil {
		b.Fatal(err)
	}
	return ps.CPU + ps.ChildCPU
}

// BenchmarkQuietNodeCollector measures what the real collector costs on a
// node whose genuine kube-proxy holds the anchors (10k services, 100k
// endpoints) and nothing changes, streaming to the real aggregator, over
// PROXYAUDIT_BENCH_QUIET (10m), beside kube-proxy's own CPU in the same
// window: iptables (nf_tables backend) and nftables mode.
func BenchmarkQuietNodeCollector(b *testing.B) {
	r := newRig(b)
	window := env("PROXYAUDIT_BENCH_QUIET", 10*time.Minute)
	for _, spec := range []localcluster.NodeSpec{{Name: "cost-ipt", Mode: localcluster.ModeIPTables}, {Name: "cost-nft", Mode: localcluster.ModeNFTables}} {
		b.Run(string(spec.Mode), func(b *testing.B) {
			n := r.node(b, spec)
			r.aggregator(b, n.HostIP)
			for b.Loop() {
				p := r.collector(b, n)
				first := r.waitRead(b, n.Name, 5*time.Minute)
				// Settle: the first read and its snapshot are the start,
				// not the quiet state.
				time.Sleep(15 * time.Second)
				st0, _ := r.nodeStatus(n.Name)
				c0, k0 := cpuOf(b, p.PID()), cpuOf(b, n.ProxyPID())
				t0 := time.Now()
				time.Sleep(window)
				c1, k1 := cpuOf(b, p.PID()), cpuOf(b, n.ProxyPID())
				el := time.Since(t0)
				st1, err := r.nodeStatus(n.Name)
				if err != nil {
					b.Fatal(err)
				}
				ps, _ := localcluster.ReadProcStat(p.PID())
				p.Stop()
				b.ReportMetric(100*(c1-c0).Seconds()/el.Seconds(), "collector-cpu-%")
				b.ReportMetric(100*(k1-k0).Seconds()/el.Seconds(), "kube-proxy-cpu-%")
				b.ReportMetric(float64(ps.PeakRSS)/(1<<20), "collector-peak-rss-MB")
				b.ReportMetric(float64(reads(st1.Collector)-reads(st0.Collector)), "reads-in-window")
				b.ReportMetric(first.Collector.LastReadSeconds, "first-read-s")
				b.Logf("%s over %s: collector %.3f%% of a core (%s CPU), kube-proxy %.3f%%; reads %v → %v; first read %.2f s, %.1f MB",
					n.Name, el.Round(time.Second), 100*(c1-c0).Seconds()/el.Seconds(), (c1 - c0).Round(time.Millisecond),
					100*(k1-k0).Seconds()/el.Seconds(), st0.Collector.Reads, st1.Collector.Reads, first.Collector.LastReadSeconds,
					float64(first.Collector.LastReadBytes)/(1<<20))
			}
		})
	}
}

// kubeProxyMetrics scrapes a node's kube-proxy from inside its namespace.
// The socket is made on the thread that entered the namespace (a socket
// belongs to the namespace it was created in); an http.Client would dial
// from another goroutine, on a thread in the host's namespace.
func kubeProxyMetrics(n *localcluster.Node) (map[string]*dto.MetricFamily, error) {
	var conn net.Conn
	if err := localcluster.InNetNS(n.NetNS, func() error {
		var err error
		conn, err = net.DialTimeout("tcp", "127.0.0.1:10249", 10*time.Second)
		return err
	}); err != nil {
		return nil, err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.WriteString(conn, "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		return nil, err
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

// histogram is a Prometheus histogram's cumulative buckets and count.
type histogram struct {
	upper []float64
	cum   []float64
	count float64
}

func histogramOf(mf map[string]*dto.MetricFamily, name string) histogram {
	var h histogram
	f := mf[name]
	if f == nil {
		return h
	}
	for _, m := range f.GetMetric() {
		hh := m.GetHistogram()
		if hh == nil {
			continue
		}
		h.count += float64(hh.GetSampleCount())
		for i, bk := range hh.GetBucket() {
			if len(h.upper) <= i {
				h.upper = append(h.upper, bk.GetUpperBound())
				h.cum = append(h.cum, 0)
			}
			h.cum[i] += float64(bk.GetCumulativeCount())
		}
	}
	return h
}

// minus is the histogram of the observations between two scrapes.
func (h histogram) minus(o histogram) histogram {
	d := histogram{upper: h.upper, cum: make([]float64, len(h.cum)), count: h.count - o.count}
	for i := range h.cum {
		d.cum[i] = h.cum[i]
		if i < len(o.cum) {
			d.cum[i] -= o.cum[i]
		}
	}
	return d
}

// quantile interpolates within the bucket holding q, as PromQL's
// histogram_quantile does.
func (h histogram) quantile(q float64) float64 {
	if h.count <= 0 {
		return math.NaN()
	}
	rank := q * h.count
	lower, below := 0.0, 0.0
	for i, c := range h.cum {
		if c >= rank {
			if math.IsInf(h.upper[i], 1) {
				return lower
			}
			return lower + (h.upper[i]-lower)*(rank-below)/math.Max(c-below, 1e-9)
		}
		lower, below = h.upper[i], c
	}
	return lower
}

// phase is what one node's kube-proxy did in one phase.
type phase struct {
	sync, programming histogram
	proxyCPU          time.Duration
	collectorCPU      time.Duration
	collector         bool
}

// BenchmarkKubeProxyPerturbation runs two genuine kube-proxies (nftables
// mode; PROXYAUDIT_BENCH_MODE=iptables for the nf_tables backend of
// iptables, whose first restore of the anchors did not finish in 15
// minutes on the 2-core test machine) holding the anchors under 100 endpoint changes a
// second cluster-wide, with the real collector on one of them and then on
// the other (PROXYAUDIT_BENCH_PHASE each, default 5m), and compares each
// kube-proxy's sync duration and network programming latency (p50, p99,
// from its own histograms) with and without a collector beside it, and the
// collector's CPU with kube-proxy's on its node.
func BenchmarkKubeProxyPerturbation(b *testing.B) {
	r := newRig(b)
	phaseLen := env("PROXYAUDIT_BENCH_PHASE", 5*time.Minute)
	mode, name := localcluster.ModeNFTables, "cost-nft"
	if os.Getenv("PROXYAUDIT_BENCH_MODE") == "iptables" {
		mode, name = localcluster.ModeIPTables, "cost-ipt"
	}
	a := r.node(b, localcluster.NodeSpec{Name: name, Mode: mode})
	bb := r.node(b, localcluster.NodeSpec{Name: name + "2", Mode: mode})
	r.aggregator(b, a.HostIP)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	churn := &fleetsim.Churn{}
	go churn.Run(ctx, r.client, r.spec, r.slices, 100)
	time.Sleep(30 * time.Second) // both kube-proxies into the churn
	nodes := []*localcluster.Node{a, bb}
	var phases [2][2]phase // [phase][node]
	for b.Loop() {
		for ph := range 2 {
			with := nodes[ph]
			p := r.collector(b, with)
			r.waitRead(b, with.Name, 5*time.Minute)
			time.Sleep(15 * time.Second)
			var before [2]map[string]*dto.MetricFamily
			var cpu0 [2]time.Duration
			for i, n := range nodes {
				m, err := kubeProxyMetrics(n)
				if err != nil {
					b.Fatal(err)
				}
				before[i], cpu0[i] = m, cpuOf(b, n.ProxyPID())
			}
			col0 := cpuOf(b, p.PID())
			time.Sleep(phaseLen)
			for i, n := range nodes {
				m, err := kubeProxyMetrics(n)
				if err != nil {
					b.Fatal(err)
				}
				phases[ph][i] = phase{
					sync:        histogramOf(m, "kubeproxy_sync_proxy_rules_duration_seconds").minus(histogramOf(before[i], "kubeproxy_sync_proxy_rules_duration_seconds")),
					programming: histogramOf(m, "kubeproxy_network_programming_duration_seconds").minus(histogramOf(before[i], "kubeproxy_network_programming_duration_seconds")),
					proxyCPU:    cpuOf(b, n.ProxyPID()) - cpu0[i],
					collector:   n == with,
				}
				if n == with {
					phases[ph][i].collectorCPU = cpuOf(b, p.PID()) - col0
				}
			}
			p.Stop()
		}
	}
	cancel()
	b.Logf("churn: %d changes made, %d failed over both phases", churn.Made.Load(), churn.Failed.Load())
	// Pool each kube-proxy's phase with a collector and its phase without.
	type agg struct{ sync, prog []float64 }
	var with, without agg
	var colCPU, proxyCPU time.Duration
	for ph := range 2 {
		for i, n := range nodes {
			x := phases[ph][i]
			line := fmt.Sprintf("phase %d %s (collector %v): syncs %.0f p50 %.3fs p99 %.3fs; programming p50 %.2fs p99 %.2fs; kube-proxy CPU %s",
				ph+1, n.Name, x.collector, x.sync.count, x.sync.quantile(0.5), x.sync.quantile(0.99), x.programming.quantile(0.5), x.programming.quantile(0.99),
				x.proxyCPU.Round(time.Millisecond))
			if x.collector {
				line += fmt.Sprintf(", collector CPU %s (%.1f%% of kube-proxy's)", x.collectorCPU.Round(time.Millisecond), 100*x.collectorCPU.Seconds()/x.proxyCPU.Seconds())
				colCPU += x.collectorCPU
				proxyCPU += x.proxyCPU
				with.sync, with.prog = append(with.sync, x.sync.quantile(0.99)), append(with.prog, x.programming.quantile(0.99))
			} else {
				without.sync, without.prog = append(without.sync, x.sync.quantile(0.99)), append(without.prog, x.programming.quantile(0.99))
			}
			b.Log(line)
		}
	}
	mean := func(v []float64) float64 {
		s := 0.0
		for _, x := range v {
			s += x
		}
		return s / float64(len(v))
	}
	sort.Float64s(with.sync)
	b.ReportMetric(100*(mean(with.sync)/mean(without.sync)-1), "sync-p99-worse-%")
	b.ReportMetric(100*(mean(with.prog)/mean(without.prog)-1), "programming-p99-worse-%")
	b.ReportMetric(100*colCPU.Seconds()/proxyCPU.Seconds(), "collector-cpu-of-kube-proxy-%")
}
