package aggregator

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// helloRefs opens a raw stream that offers refs and expects a welcome
// that accepts them.
func (h *harness) helloRefs(node string) net.Conn {
	h.t.Helper()
	c := h.dial("")
	stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, Token: "t-" + node, IntervalSeconds: 1, Refs: true}})
	m := next(h.t, c)
	if m.Type != stream.TypeWelcome || m.Welcome == nil || !m.Welcome.Refs {
		h.t.Fatalf("answer to a hello offering refs: %+v", m)
	}
	return c
}

func next(t *testing.T, c net.Conn) *stream.Message {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(c, 16<<20)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	return m
}

// TestRefsAskOnlyForUnknownContent: the first node to name a frontend is
// asked for it once; every other node naming it sends 40 bytes instead of
// the frontend, and is never asked.
func TestRefsAskOnlyForUnknownContent(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	full := func(c net.Conn, seq uint64) *stream.Report {
		r := stream.Delta(stream.NewState(), stream.FromModel(rules(t)), seq, true, true)
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
		return r
	}
	// alive: a report with a wrong root is answered by a resync, the first
	// answer after anything the stream was asked before.
	alive := func(c net.Conn, seq uint64) {
		t.Helper()
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: seq, Root: 1}})
		if m := next(t, c); m.Type != stream.TypeResync {
			t.Fatalf("want a resync, got %+v", m)
		}
	}
	c1 := h.helloRefs("n1")
	r := full(c1, 1)
	m := next(t, c1)
	if m.Type != stream.TypeWant || m.Want.Seq != 1 || len(m.Want.Sums) != len(r.Refs) {
		t.Fatalf("first node naming unknown frontends: %+v", m)
	}
	st := stream.FromModel(rules(t))
	found := st.Find(m.Want.Sums)
	ct := &stream.Content{}
	for _, f := range found {
		ct.Frontends = append(ct.Frontends, f)
	}
	stream.Write(c1, &stream.Message{Type: stream.TypeContent, Content: ct})
	alive(c1, 2)
	if got := testutil.ToFloat64(h.agg.cfg.Metrics.Refs.WithLabelValues("wanted")); got != float64(len(r.Refs)) {
		t.Errorf("refs wanted: %v", got)
	}

	c2 := h.helloRefs("n2")
	full(c2, 1)
	alive(c2, 2) // the resync is the first answer: nothing was wanted
	if got := testutil.ToFloat64(h.agg.cfg.Metrics.Refs.WithLabelValues("known")); got != float64(len(r.Refs)) {
		t.Errorf("refs known: %v", got)
	}
	h.eventually(5*time.Second, "both copies whole", func() bool {
		h.agg.mu.Lock()
		defer h.agg.mu.Unlock()
		return h.agg.nodes["n1"].state.Len() == len(r.Refs) && h.agg.nodes["n2"].state.Len() == len(r.Refs)
	})

	// A collector that no longer has what it named (it changed since) says
	// so by leaving it out: the aggregator asks for a full snapshot.
	c4 := h.helloRefs("n4")
	gone := &stream.Report{Seq: 1, Full: true, Refs: []stream.Ref{{Key: "198.19.250.2:80/TCP", Sum: stream.Frontend{Key: "198.19.250.2:80/TCP", Scope: "Cluster"}.Sum()}}}
	stream.Write(c4, &stream.Message{Type: stream.TypeReport, Report: gone})
	if m := next(t, c4); m.Type != stream.TypeWant {
		t.Fatalf("want a want, got %+v", m)
	}
	stream.Write(c4, &stream.Message{Type: stream.TypeContent, Content: &stream.Content{Frontends: []stream.Frontend{}}})
	if m := next(t, c4); m.Type != stream.TypeResync {
		t.Fatalf("content left out: want a resync, got %+v", m)
	}

	// Hostile content ends the stream and changes nothing.
	for _, tc := range []struct {
		name, says string
		send       func(c net.Conn)
	}{
		{"content nobody asked for", "nobody asked", func(c net.Conn) {
			stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: ct})
		}},
		{"content that was not asked", "not asked", func(c net.Conn) {
			r := &stream.Report{Seq: 1, Full: true, Refs: []stream.Ref{{Key: "198.19.250.1:80/TCP", Sum: stream.Frontend{Key: "198.19.250.1:80/TCP", Scope: "Cluster"}.Sum()}}}
			stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
			if m := next(t, c); m.Type != stream.TypeWant {
				t.Fatalf("want a want, got %+v", m)
			}
			stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: &stream.Content{Frontends: []stream.Frontend{{Key: "198.19.250.1:80/TCP", Scope: "Local"}}}})
		}},
		{"reports piling up behind an unanswered want", "without answering", func(c net.Conn) {
			r := &stream.Report{Seq: 1, Full: true, Refs: []stream.Ref{{Key: "198.19.250.1:80/TCP", Sum: stream.Frontend{Key: "198.19.250.1:80/TCP", Scope: "Cluster"}.Sum()}}}
			stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
			if m := next(t, c); m.Type != stream.TypeWant {
				t.Fatalf("want a want, got %+v", m)
			}
			for seq := range uint64(maxQueued + 1) {
				stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: seq + 2, Root: 1}})
			}
		}},
	} {
		c := h.helloRefs("n3")
		tc.send(c)
		expect(t, c, stream.TypeReject, tc.says)
		h.agg.mu.Lock()
		if n := h.agg.nodes["n3"]; n != nil && n.state.Len() != 0 {
			t.Errorf("%s: n3's copy holds %d frontends", tc.name, n.state.Len())
		}
		h.agg.mu.Unlock()
	}
}

