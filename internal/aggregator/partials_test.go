package aggregator

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// fleetStep makes a shard's next partial from the last: nodes join and
// leave, states flip, every node reports (its last report, watermark and
// counts move every second, as under churn), findings come and go.
func fleetStep(r *rand.Rand, prev audit.Partial, now time.Time, step int) audit.Partial {
	states := []audit.NodeState{audit.NodeInSync, audit.NodeLagging, audit.NodeStuck, audit.NodeMissing, audit.NodePending}
	p := audit.Partial{At: now, Drifted: map[string]time.Time{}}
	for _, st := range prev.Nodes {
		if r.IntN(40) == 0 {
			continue // left
		}
		p.Nodes = append(p.Nodes, st)
	}
	for range r.IntN(3) {
		p.Nodes = append(p.Nodes, audit.NodeStatus{Node: fmt.Sprintf("node-%d-%d", step, r.IntN(1000)), State: audit.NodePending})
	}
	slices.SortFunc(p.Nodes, func(a, b audit.NodeStatus) int { return strings.Compare(a.Node, b.Node) })
	p.Nodes = slices.CompactFunc(p.Nodes, func(a, b audit.NodeStatus) bool { return a.Node == b.Node })
	for i := range p.Nodes {
		st := &p.Nodes[i]
		st.LastReport, st.Watermark = now, now.Add(-time.Second)
		st.Services, st.Lagging = 1000, r.IntN(5)
		st.InSync = st.Services - st.Lagging
		st.Lag = audit.LagStats{Samples: step, P50: r.Float64()}
		st.Collector = &audit.CollectorCost{Reads: map[string]uint64{"change": uint64(step)}, Reader: "netlink"}
		if r.IntN(10) == 0 {
			st.State = states[r.IntN(len(states))]
		}
		if r.IntN(50) == 0 {
			st.Warnings = []string{"kube-proxy v1.31.0 is known to leak conntrack entries"}
		}
		if st.State == audit.NodeStuck {
			f := audit.TimedFinding{Since: now, Finding: audit.Finding{Node: st.Node, Kind: audit.StuckProxy}}
			p.Drift = append(p.Drift, f)
			p.Drifted[st.Node] = now
		}
	}
	return p
}

// The leader's copy, kept from changes alone, is the holder's partial as
// the holder would send it whole, after any run of reads: some missed,
// the holder restarted (a new run), the leader far behind. A node's state
// and the findings are never older than the read (but a flip between in
// sync and lagging, which rides with the whole status), its last report
// no more than reportEvery old, the rest no more than detailEvery.
func TestPartialChangesMirrorTheHolder(t *testing.T) {
	for seed := range uint64(20) {
		r := rand.New(rand.NewPCG(seed, 7))
		log := newPartialLog("run-0")
		var m partialMirror
		var p audit.Partial
		now := t0
		fulls, changes := 0, 0
		for step := range 600 {
			now = now.Add(time.Second)
			p = fleetStep(r, p, now, step)
			if r.IntN(200) == 0 {
				log = newPartialLog(fmt.Sprintf("run-%d", step)) // the holder restarted
			}
			log.publish(p, []int{1}, now)
			if r.IntN(3) == 0 {
				continue // a read missed
			}
			if step > 300 && step < 320 {
				continue // the leader far behind (20 versions; keepVersions is more)
			}
			resp, _ := log.since(m.epoch, m.version)
			// Through the wire, as the leader reads it.
			b, _ := json.Marshal(resp)
			var got PartialResponse
			if err := json.Unmarshal(b, &got); err != nil {
				t.Fatal(err)
			}
			if err := m.apply(&got); err != nil {
				t.Fatalf("seed %d step %d: %v", seed, step, err)
			}
			if got.Since == 0 {
				fulls++
			} else {
				changes++
			}
			whole, _ := log.since("", 0)
			wj, _ := json.Marshal(whole.Partial.Nodes)
			mj, _ := json.Marshal(m.whole().Nodes)
			if len(whole.Partial.Nodes)+len(m.nodes) > 0 && string(wj) != string(mj) {
				t.Fatalf("seed %d step %d: the leader holds\n%s\nthe holder\n%s", seed, step, mj, wj)
			}
			mine := m.whole()
			if len(mine.Nodes) != len(p.Nodes) || !reflect.DeepEqual(mine.Drift, p.Drift) {
				t.Fatalf("seed %d step %d: %d nodes and drift %v; published %d and %v", seed, step, len(mine.Nodes), mine.Drift, len(p.Nodes), p.Drift)
			}
			for i, st := range mine.Nodes {
				pub := p.Nodes[i]
				calm := func(s audit.NodeState) bool { return s == audit.NodeInSync || s == audit.NodeLagging }
				if st.Node != pub.Node || (st.State != pub.State && !(calm(st.State) && calm(pub.State))) || !slices.Equal(st.Warnings, pub.Warnings) {
					t.Fatalf("seed %d step %d: the leader holds %s %s %v, published %s %s %v", seed, step, st.Node, st.State, st.Warnings, pub.Node, pub.State, pub.Warnings)
				}
				if age := now.Sub(st.LastReport); age >= reportEvery {
					t.Fatalf("seed %d step %d: %s's last report on the leader is %s old (bound %s)", seed, step, st.Node, age, reportEvery)
				}
				if age := time.Duration(step-st.Lag.Samples) * time.Second; age >= detailEvery {
					t.Fatalf("seed %d step %d: %s's status on the leader is %s old (bound %s)", seed, step, st.Node, age, detailEvery)
				}
			}
		}
		if changes < 5*fulls {
			t.Errorf("seed %d: %d reads in full, %d of changes: the changes should be the rule", seed, fulls, changes)
		}
	}
}

