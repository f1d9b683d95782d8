package aggregator

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/api"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

var spec = synth.Spec{Services: 8, EndpointsPerService: 3}

type harness struct {
	t      *testing.T
	client *fake.Clientset
	agg    *Aggregator
	addr   string
	// net carries the streams and HTTP: in memory, so that the bubble
	// (testing/synctest) a harness runs in sees who waits on what.
	net *testkit.MemNet
	// settle lets the goroutines a step of the clock woke run until they
	// wait again: synctest.Wait, or realTime outside a bubble.
	settle func()
	ctx    context.Context
	wg     *sync.WaitGroup
	// clk is the time of the view, the aggregator and the harness's
	// collectors: it moves only when the test steps it (until, advance).
	clk *clocktesting.FakeClock
}

// t0 is where the harness's clock starts.
var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

// start runs an aggregator over a fake API holding the synth cluster and
// nodes n1..n3, leading, with the given authenticator.
func start(t *testing.T, grace time.Duration, auth auth.Authenticator) *harness {
	return startWith(t, grace, auth, fakeCluster(), nil)
}

// fakeCluster is a fake API holding the synth cluster and nodes n1..n3.
func fakeCluster() *fake.Clientset {
	objs := spec.APIObjects()
	for _, n := range []string{"n1", "n2", "n3"} {
		objs = append(objs, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}})
	}
	return fake.NewClientset(objs...)
}

// startWith is start over the given fake API, with the barrier when not
// nil. Nothing evaluates on its own: until and advance do, as they step
// the clock.
func startWith(t *testing.T, grace time.Duration, auth auth.Authenticator, client *fake.Clientset, barrier *view.Barrier) *harness {
	return startView(t, grace, auth, client, view.Config{Debounce: 50 * time.Millisecond, Barrier: barrier})
}

// startView is startWith with the view's debounce and barrier in vc.
func startView(t *testing.T, grace time.Duration, auth auth.Authenticator, client *fake.Clientset, vc view.Config, opts ...func(*Config)) *harness {
	ctx, cancel := context.WithCancel(context.Background())
	log := zaptest.NewLogger(t)
	clk := clocktesting.NewFakeClock(t0)
	vc.Client, vc.Keep, vc.Log, vc.Clock = client, 4*grace, log, clk
	vw := view.New(vc)
	p := audit.DefaultPolicy()
	p.Grace, p.DefaultInterval = grace, time.Second
	cfg := Config{Policy: p, Auth: auth, Self: "127.0.0.1:1", Log: log, MaxMessageBytes: 1 << 20, Clock: clk}
	for _, o := range opts {
		o(&cfg)
	}
	mn := netOf(t)
	if cfg.Shards != nil && cfg.Shards.Client == nil {
		cfg.Shards.Client = mn.HTTPClient() // the replicas' internal API
	}
	agg := New(cfg, vw)
	ln, err := mn.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait) // runs after cancel: cleanups run last-in first-out
	t.Cleanup(cancel)
	wg.Add(2)
	go func() { defer wg.Done(); vw.Run(ctx) }()
	go func() { defer wg.Done(); agg.Serve(ctx, ln) }()
	agg.StartedLeading()
	h := &harness{t: t, client: client, agg: agg, addr: ln.Addr().String(), net: mn, ctx: ctx, wg: &wg, clk: clk, settle: synctest.Wait}
	h.eventually(10*time.Second, "informers synced", func() bool { return vw.Synced() == nil })
	return h
}

// realTime is the harness's settle for the few tests that cannot run in
// a synctest bubble, which sees goroutines wait on channels, conditions,
// wait groups and sleeps, but not on a mutex or a socket: the one that
// holds the view's State on purpose (the view's rebuild then waits on its
// sync.RWMutex, and synctest.Wait would never return), and those that
// talk to other processes over real sockets (Chromium, Prometheus,
// Alertmanager). There
// the goroutines a step woke get a few milliseconds of the machine's time.
func realTime() { time.Sleep(5 * time.Millisecond) }

// nets are the tests' networks in memory, one a test: its harnesses and
// the servers it starts reach each other there.
var nets sync.Map // *testing.T → *testkit.MemNet

// noCPU is the collectors' CPU meter in these tests: their reads cost
// nothing. The process's CPU is every goroutine's, the aggregator's and
// the race detector's too, and the spacing it sets (a read that "cost" a
// second under load was followed by the next 20 s later) is the
// collector's own tests' (TestClientReadBudget), not these.
func noCPU() time.Duration { return 0 }