// TestTopsOverRealCollectors: real collector clients name each new state
// by its top; the first node to show a state is asked one level down at a
// time, every node showing it after that costs one hash, and no copy ever
// disagrees with its collector (no resync).
func TestTopsOverRealCollectors(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	var mu sync.Mutex
	nodes := []string{"n1", "n2", "n3"}
	shows := map[string]*audit.Observed{}
	for _, n := range nodes {
		o := rules(t)
		mu.Lock() // the collectors started already read the map
		shows[n] = o
		mu.Unlock()
		h.collector(h.ctx, n, func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return shows[n] })
	}
	// has: node n's copy holds what it shows.
	has := func(n string) bool {
		mu.Lock()
		defer mu.Unlock()
		want := stream.FromModel(shows[n])
		h.agg.mu.Lock()
		defer h.agg.mu.Unlock()
		nd := h.agg.nodes[n]
		return nd != nil && nd.complete && nd.state.Root() == want.Root() && nd.state.Len() == want.Len()
	}
	for _, n := range nodes {
		h.until(10*time.Second, n+"'s copy of the first rules", func() bool { return has(n) })
	}
	m := h.agg.cfg.Metrics
	known0, wanted0 := testutil.ToFloat64(m.Named.WithLabelValues("top", "known")), testutil.ToFloat64(m.Named.WithLabelValues("top", "wanted"))
	for _, drop := range [][]int{{2}, {2, 5}, {1, 2, 5, 7}} {
		// One node shows the new rules first; the others follow once its
		// copy holds them (nodes of a fleet report at their own phases).
		for _, n := range nodes {
			mu.Lock()
			shows[n] = rules(t, drop...)
			mu.Unlock()
			h.until(10*time.Second, fmt.Sprintf("%s's copy of the rules without %v", n, drop), func() bool { return has(n) })
		}
	}
	known, wanted := testutil.ToFloat64(m.Named.WithLabelValues("top", "known"))-known0, testutil.ToFloat64(m.Named.WithLabelValues("top", "wanted"))-wanted0
	if known != 6 || wanted != 3 {
		t.Errorf("three new states over three nodes in turn: tops known %v (want 6), wanted %v (want 3)", known, wanted)
	}
	// A new stream (a leader change, a lost connection) starts with a
	// full snapshot, by top: one hash when another copy holds that state.
	h.agg.mu.Lock()
	old := h.agg.nodes["n1"].conn
	old.Close()
	h.agg.mu.Unlock()
	h.until(30*time.Second, "n1 streaming again with its copy whole", func() bool {
		h.agg.mu.Lock()
		nd := h.agg.nodes["n1"]
		again := nd.conn != nil && nd.conn != old
		h.agg.mu.Unlock()
		return again && has("n1")
	})
	if k, w := testutil.ToFloat64(m.Named.WithLabelValues("top", "known"))-known0, testutil.ToFloat64(m.Named.WithLabelValues("top", "wanted"))-wanted0; k != 7 || w != 3 {
		t.Errorf("n1's full snapshot on a new stream: tops known %v (want 7), wanted %v (want 3)", k, w)
	}
	if rs := testutil.ToFloat64(m.Resyncs); rs != 0 {
		t.Errorf("%v resyncs: a copy disagreed with its collector", rs)
	}
	h.agg.mu.Lock()
	defer h.agg.mu.Unlock()
	if !h.agg.nodes["n1"].state.Same(h.agg.nodes["n2"].state) || !h.agg.nodes["n2"].state.Same(h.agg.nodes["n3"].state) {
		t.Error("nodes showing the same rules do not share their buckets")
	}
}