// A leader further behind than the nodes that left are remembered is
// answered in full, not with changes that would keep a departed node.
func TestPartialLeaderTooFarBehindReadsInFull(t *testing.T) {
	log := newPartialLog("run")
	var m partialMirror
	now := t0
	nodes := func(names ...string) audit.Partial {
		p := audit.Partial{At: now}
		for _, n := range names {
			p.Nodes = append(p.Nodes, audit.NodeStatus{Node: n, State: audit.NodeInSync})
		}
		return p
	}
	log.publish(nodes("a", "b"), []int{0}, now)
	resp, _ := log.since("", 0)
	if err := m.apply(&resp); err != nil {
		t.Fatal(err)
	}
	log.publish(nodes("a"), []int{0}, now) // b leaves
	for range keepVersions + 5 {
		now = now.Add(time.Second)
		log.publish(nodes("a"), []int{0}, now)
	}
	resp, _ = log.since(m.epoch, m.version)
	if resp.Since != 0 {
		t.Fatalf("changes since version %d answered with changes; b's leaving is forgotten by now", m.version)
	}
	if err := m.apply(&resp); err != nil {
		t.Fatal(err)
	}
	if got := names([]audit.Partial{m.whole()}); !slices.Equal(got, []string{"a"}) {
		t.Errorf("the leader holds %v, want [a]", got)
	}
}

// Answers that do not follow what the leader holds are refused whole: the
// leader's copy stays as it was (its last good partial), and its next
// read asks for everything. A garbage version is a 400.
func TestPartialChangesThatDoNotFollow(t *testing.T) {
	m := partialMirror{}
	full := PartialResponse{Epoch: "run", Version: 5, Shards: []int{0}, Partial: audit.Partial{Nodes: []audit.NodeStatus{{Node: "a", State: audit.NodeInSync}}}}
	if err := m.apply(&full); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []PartialResponse{
		{Epoch: "run", Version: 9, Since: 4, States: []NodeLight{{Node: "a", State: audit.NodeStuck}}},   // after a version it does not hold
		{Epoch: "other", Version: 9, Since: 5, States: []NodeLight{{Node: "a", State: audit.NodeStuck}}}, // another run's
		{Epoch: "run", Version: 6, Since: 5, States: []NodeLight{{Node: "zz", State: audit.NodeStuck}}},  // a node never sent
	} {
		m.epoch, m.version = "run", 5
		if err := m.apply(&bad); err == nil {
			t.Errorf("%+v taken", bad)
		}
		if got := m.whole().Nodes; len(got) != 1 || got[0].State != audit.NodeInSync {
			t.Errorf("after %+v the leader holds %+v, want a InSync as it was", bad, got)
		}
		if q := m.query(); q != "" {
			t.Errorf("after %+v the next read asks %q, want everything", bad, q)
		}
	}

	agg := New(Config{Self: "127.0.0.1:9443", Log: zaptest.NewLogger(t), Shards: &Shards{Count: 2}}, view.New(view.Config{Client: fake.NewClientset()}))
	agg.publishPartial(audit.Partial{Nodes: []audit.NodeStatus{{Node: "a"}}}, []int{0})
	w := httptest.NewRecorder()
	agg.InternalHandler().ServeHTTP(w, httptest.NewRequest("GET", "/internal/v1/partial?since=-1", nil))
	if w.Code != http.StatusBadRequest || !strings.Contains(w.Body.String(), "whole number") {
		t.Errorf("since=-1: %d %s, want 400 saying what since is", w.Code, w.Body)
	}
}

