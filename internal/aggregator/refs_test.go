package aggregator

import (
	"net"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/proxyaudit/proxyaudit/internal/stream"
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