// TestTopsHostileAnswers: a collector's answer must be what was asked, at
// the level asked; one that no longer has what it named is resynced.
func TestTopsHostileAnswers(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	v1, v2, v3 := stream.FromModel(rules(t)), stream.FromModel(rules(t, 3)), stream.FromModel(rules(t, 3, 4))
	// open streams for node n, sends v1 in full and then v by top, and
	// returns what the collector keeps to answer wants.
	open := func(n string, v *stream.State) (net.Conn, []stream.Sent) {
		c := h.helloRefs(n)
		sent := stream.NewState()
		cp := *v1
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &cp, 1, true, false)})
		before := *sent
		cp = *v
		r := stream.Delta(sent, &cp, 2, false, true).ByTop(sent)
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
		return c, []stream.Sent{{Seq: 2, Prev: before, Next: *sent}}
	}
	// alive: a report with a wrong root is answered by a resync, the first
	// answer after anything the stream was asked before.
	alive := func(c net.Conn, seq uint64) *stream.Message {
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: seq, Root: 1}})
		return next(t, c)
	}
	c, recent := open("n1", v2)
	m := next(t, c)
	if m.Type != stream.TypeWant || !m.Want.Buckets || m.Want.Seq != 2 {
		t.Fatalf("an unknown top: %+v", m)
	}
	// The whole way down, answered as the collector does.
	var levels []string
	for m.Type == stream.TypeWant {
		levels = append(levels, fmt.Sprintf("buckets=%v delta=%d sums=%d", m.Want.Buckets, len(m.Want.Delta), len(m.Want.Sums)))
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)})
		m = alive(c, uint64(2+len(levels)))
	}
	if m.Type != stream.TypeResync || len(levels) != 3 {
		t.Fatalf("after the wants %v: %+v", levels, m)
	}
	h.agg.mu.Lock()
	differ := 0
	stream.ChangedKeys(h.agg.nodes["n1"].state, v2, func(string) { differ++ })
	if differ != 0 {
		t.Errorf("n1's copy after the wants differs from v2 in %d frontends", differ)
	}
	h.agg.mu.Unlock()
	// Another node showing v2 names it in one hash: asked for nothing.
	c, _ = open("n2", v2)
	if m := alive(c, 3); m.Type != stream.TypeResync {
		t.Fatalf("a known top: %+v", m)
	}

	_, sentV3 := open("n9", v3)
	names := stream.Reply(&stream.Want{Seq: 2, Buckets: true}, sentV3).Buckets
	for _, tc := range []struct {
		name, says string
		answer     *stream.Content
	}{
		{"frontends for bucket names", "frontends sent for bucket names",
			&stream.Content{Buckets: names, Frontends: []stream.Frontend{{Key: "198.19.250.1:80/TCP", Scope: "Cluster"}}}},
		{"changed frontends for bucket names", "were not asked", &stream.Content{Removed: []string{"198.19.250.1:80/TCP"}}},
		{"malformed bucket names", "malformed bucket names", &stream.Content{Buckets: "!!"}},
	} {
		c, _ := open("n3", v3)
		if m := next(t, c); m.Type != stream.TypeWant || !m.Want.Buckets {
			t.Fatalf("%s: %+v", tc.name, m)
		}
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: tc.answer})
		expect(t, c, stream.TypeReject, tc.says)
	}
	// Bucket names, then a patch of buckets that were not asked.
	c, _ = open("n3", v3)
	next(t, c)
	stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: &stream.Content{Buckets: names}})
	if m := next(t, c); m.Type != stream.TypeWant || len(m.Want.Delta) == 0 {
		t.Fatalf("after bucket names: %+v", m)
	}
	stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: &stream.Content{Refs: []stream.Ref{{Key: "nodeport:1/TCP", Sum: stream.Frontend{Key: "nodeport:1/TCP"}.Sum()}}}})
	expect(t, c, stream.TypeReject, "outside the buckets")
	// A collector that no longer has the report its top named answers
	// with nothing: the aggregator asks for a full snapshot.
	c, _ = open("n3", v3)
	next(t, c)
	stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: &stream.Content{Frontends: []stream.Frontend{}}})
	if m := next(t, c); m.Type != stream.TypeResync {
		t.Fatalf("nothing sent for bucket names: %+v", m)
	}
	h.agg.mu.Lock()
	defer h.agg.mu.Unlock()
	differ = 0
	stream.ChangedKeys(h.agg.nodes["n3"].state, v1, func(string) { differ++ })
	if differ != 0 {
		t.Errorf("n3's copy changed by refused answers: %d frontends differ from v1", differ)
	}
}