// Through a real replica's internal API: the leader reads every node
// once, then changes only (a fraction of the bytes); a node that leaves
// leaves the leader's view; a restarted replica (a new run) is read in
// full again; a peer that sends changes the leader cannot follow is a
// failed read, its last good partial standing.
func TestLeaderReadsChangesFromAReplica(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 2
		port, client, peers := peersOn(t, 1)
		b := peers[0]
		clk := clocktesting.NewFakeClock(t0)
		holders := []string{"127.0.0.1:9443", b.identity}
		leader := New(Config{Self: "127.0.0.1:9443", Log: zaptest.NewLogger(t), Clock: clk,
			Shards: &Shards{Count: shards, Port: port, Client: client, Holders: func() []string { return holders }}}, viewExpecting(t, nodesIn(1, shards, 500)))
		var queries atomic.Value
		replica := func() *Aggregator {
			r := New(Config{Self: b.identity, Log: zaptest.NewLogger(t), Clock: clk, Shards: &Shards{Count: shards, Port: port, Client: client}}, view.New(view.Config{Client: fake.NewClientset()}))
			h := r.InternalHandler()
			b.handle(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				queries.Store(req.URL.RawQuery)
				h.ServeHTTP(w, req)
			}))
			return r
		}
		holder := replica()
		in1 := nodesIn(1, shards, 500)
		part := func(stuck string) audit.Partial {
			p := audit.Partial{At: clk.Now(), Drifted: map[string]time.Time{}}
			for _, n := range in1 {
				st := audit.NodeStatus{Node: n, State: audit.NodeInSync, LastReport: clk.Now(), Services: 1000, InSync: 1000,
					KubeProxy: &audit.KubeProxySignal{LastSync: clk.Now(), Version: "v1.34.2"}, Collector: &audit.CollectorCost{Reader: "netlink", Reads: map[string]uint64{"change": 7}}}
				if n == stuck {
					st.State = audit.NodeStuck
					p.Drift = append(p.Drift, audit.TimedFinding{Since: clk.Now(), Finding: audit.Finding{Node: n, Kind: audit.StuckProxy}})
					p.Drifted[n] = clk.Now()
				}
				p.Nodes = append(p.Nodes, st)
			}
			return p
		}
		leader.publishPartial(audit.Partial{}, []int{0})
		bytes := func(kind string) float64 {
			return testutil.ToFloat64(leader.cfg.Metrics.PartialReadBytes.WithLabelValues(kind))
		}
		gather := func() map[string]audit.NodeStatus {
			t.Helper()
			parts, unheard := leader.gatherPartials(context.Background(), clk.Now())
			if len(unheard) != 0 {
				t.Fatalf("shards %v unheard", unheard)
			}
			out := map[string]audit.NodeStatus{}
			for _, p := range parts {
				for _, st := range p.Nodes {
					out[st.Node] = st
				}
			}
			return out
		}

		holder.publishPartial(part(""), []int{1})
		if got := gather(); len(got) != len(in1) {
			t.Fatalf("first read: %d nodes, want %d", len(got), len(in1))
		}
		full := bytes("full")
		stuck := in1[17]
		clk.Step(time.Second)
		holder.publishPartial(part(stuck), []int{1})
		got := gather()
		if got[stuck].State != audit.NodeStuck || len(got) != len(in1) {
			t.Fatalf("after a change: %s is %s among %d nodes, want Stuck among %d", stuck, got[stuck].State, len(got), len(in1))
		}
		if q, _ := queries.Load().(string); !strings.Contains(q, "since=1") {
			t.Errorf("the second read asked %q, want the changes since version 1", q)
		}
		if c := bytes("changes"); c == 0 || c*5 > full {
			t.Errorf("a second's changes (one node stuck, every node's last report moved) read %.0f bytes, all %d nodes %.0f: want under a fifth (a tenth of the nodes sent whole each second)", c, len(in1), full)
		}
		parts, _ := leader.gatherPartials(context.Background(), clk.Now())
		if v := audit.Conclude(audit.DefaultPolicy(), parts...); len(v.Findings) != 1 || v.Findings[0].Node != stuck {
			t.Errorf("concluded from changes: %+v, want %s's StuckProxy", v.Findings, stuck)
		}

		gone := in1[3]
		in1 = slices.DeleteFunc(in1, func(n string) bool { return n == gone })
		clk.Step(time.Second)
		holder.publishPartial(part(stuck), []int{1})
		if got := gather(); len(got) != len(in1) {
			t.Errorf("after %s left the leader holds %d nodes, want %d", gone, len(got), len(in1))
		} else if _, ok := got[gone]; ok {
			t.Errorf("%s left and the leader still holds it", gone)
		}

		// The replica restarts: a new run, whose versions start again.
		holder = replica()
		clk.Step(time.Second)
		holder.publishPartial(part(""), []int{1})
		before := bytes("full")
		if got := gather(); len(got) != len(in1) || got[stuck].State != audit.NodeInSync {
			t.Errorf("after the replica restarted: %d nodes, %s %s; want %d, InSync", len(got), stuck, got[stuck].State, len(in1))
		}
		if bytes("full") == before {
			t.Error("a restarted replica's partial was not read in full")
		}

		// A peer that answers changes after a version the leader does not
		// hold: a failed read, the last good partial stands, the next read
		// asks for everything.
		b.serve(func(w http.ResponseWriter) {
			json.NewEncoder(w).Encode(PartialResponse{Replica: b.identity, Shards: []int{1}, Epoch: "forged", Version: 99, Since: 98,
				States: []NodeLight{{Node: in1[0], State: audit.NodeStuck}}})
		})
		failed := testutil.ToFloat64(leader.cfg.Metrics.PartialReads.WithLabelValues("failed"))
		clk.Step(time.Second)
		if got := gather(); got[in1[0]].State != audit.NodeInSync || len(got) != len(in1) {
			t.Errorf("changes the leader cannot follow were taken: %s %s", in1[0], got[in1[0]].State)
		}
		if testutil.ToFloat64(leader.cfg.Metrics.PartialReads.WithLabelValues("failed")) != failed+1 {
			t.Error("changes the leader cannot follow were not a failed read")
		}
		if q := leader.gathered[b.identity].mirror.query(); q != "" {
			t.Errorf("after changes it could not follow the leader asks %q next, want everything", q)
		}
	})
}

