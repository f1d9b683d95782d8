package aggregator

import (
	"fmt"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
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

// TestTopsOverRealCollectors: real collector clients name each new state
// by its top; the first node to show a state is asked one level down at a
// time, every node showing it after that costs one hash, and no copy ever
// disagrees with its collector (no resync).
func TestTopsOverRealCollectors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
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
			nd := h.agg.fleet.nodes[n]
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
		old := h.agg.fleet.nodes["n1"].conn
		old.Close()
		h.agg.mu.Unlock()
		h.until(30*time.Second, "n1 streaming again with its copy whole", func() bool {
			h.agg.mu.Lock()
			nd := h.agg.fleet.nodes["n1"]
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
		if !h.agg.fleet.nodes["n1"].state.Same(h.agg.fleet.nodes["n2"].state) || !h.agg.fleet.nodes["n2"].state.Same(h.agg.fleet.nodes["n3"].state) {
			t.Error("nodes showing the same rules do not share their buckets")
		}
	})
}

// A report is judged as of when it began to arrive, however long it then
// waits for the content it names: a new leader resolving a fleet's states
// took ten seconds and more, and a healthy node whose report waited that
// long while the cluster moved on was called stuck (2,000 nodes, after a
// takeover). Here n1 reports the cluster as it is, by a top the
// aggregator does not hold, and answers the want only after the cluster
// changed again and more than grace passed: no finding.
func TestReportJudgedAsOfItsArrival(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const grace = time.Second
		h := start(t, grace, auth.InsecureNoAuth{})
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
			return h.agg.fleet.nodes["n1"].lastSeq == 2
		})
		h.advance(200*time.Millisecond, nil)
		for _, f := range h.verdict().Findings {
			if f.Node == "n1" {
				t.Fatalf("n1's report, sent %s before it was applied, judged as of then: %s %s (%s)", h.clk.Since(arrived).Round(time.Millisecond), f.Kind, f.Service, f.Detail)
			}
		}
		h.agg.mu.Lock()
		heard := h.agg.fleet.nodes["n1"].heard
		h.agg.mu.Unlock()
		if !heard.Equal(arrived) {
			t.Errorf("n1's report dated %s after it arrived", heard.Sub(arrived))
		}
	})
}

// A report that arrives while its stream's goroutine waits (here for a
// cold pool's warm-up; as well for the content a report named, or the
// aggregator's lock) is dated when it arrived, not when the goroutine got
// to it: read in turn, a report behind a 14 s want cascade was dated 14 s
// late, and a healthy node looked 14 s behind (5,000 nodes, a takeover).
func TestReportsReadAheadKeepTheirArrival(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, auth.InsecureNoAuth{})
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
		synctest.Wait()
		h.clk.Step(time.Second)
		steady := h.clk.Now()
		same := *sent
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(sent, &same, 2, false, true)})
		synctest.Wait()        // read ahead while the goroutine waits
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
			return h.agg.fleet.nodes["n2"].lastSeq == 2
		})
		h.agg.mu.Lock()
		heard := h.agg.fleet.nodes["n2"].heard
		h.agg.mu.Unlock()
		if !heard.Equal(steady) {
			t.Errorf("n2's report that arrived while its stream waited is dated %s after it arrived", heard.Sub(steady))
		}
	})
}