// A report is judged as of when it began to arrive, however long it then
// waits for the content it names: a new leader resolving a fleet's states
// took ten seconds and more, and a healthy node whose report waited that
// long while the cluster moved on was called stuck (2,000 nodes, after a
// takeover). Here n1 reports the cluster as it is, by a top the
// aggregator does not hold, and answers the want only after the cluster
// changed again and more than grace passed: no finding.
func TestReportJudgedAsOfItsArrival(t *testing.T) {
	const grace = time.Second
	h := start(t, grace, InsecureNoAuth{})
	c := h.helloRefs("n1")
	sent := stream.NewState()
	v1 := stream.FromModel(rules(t))
	stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, v1, 1, true, false)})
	h.until(10*time.Second, "n1 in sync", func() bool { return inSync(h, "n1") })

	drop := func(svc int) { // the service's slice loses its last endpoint
		sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Get(h.ctx, synth.ServiceName(svc)+"-0", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		sl.Endpoints = sl.Endpoints[:len(sl.Endpoints)-1]
		if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	drop(3)
	h.advance(300*time.Millisecond, nil) // the view has it; so does n1's kube-proxy
	before := *sent
	r := stream.Delta(sent, stream.FromModel(rules(t, 3)), 2, false, true).ByTop(sent)
	recent := []stream.Sent{{Seq: 2, Prev: before, Next: *sent}}
	stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
	m := next(t, c)
	if m.Type != stream.TypeWant {
		t.Fatalf("a top nobody showed: %+v", m)
	}
	arrived := h.clk.Now()
	drop(4) // n1 will follow, but its report is still waiting
	h.advance(2*grace+500*time.Millisecond, nil)
	for m != nil && m.Type == stream.TypeWant {
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)})
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if m, _, _ = stream.Read(c, 16<<20); m != nil && m.Type != stream.TypeWant {
			t.Fatalf("after the answer: %+v", m)
		}
	}
	h.eventually(5*time.Second, "the waiting report applied", func() bool {
		h.agg.mu.Lock()
		defer h.agg.mu.Unlock()
		return h.agg.nodes["n1"].lastSeq == 2
	})
	h.advance(200*time.Millisecond, nil)
	for _, f := range h.verdict().Findings {
		if f.Node == "n1" {
			t.Fatalf("n1's report, sent %s before it was applied, judged as of then: %s %s (%s)", h.clk.Since(arrived).Round(time.Millisecond), f.Kind, f.Service, f.Detail)
		}
	}
	h.agg.mu.Lock()
	heard := h.agg.nodes["n1"].heard
	h.agg.mu.Unlock()
	if !heard.Equal(arrived) {
		t.Errorf("n1's report dated %s after it arrived", heard.Sub(arrived))
	}
}