// churn is one second of a steady shard under churn: no node joins or
// leaves, every node reports (last report, watermark, counts and lag
// move), a tenth of them flip between in sync and lagging.
func churn(r *rand.Rand, p audit.Partial, now time.Time) audit.Partial {
	out := audit.Partial{At: now, Nodes: slices.Clone(p.Nodes), Drifted: map[string]time.Time{}}
	for i := range out.Nodes {
		st := &out.Nodes[i]
		st.LastReport, st.Watermark = now, now.Add(-800*time.Millisecond)
		st.Services, st.Lagging = 10000, r.IntN(3)
		st.InSync = st.Services - st.Lagging
		st.Lag = audit.LagStats{Samples: 64, P50: 0.4 + r.Float64()/10, P90: 0.8, P99: 1.1, Max: 1.3}
		st.KubeProxy = &audit.KubeProxySignal{LastSync: now.Add(-time.Second), LastQueued: now.Add(-time.Second), Version: "v1.34.2"}
		st.Collector = &audit.CollectorCost{Reads: map[string]uint64{"change": uint64(now.Unix()), "backstop": 12, "heartbeat": 3}, LastReadSeconds: 0.012,
			LastReadCPUSeconds: 0.01, LastReadBytes: 1 << 20, FullReadIntervalSeconds: 60, Reader: "netlink"}
		if r.IntN(10) == 0 {
			st.State = map[audit.NodeState]audit.NodeState{audit.NodeInSync: audit.NodeLagging, audit.NodeLagging: audit.NodeInSync}[st.State]
		}
	}
	return out
}