// netOf is t's network.
func netOf(t *testing.T) *testkit.MemNet {
	if mn, ok := nets.Load(t); ok {
		return mn.(*testkit.MemNet)
	}
	mn := testkit.NewMemNet()
	nets.Store(t, mn)
	t.Cleanup(func() { nets.Delete(t) })
	return mn
}

// eventually waits, in the bubble's time, for something that needs no
// step of the harness's clock.
func (h *harness) eventually(d time.Duration, what string, cond func() bool) {
	h.t.Helper()
	testkit.Eventually(h.t, d, what, cond)
}

// step is how far until and advance move the clock at a time; after each
// step the goroutines it woke (informers, streams, collectors) run until
// they wait again (synctest.Wait), so a test needs no real time.
const step = 50 * time.Millisecond

// until steps the clock and evaluates until cond holds, failing after
// limit of the harness's time. It returns the time that passed on the
// clock.
func (h *harness) until(limit time.Duration, what string, cond func() bool) time.Duration {
	h.t.Helper()
	start := h.clk.Now()
	for {
		h.agg.Evaluate()
		if cond() {
			return h.clk.Since(start)
		}
		if h.clk.Since(start) > limit {
			h.t.Fatalf("timed out after %s waiting for %s", h.clk.Since(start), what)
		}
		h.clk.Step(step)
		h.settle()
	}
}

// advance steps the clock by d, evaluating as it goes, and calls each
// (when not nil) after every evaluation.
func (h *harness) advance(d time.Duration, each func()) {
	h.t.Helper()
	for end := h.clk.Now().Add(d); h.clk.Now().Before(end); {
		h.clk.Step(step)
		h.settle()
		h.agg.Evaluate()
		if each != nil {
			each()
		}
	}
}

// dial opens a raw stream and sends hello.
func (h *harness) dial(node string) net.Conn {
	h.t.Helper()
	c, err := h.net.Dial(h.ctx, h.addr)
	if err != nil {
		h.t.Fatal(err)
	}
	h.t.Cleanup(func() { c.Close() })
	if node != "" {
		if err := stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, Token: "t-" + node, IntervalSeconds: 1}}); err != nil {
			h.t.Fatal(err)
		}
	}
	return c
}

func expect(t *testing.T, c net.Conn, typ, contains string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(c, 1<<20)
	if err != nil {
		t.Fatalf("want %s, read: %v", typ, err)
	}
	if m.Type != typ {
		if m.Reject != nil {
			t.Fatalf("want %s, got reject: %s", typ, m.Reject.Reason)
		}
		t.Fatalf("want %s, got %+v", typ, m)
	}
	if contains != "" && (m.Reject == nil || !strings.Contains(m.Reject.Reason, contains)) {
		t.Fatalf("reject reason %+v does not say %q", m.Reject, contains)
	}
}

func rules(t *testing.T, drop ...int) *audit.Observed {
	t.Helper()
	o, err := spec.Observed()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range drop {
		for k := range o.Frontends {
			if o.Frontends[k].IP == synth.VIP(i) {
				eps := o.Frontends[k].Endpoints
				o.Frontends[k].Endpoints = eps[:len(eps)-1]
			}
		}
	}
	return o
}

// tokens: "t-NODE" is valid for NODE only.
var tokens = auth.AuthFunc(func(_ context.Context, h auth.Hello) error {
	if h.Token != "t-"+h.Node {
		return errors.New("unauthenticated: token is bound to another node")
	}
	return nil
})