// A new leader's pool is cold: the first stream that names content it
// lacks brings it, and the others that named the same state wait for it
// and are asked for nothing more (at 2,000 nodes every stream fetching
// every frontend at once held the new leader's CPU for tens of seconds).
// A stream that waited resolves what differs in its own state as usual.
func TestColdPoolWarmedByOneStream(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	v, other := stream.FromModel(rules(t)), stream.FromModel(rules(t, 5))
	type opened struct {
		c      net.Conn
		recent []stream.Sent
	}
	open := func(node string, s *stream.State) opened {
		c := h.helloRefs(node)
		sent := stream.NewState()
		cp := *s
		r := stream.Delta(sent, &cp, 1, true, true).ByTop(sent)
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: r})
		return opened{c, []stream.Sent{{Seq: 1, Next: *sent}}}
	}
	// answer answers wants until none comes within a moment; it returns
	// the levels asked.
	answer := func(o opened) []string {
		var levels []string
		for {
			o.c.SetReadDeadline(time.Now().Add(700 * time.Millisecond))
			m, _, err := stream.Read(o.c, 16<<20)
			if err != nil {
				return levels
			}
			if m.Type != stream.TypeWant {
				t.Fatalf("unexpected %+v", m)
			}
			switch {
			case m.Want.Buckets:
				levels = append(levels, "buckets")
			case len(m.Want.Delta) > 0:
				levels = append(levels, fmt.Sprintf("delta:%d", len(m.Want.Delta)))
			default:
				levels = append(levels, fmt.Sprintf("sums:%d", len(m.Want.Sums)))
			}
			stream.Write(o.c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, o.recent)})
		}
	}
	first := open("n1", v)
	m := next(t, first.c)
	if !m.Want.Buckets {
		t.Fatalf("a top the cold pool does not hold: %+v", m)
	}
	stream.Write(first.c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, first.recent)})
	if m = next(t, first.c); len(m.Want.Delta) == 0 {
		t.Fatalf("n1, after bucket names: %+v", m)
	}
	// n1 is bringing the pool its first state. Three more nodes show the
	// same state, one a state an endpoint apart: each learns it after
	// bucket names, then waits for n1.
	levels := make([][]string, 4)
	var wg sync.WaitGroup
	for i, s := range []*stream.State{v, v, v, other} {
		o := open(fmt.Sprintf("n%d", i+2), s)
		wg.Add(1)
		go func() { defer wg.Done(); levels[i] = answer(o) }()
	}
	time.Sleep(300 * time.Millisecond) // they reach the wait
	stream.Write(first.c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, first.recent)})
	firstLevels := append([]string{"buckets", fmt.Sprintf("delta:%d", len(m.Want.Delta))}, answer(first)...)
	wg.Wait()
	t.Logf("levels asked: n1 %v, n2-n5 %v", firstLevels, levels)
	for i, l := range levels[:3] {
		if fmt.Sprint(l) != "[buckets]" {
			t.Errorf("n%d, showing n1's state, was asked %v; want only its bucket names", i+2, l)
		}
	}
	if l := fmt.Sprint(levels[3]); l != "[buckets delta:1 sums:1]" {
		t.Errorf("n5, an endpoint from n1's state, was asked %v; want the one bucket and the one frontend that differ", l)
	}
	h.agg.mu.Lock()
	defer h.agg.mu.Unlock()
	for i, want := range []*stream.State{v, v, v, v, other} {
		name := fmt.Sprintf("n%d", i+1)
		n := h.agg.nodes[name]
		differ := 0
		stream.ChangedKeys(n.state, want, func(string) { differ++ })
		if !n.complete || differ != 0 {
			t.Errorf("%s's copy: complete %v, %d frontends differ from what it showed", name, n.complete, differ)
		}
	}
}