// The leader's read of one replica's partial, 6,250 nodes (100,000 over
// 16 replicas) under churn: in full, and the changes of one second.
// Side by side, the holder's publish and both ends of the wire included.
func BenchmarkPartialRead(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 2))
	var p audit.Partial
	now := t0
	for i := range 6250 {
		p.Nodes = append(p.Nodes, audit.NodeStatus{Node: fmt.Sprintf("ip-10-1-%d-%d.ec2.internal", i/250, i%250), State: audit.NodeInSync, Mode: audit.ModeIPTables})
	}
	log := newPartialLog("run")
	var m partialMirror
	for range 30 { // past detailEvery: the refreshes spread out
		now = now.Add(time.Second)
		p = churn(r, p, now)
		log.publish(p, []int{1}, now)
		resp, _ := log.since(m.epoch, m.version)
		m.apply(&resp)
	}
	for _, kind := range []string{"full", "changes"} {
		b.Run(kind, func(b *testing.B) {
			var size int
			for b.Loop() {
				now = now.Add(time.Second)
				p = churn(r, p, now)
				log.publish(p, []int{1}, now)
				var resp PartialResponse
				if kind == "full" {
					resp, _ = log.since("", 0)
				} else {
					resp, _ = log.since(m.epoch, m.version)
				}
				body, _ := json.Marshal(resp)
				size = len(body)
				var got PartialResponse
				if err := json.Unmarshal(body, &got); err != nil {
					b.Fatal(err)
				}
				if kind == "full" {
					var fresh partialMirror
					fresh.apply(&got)
					m = fresh
				} else if err := m.apply(&got); err != nil {
					b.Fatal(err)
				}
				_ = m.whole()
			}
			b.ReportMetric(float64(size), "bytes/read")
			b.ReportMetric(float64(size)/6250, "bytes/node")
		})
	}
}

// A holder's answer decodes to bounded memory whatever it holds: "{}"
// node entries (each ~77 times its bytes once decoded) past the nodes its
// shards have are refused before they are kept, and a large answer of
// states for whole statuses in the same answer applies in linear time
// (the states were each checked by a scan of the nodes: 4-6 s for 700 KB;
// trust review 4, item 4).
func TestHostilePartialAnswersAreBounded(t *testing.T) {
	empty := []byte(`{"replica":"r","partial":{"nodes":[` + strings.Repeat(`{},`, 700_000) + `{}]}}`)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	_, err := decodePartial(empty, 5000)
	runtime.ReadMemStats(&after)
	if err == nil || !strings.Contains(err.Error(), "more than 5000 node entries") {
		t.Fatalf("700,000 empty node entries for at most 5,000 nodes: %v", err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 8*uint64(len(empty)) {
		t.Errorf("refusing a %d KB answer allocated %d KB", len(empty)>>10, alloc>>10)
	}

	const n = 20_000
	var b strings.Builder
	b.WriteString(`{"replica":"r","epoch":"e","version":2,"since":1,"partial":{"nodes":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"node":"n%d","state":"InSync"}`, i)
	}
	b.WriteString(`]},"states":[`)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"node":"n%d","state":"Lagging"}`, i)
	}
	b.WriteString(`]}`)
	r, err := decodePartial([]byte(b.String()), n)
	if err != nil {
		t.Fatal(err)
	}
	m := &partialMirror{epoch: "e", version: 1, nodes: map[string]audit.NodeStatus{}}
	start := time.Now()
	if err := m.apply(r); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d KB answer of %d whole statuses and %d states applied in %s", b.Len()>>10, n, n, time.Since(start).Round(time.Millisecond))
	if len(m.nodes) != n || m.nodes["n7"].State != audit.NodeLagging {
		t.Errorf("applied %d nodes, n7 %s", len(m.nodes), m.nodes["n7"].State)
	}
}

// viewExpecting is a view, run until the test ends, whose cluster lists
// nodes: the nodes a holder's partial may carry are bounded by them.
func viewExpecting(t *testing.T, nodes []string) *view.View {
	objs := make([]k8sruntime.Object, len(nodes))
	for i, n := range nodes {
		objs[i] = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}
	}
	v := view.New(view.Config{Client: fake.NewClientset(objs...), Debounce: time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	go func() { v.Run(ctx); close(done) }()
	testkit.Eventually(t, 10*time.Second, "the view lists the nodes", func() bool { return len(v.ExpectedNodes()) == len(nodes) })
	return v
}