// Bad streams are refused over a real socket with a reason, counted, and
// leave no node behind. (What an open stream refuses, and every refusal
// of a hello, is in testdata/protocol.)
func TestStreamRejects(t *testing.T) {
	h := start(t, 2*time.Second, tokens)
	rejected := func(reason RejectReason) float64 {
		return testutil.ToFloat64(h.agg.cfg.Metrics.StreamRejected.WithLabelValues(string(reason)))
	}
	cases := []struct {
		name   string
		reason RejectReason
		says   string
		send   func(c net.Conn)
	}{
		{"garbage", ReasonMalformed, "malformed", func(c net.Conn) { c.Write([]byte("\x00\x00\x00\x05hello")) }},
		{"100 MB message", ReasonTooLarge, "larger than the limit", func(c net.Conn) {
			var hdr [4]byte
			binary.BigEndian.PutUint32(hdr[:], 100<<20)
			c.Write(hdr[:])
		}},
		{"report before hello", ReasonProtocol, "must be a hello", func(c net.Conn) {
			stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: 1}})
		}},
		{"no node", ReasonProtocol, "no valid node", func(c net.Conn) {
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{IntervalSeconds: 1}})
		}},
		{"token for another node", ReasonAuth, "another node", func(c net.Conn) {
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n2", Token: "t-n1", IntervalSeconds: 1}})
		}},
		{"no token", ReasonAuth, "unauthenticated", func(c net.Conn) {
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n2", IntervalSeconds: 1}})
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := rejected(tc.reason)
			c := h.dial("")
			tc.send(c)
			expect(t, c, stream.TypeReject, tc.says)
			if got := rejected(tc.reason); got != before+1 {
				t.Errorf("rejected{%s} = %v, want %v", tc.reason, got, before+1)
			}
		})
	}

	h.agg.mu.Lock()
	defer h.agg.mu.Unlock()
	if n := h.agg.fleet.nodes["n2"]; n != nil {
		t.Errorf("a refused stream created node n2")
	}
}

func (h *harness) collector(ctx context.Context, node string, read func() *audit.Observed) {
	h.collectorEvery(ctx, node, time.Second, read)
}

func (h *harness) collectorEvery(ctx context.Context, node string, interval time.Duration, read func() *audit.Observed) {
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		collector.Run(ctx, collector.Config{Node: node, Aggregator: h.addr, Interval: interval, CPUTime: noCPU, TokenFile: "", Clock: h.clk, Dial: h.net.Dial,
			Version: "v0.1.0-test\x1b[2J",
			Log:     zaptest.NewLogger(h.t).Named(node),
			Reader:  &collectortest.Reader{Rules: func() (*audit.Observed, error) { return read(), nil }}})
	}()
}

// holdShard holds shard k until the harness ends, as the coordinator
// would; the harness waits for it (its goroutine logs to the test, which
// must not have ended).
func (h *harness) holdShard(k int) {
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		h.agg.HoldShard(h.ctx, k)
	}()
}

func (h *harness) verdict() audit.Verdict {
	if v := h.agg.Verdict(); v != nil {
		return *v
	}
	return audit.Verdict{}
}

func kindsOf(v audit.Verdict) string {
	var out []string
	for _, f := range v.Findings {
		out = append(out, f.Node+":"+string(f.Kind))
	}
	return strings.Join(out, " ")
}