// A stream that starts warming the cold pool and never answers holds the
// others at most warmupWait; once another stream's whole state is in, the
// pool is warm and nobody waits.
func TestColdPoolWarmerThatNeverAnswers(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	v := stream.FromModel(rules(t))
	open := func(node string) (net.Conn, []stream.Sent) {
		c := h.helloRefs(node)
		sent := stream.NewState()
		cp := *v
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &cp, 1, true, true).ByTop(sent)})
		return c, []stream.Sent{{Seq: 1, Next: *sent}}
	}
	// down answers the bucket names and returns the next want.
	down := func(c net.Conn, recent []stream.Sent) *stream.Message {
		m := next(t, c)
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)})
		return m
	}
	hostile, recent := open("n1")
	down(hostile, recent)
	if m := next(t, hostile); len(m.Want.Delta) == 0 {
		t.Fatalf("n1 after bucket names: %+v", m)
	}
	// n1 warms the pool and goes quiet. n2 waits for it, then for the
	// clock to pass warmupWait, then is asked itself.
	c2, recent2 := open("n2")
	down(c2, recent2)
	c2.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if m, _, err := stream.Read(c2, 16<<20); err == nil {
		t.Fatalf("n2 asked while n1 warms the pool: %+v", m)
	}
	h.clk.Step(warmupWait)
	m := next(t, c2)
	if len(m.Want.Delta) == 0 {
		t.Fatalf("n2 after waiting out n1: %+v", m)
	}
	for m != nil && m.Type == stream.TypeWant {
		stream.Write(c2, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent2)})
		c2.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		m, _, _ = stream.Read(c2, 16<<20)
	}
	// n2's state is in: the pool is warm though n1 never answered. n3
	// shows a state no copy holds: asked at once, without waiting.
	c3 := h.helloRefs("n3")
	sent := stream.NewState()
	cp := *stream.FromModel(rules(t, 2))
	stream.Write(c3, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &cp, 1, true, true).ByTop(sent)})
	recent3 := []stream.Sent{{Seq: 1, Next: *sent}}
	down(c3, recent3)
	if m := next(t, c3); m.Type != stream.TypeWant || len(m.Want.Delta) == 0 {
		t.Fatalf("n3 on a warm pool: %+v", m)
	}
}

// A report that arrives while its stream's goroutine waits (here for a
// cold pool's warm-up; as well for the content a report named, or the
// aggregator's lock) is dated when it arrived, not when the goroutine got
// to it: read in turn, a report behind a 14 s want cascade was dated 14 s
// late, and a healthy node looked 14 s behind (5,000 nodes, a takeover).
func TestReportsReadAheadKeepTheirArrival(t *testing.T) {
	h := start(t, 2*time.Second, InsecureNoAuth{})
	v := stream.FromModel(rules(t))
	open := func(node string) (net.Conn, *stream.State, []stream.Sent) {
		c := h.helloRefs(node)
		sent := stream.NewState()
		cp := *v
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &cp, 1, true, true).ByTop(sent)})
		m := next(t, c)
		recent := []stream.Sent{{Seq: 1, Next: *sent}}
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)})
		return c, sent, recent
	}
	n1, _, _ := open("n1") // warms the pool, never answers
	if m := next(t, n1); len(m.Want.Delta) == 0 {
		t.Fatalf("n1: %+v", m)
	}
	c, sent, recent := open("n2") // waits for n1
	time.Sleep(200 * time.Millisecond)
	h.clk.Step(time.Second)
	steady := h.clk.Now()
	same := *sent
	stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &same, 2, false, true)})
	time.Sleep(200 * time.Millisecond)
	h.clk.Step(warmupWait) // n2 stops waiting for n1 and asks itself
	for m := next(t, c); m.Type == stream.TypeWant; {
		stream.Write(c, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)})
		c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if m, _, _ = stream.Read(c, 16<<20); m == nil {
			break
		}
	}
	h.eventually(5*time.Second, "n2's steady report applied", func() bool {
		h.agg.mu.Lock()
		defer h.agg.mu.Unlock()
		return h.agg.nodes["n2"].lastSeq == 2
	})
	h.agg.mu.Lock()
	heard := h.agg.nodes["n2"].heard
	h.agg.mu.Unlock()
	if !heard.Equal(steady) {
		t.Errorf("n2's report that arrived while its stream waited is dated %s after it arrived", heard.Sub(steady))
	}
}