// The whole loop through real collector clients: four nodes in sync; an
// endpoint removed from a slice; two nodes follow, two do not (judged once,
// since they show the same rules) → after
// grace a StuckProxy (and its stale endpoint) for each of them; one
// node catches up → clear; its collector stops → CollectorMissing.
func TestAggregatorJudgesCollectors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
		var mu sync.Mutex
		current := rules(t)
		stuck := rules(t)
		n3ctx, stopN3 := context.WithCancel(h.ctx)
		h.collector(h.ctx, "n1", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
		h.collector(h.ctx, "n2", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
		h.collector(n3ctx, "n3", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return stuck })
		// n4 shows n3's rules: judged once for both, reported for each.
		h.collector(h.ctx, "n4", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return stuck })
		h.until(10*time.Second, "four nodes in sync", func() bool {
			v := h.verdict()
			in := 0
			for _, n := range v.Nodes {
				if n.State == audit.NodeInSync {
					in++
				}
			}
			return in == 4 && len(v.Findings) == 0
		})

		sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Get(h.ctx, synth.ServiceName(2)+"-0", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sl.Endpoints = sl.Endpoints[:len(sl.Endpoints)-1]
		if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		current = rules(t, 2)
		mu.Unlock()
		took := h.until(15*time.Second, "StuckProxy on n3 and n4", func() bool {
			return kindsOf(h.verdict()) == "n3:StuckProxy n3:StaleEndpoint n4:StuckProxy n4:StaleEndpoint"
		})
		if shared := testutil.ToFloat64(h.agg.cfg.Metrics.Assessments.WithLabelValues("shared")); shared == 0 {
			t.Error("nodes showing the same rules were each assessed on their own")
		}
		if took < 2*time.Second {
			t.Fatalf("finding raised %s after the change, before grace", took)
		}
		for _, n := range h.verdict().Nodes {
			if n.Node != "n3" && n.Node != "n4" && n.Lag.Samples == 0 {
				t.Errorf("%s: no programming-lag samples after catching up: %+v", n.Node, n)
			}
			// A reader without a change signal reads at every heartbeat, and
			// says so.
			if n.Collector == nil || n.Collector.Reads["heartbeat"] == 0 {
				t.Errorf("%s: the collector's read cost did not arrive: %+v", n.Node, n.Collector)
			}
		}
		if reads := testutil.ToFloat64(h.agg.cfg.Metrics.CollectorReads.WithLabelValues("heartbeat")); reads < 4 {
			t.Errorf("proxyaudit_collector_reads_total{reason=heartbeat} = %v over four collectors", reads)
		}

		// The HTTP API serves the verdict.
		srvURL, hc := h.net.HTTPServer(t, h.agg.Handler("0"))
		var fr api.FindingsResponse
		getJSON(t, hc, srvURL+"/api/v1/findings?node=n3", &fr)
		if len(fr.Findings) != 2 || fr.Findings[1].Since.IsZero() || fr.Summary.NodesDrifted != 1 {
			t.Fatalf("findings API: %+v", fr)
		}
		var nr api.NodeResponse
		getJSON(t, hc, srvURL+"/api/v1/nodes/n3", &nr)
		if nr.State != audit.NodeStuck || nr.Lagging != 1 || len(nr.Findings) != 2 {
			t.Fatalf("node API: %+v", nr)
		}
		getJSON(t, hc, srvURL+"/api/v1/nodes/n4", &nr)
		for _, f := range nr.Findings {
			if f.Node != "n4" {
				t.Fatalf("n4's findings name node %s: %+v", f.Node, nr.Findings)
			}
		}
		r, err := hc.Get(srvURL + "/api/v1/nodes/nope")
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode != http.StatusNotFound {
			t.Fatalf("unknown node: %d", r.StatusCode)
		}

		mu.Lock()
		stuck = rules(t, 2)
		mu.Unlock()
		h.until(10*time.Second, "n3 recovered", func() bool { return len(h.verdict().Findings) == 0 })
		stopN3()
		h.until(15*time.Second, "n3 missing", func() bool { return kindsOf(h.verdict()) == "n3:CollectorMissing" })
	})
}

// getJSON GETs url through hc (the harness's network's client) and
// decodes its JSON into v.
func getJSON(t *testing.T, hc *http.Client, url string, v any) {
	t.Helper()
	r, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	if r.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, r.Status)
	}
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		t.Fatal(err)
	}
}

func TestQuietNodes(t *testing.T) {
	now := metav1.Now()
	for _, tc := range []struct {
		node corev1.Node
		want audit.Quiet
	}{
		{corev1.Node{}, ""},
		{corev1.Node{Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue}}}}, ""},
		{corev1.Node{Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionUnknown}}}}, audit.QuietNotReady},
		{corev1.Node{ObjectMeta: metav1.ObjectMeta{DeletionTimestamp: &now}}, audit.QuietDeleting},
		{corev1.Node{Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: audit.ToBeDeletedTaint, Effect: corev1.TaintEffectNoSchedule}}}}, audit.QuietAutoscaler},
	} {
		if got := audit.QuietOf(&tc.node); got != tc.want {
			t.Errorf("%+v: %q, want %q", tc.node, got, tc.want)
		}
	}
	// view.Trim keeps what audit.QuietOf reads.
	n := &corev1.Node{Status: corev1.NodeStatus{Images: make([]corev1.ContainerImage, 3),
		Conditions: []corev1.NodeCondition{{Type: corev1.NodeMemoryPressure}, {Type: corev1.NodeReady, Status: corev1.ConditionFalse, Message: "kubelet stopped"}}}}
	view.Trim(n)
	if len(n.Status.Images) != 0 || len(n.Status.Conditions) != 1 || audit.QuietOf(n) != audit.QuietNotReady {
		t.Errorf("trimmed node: %+v", n.Status)
	}
}

// A stuck node whose collector reads every 30 s would be found up to 30 s
// after grace: the verdict waits for its next report. Once a report shows
// the node lagging, the aggregator asks it for a read when the missed
// change crosses grace, and the finding comes within seconds of it.
func TestReadNowBringsTheFindingForward(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const grace = 6 * time.Second
		h := start(t, grace, auth.InsecureNoAuth{})
		old := rules(t)
		sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		s := &sl.Items[0]
		s.Endpoints = s.Endpoints[:len(s.Endpoints)-1]
		if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		changed := h.clk.Now()
		h.until(5*time.Second, "the view to hold the change", func() bool { return h.agg.view.Covered().After(changed) })
		t.Log("changed a slice; n1's kube-proxy missed it and its collector reads every 30 s")
		// Its first report comes when it is already further behind than a
		// healthy kube-proxy ever is (readNowMinLag), but within grace.
		h.advance(readNowMinLag+500*time.Millisecond, nil)
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			collector.Run(h.ctx, collector.Config{Node: "n1", Aggregator: h.addr, Interval: 30 * time.Second, CPUTime: noCPU, Clock: h.clk, Dial: h.net.Dial,
				Log:    zaptest.NewLogger(t).Named("n1"),
				Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return old, nil }}})
		}()
		// Without the read-now the finding would wait for the collector's
		// next read, 30 s after its first: the limit stays below that.
		h.until(grace+20*time.Second, "n1 reported stuck", func() bool {
			return strings.Contains(kindsOf(h.verdict()), "n1:StuckProxy")
		})
		n := testutil.ToFloat64(h.agg.cfg.Metrics.ReadNow)
		t.Logf("StuckProxy %.1f s after the change (grace %s, collector interval 30 s); read-now requests: %.0f",
			h.clk.Since(changed).Seconds(), grace, n)
		if n != 1 {
			t.Errorf("%v read-now requests, want one per crossing", n)
		}
	})
}

// A node whose collector read no rules of a family the cluster has
// services in (an image without ip6tables on a dual-stack cluster) is
// warned of: that half is not audited, which is not "in sync".
func TestUnauditedFamilyWarned(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
		full := rules(t)
		h.collector(h.ctx, "n1", func() *audit.Observed { return full })
		h.collector(h.ctx, "n2", func() *audit.Observed {
			return &audit.Observed{Mode: full.Mode, Families: []int{6}, NoRules: true, RejectsKnown: true}
		})
		h.until(10*time.Second, "n2 warned of IPv4 not audited", func() bool {
			for _, n := range h.verdict().Nodes {
				if n.Node == "n2" && len(n.Warnings) == 1 && strings.Contains(n.Warnings[0], "IPv4 not audited") {
					return true
				}
			}
			return false
		})
		for _, n := range h.verdict().Nodes {
			if n.Node == "n1" && len(n.Warnings) > 0 {
				t.Errorf("n1 read the family the cluster has, yet: %v", n.Warnings)
			}
		}
	})
}

// What a collector's read noticed beside findings (kube-proxy's leftover
// rules on a Cilium node, a slot naming a missing backend) reaches the
// node's status as a warning, cleaned of what a terminal would act on,
// and leaves when a read no longer notices it.
func TestReadWarningsReachTheNodeStatus(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
		var mu sync.Mutex
		warned := rules(t)
		warned.Warnings = []string{"kube-proxy's iptables rules remain on this node\x1b[2J but kube-proxy does not answer"}
		current := warned
		h.collector(h.ctx, "n1", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
		status := func() audit.NodeStatus {
			for _, n := range h.verdict().Nodes {
				if n.Node == "n1" {
					return n
				}
			}
			return audit.NodeStatus{}
		}
		h.until(10*time.Second, "n1's warning in its status", func() bool {
			st := status()
			return st.State == audit.NodeInSync && len(st.Warnings) == 1 && strings.Contains(st.Warnings[0], "kube-proxy's iptables rules remain")
		})
		if w := status().Warnings[0]; strings.Contains(w, "\x1b") {
			t.Errorf("a warning kept an escape sequence: %q", w)
		}
		// The collector's version (its hello) is shown, cleaned, so that a
		// rolling upgrade can be watched node by node.
		if c := status().Collector; c == nil || !strings.HasPrefix(c.Version, "v0.1.0-test") || strings.Contains(c.Version, "\x1b") {
			t.Errorf("the node's collector: %+v, want version v0.1.0-test, cleaned", c)
		}
		mu.Lock()
		current = rules(t)
		mu.Unlock()
		h.until(10*time.Second, "n1's warning gone", func() bool { return len(status().Warnings) == 0 })
	})
}
