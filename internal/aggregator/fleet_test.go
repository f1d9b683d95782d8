package aggregator

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// The fleet's decisions, driven directly: no stream, no view, no clock but
// the times each step is given. What a tick returns is all it does.

// lagging has node n's collector report at `at` rules that miss a change
// made at t0 (one service lagging since then), its interval 30 s.
func lagging(f *fleet, n *node, at time.Time) {
	f.judge.Heard(n.name, audit.Heartbeat{At: at, Interval: 30 * time.Second, Mode: audit.Mode("iptables")})
	f.judge.Observe(n.name, at, at, 1, false, []audit.ServiceAssessment{{Service: "default/dns", State: audit.Lagging, Since: t0,
		Findings: []audit.Finding{{Kind: audit.StaleEndpoint, Service: "default/dns", Endpoint: "198.18.0.9:53"}}}}, audit.NewHistory(time.Minute))
	n.heard = at
}

func stateOf(v audit.Verdict, node string) audit.NodeState {
	for _, s := range v.Nodes {
		if s.Node == node {
			return s.State
		}
	}
	return ""
}

// sortedKinds is kindsOf in order, comma-separated.
func sortedKinds(v audit.Verdict) string {
	ks := strings.Fields(kindsOf(v))
	slices.Sort(ks)
	return strings.Join(ks, ",")
}

// TestTickAsksALaggingNodeOncePerCrossing: a node already 4 s behind at
// its last report, silent for its 30 s interval, is asked to read now
// when its oldest missing change crosses the grace period; once for that
// crossing, and never while the view recovers from an outage.
func TestTickAsksALaggingNodeOncePerCrossing(t *testing.T) {
	p := audit.DefaultPolicy()
	p.Grace = 10 * time.Second
	for _, recovering := range []bool{false, true} {
		t.Run(fmt.Sprintf("recovering=%v", recovering), func(t *testing.T) {
			f := newFleet(p, 0)
			c := &conn{}
			n, replaced := f.register("n1", "v1", c, stream.NewPool())
			if replaced != nil {
				t.Fatal("a first stream replaced another")
			}
			lagging(&f, n, t0.Add(4*time.Second))
			names := []string{"n1"}
			var asked []int
			for _, s := range []int{5, 9, 11, 12, 20} {
				d := f.tick(t0.Add(time.Duration(s)*time.Second), names, cycle{}, recovering)
				if st := stateOf(d.v, "n1"); st != audit.NodeLagging {
					t.Fatalf("at t0+%ds n1 is %s, want Lagging (its last report is within grace)", s, st)
				}
				if len(d.asks) > 0 {
					if d.asks[0] != c || len(d.asks) != 1 {
						t.Fatalf("at t0+%ds asked %v, want n1's stream", s, d.asks)
					}
					asked = append(asked, s)
				}
			}
			want := []int{11}
			if recovering {
				want = nil
			}
			if !slices.Equal(asked, want) {
				t.Errorf("asked at t0+%v s, want %v", asked, want)
			}
		})
	}
}

// TestTickHoldsDriftBackWhileRecovering: a node stuck past grace is
// StuckProxy; within the recovery grace after an outage, the same
// judgement shows it Lagging with no finding, and a silent node is still
// reported missing.
func TestTickHoldsDriftBackWhileRecovering(t *testing.T) {
	p := audit.DefaultPolicy()
	p.Grace = 10 * time.Second
	f := newFleet(p, 0)
	n, _ := f.register("n1", "v1", &conn{}, stream.NewPool())
	lagging(&f, n, t0.Add(15*time.Second))
	f.judge.Heard("n2", audit.Heartbeat{At: t0, Interval: time.Second})
	names := []string{"n1", "n2"}
	now := t0.Add(16 * time.Second)

	d := f.tick(now, names, cycle{}, false)
	if got, want := sortedKinds(d.v), "n1:StaleEndpoint,n1:StuckProxy,n2:CollectorMissing"; got != want {
		t.Errorf("findings %s, want %s", got, want)
	}
	if st := stateOf(d.v, "n1"); st != audit.NodeStuck {
		t.Errorf("n1 is %s, want Stuck", st)
	}
	d = f.tick(now, names, cycle{}, true)
	if got, want := sortedKinds(d.v), "n2:CollectorMissing"; got != want {
		t.Errorf("recovering: findings %s, want %s", got, want)
	}
	if st := stateOf(d.v, "n1"); st != audit.NodeLagging {
		t.Errorf("recovering: n1 is %s, want Lagging", st)
	}
}

// TestTickPrunesOnlyClosedStreamsTheJudgeForgot: a node the verdict no
// longer holds goes once its stream is closed, and is returned to be
// forgotten by the repairs; one whose stream is open stays, whatever the
// judge says.
func TestTickPrunesOnlyClosedStreamsTheJudgeForgot(t *testing.T) {
	f := newFleet(audit.DefaultPolicy(), 0)
	pool := stream.NewPool()
	f.register("open", "v1", &conn{}, pool)
	closed, _ := f.register("closed", "v1", &conn{}, pool)
	closed.conn = nil
	d := f.tick(t0, nil, cycle{}, false)
	if !slices.Equal(d.gone, []string{"closed"}) {
		t.Errorf("pruned %v, want [closed]", d.gone)
	}
	if _, ok := f.nodes["closed"]; ok {
		t.Error("the pruned node is still in the fleet")
	}
	if _, ok := f.nodes["open"]; !ok {
		t.Error("a node with an open stream was pruned")
	}
}

// TestTickJudgesOnlyTheShardsHeld: a sharded fleet judges the expected
// nodes of the shards this replica holds, and returns them as its partial.
func TestTickJudgesOnlyTheShardsHeld(t *testing.T) {
	const shards = 4
	f := newFleet(audit.DefaultPolicy(), shards)
	mine := shard.Of("n1", shards)
	f.held[mine] = true
	var other string
	for i := 2; other == ""; i++ {
		if name := fmt.Sprintf("n%d", i); shard.Of(name, shards) != mine {
			other = name
		}
	}
	d := f.tick(t0, []string{"n1", other}, cycle{}, false)
	if len(d.v.Nodes) != 1 || d.v.Nodes[0].Node != "n1" || len(d.part.Nodes) != 1 {
		t.Errorf("judged %+v (partial %+v), want n1 alone", d.v.Nodes, d.part.Nodes)
	}
}

// TestRegisterStartsTheNodeAfresh: a node's new stream replaces its
// previous one, which is returned to be closed, and its copy of the rules
// starts empty: the sequence, completeness and unjudged rules of the old
// stream do not carry over.
func TestRegisterStartsTheNodeAfresh(t *testing.T) {
	f := newFleet(audit.DefaultPolicy(), 0)
	pool := stream.NewPool()
	first, second := &conn{}, &conn{}
	n, _ := f.register("n1", "v1", first, pool)
	n.lastSeq, n.complete, n.before = 7, true, []shown{{at: t0}}
	again, replaced := f.register("n1", "v2", second, pool)
	if again != n || replaced != first {
		t.Fatalf("register returned %p and %p, want the same node and the first stream", again, replaced)
	}
	if n.conn != second || n.lastSeq != 0 || n.complete || n.before != nil || n.collectorVersion != "v2" {
		t.Errorf("the node kept its old stream's state: %+v", n)
	}
}

// TestReceivedChecksAReportAgainstTheNodesRecord: a report is refused when
// its stream was superseded or is no longer this replica's, when it does
// not come after the last (but for the one a want resumes), or when what
// it says besides the rules is invalid, and then nothing of it is kept;
// else its sequence, conntrack counts and cleaned read error are.
func TestReceivedChecksAReportAgainstTheNodesRecord(t *testing.T) {
	f := newFleet(audit.DefaultPolicy(), 0)
	c := &conn{}
	n, _ := f.register("n1", "v1", c, stream.NewPool())
	steps := []struct {
		what    string
		c       *conn
		owns    bool
		r       stream.Report
		resumed bool
		want    RejectReason
	}{
		{"the first report", c, true, stream.Report{Seq: 1, ReadError: "\x1b[2Jcannot read"}, false, ""},
		{"a replay", c, true, stream.Report{Seq: 1}, false, ReasonReplay},
		{"the report a want resumes", c, true, stream.Report{Seq: 1}, true, ""},
		{"an older one", c, true, stream.Report{Seq: 0}, true, ReasonReplay},
		{"another stream's", &conn{}, true, stream.Report{Seq: 2}, false, ReasonProtocol},
		{"a shard given up", c, false, stream.Report{Seq: 2}, false, ReasonProtocol},
		{"bad conntrack counts", c, true, stream.Report{Seq: 2, Conntrack: &stream.Conntrack{Entries: -1}}, false, ReasonInvalid},
		{"good ones", c, true, stream.Report{Seq: 3, Conntrack: &stream.Conntrack{Entries: 7}}, false, ""},
	}
	for _, s := range steps {
		r, seq := s.r, n.lastSeq
		if got, why := f.received(n, s.c, s.owns, &r, s.resumed); got != s.want {
			t.Fatalf("%s: %q (%s), want %q", s.what, got, why, s.want)
		}
		if s.want != "" && n.lastSeq != seq {
			t.Errorf("%s: refused, and yet its sequence %d was kept", s.what, n.lastSeq)
		}
		if s.what == "the first report" && (strings.Contains(r.ReadError, "\x1b") || !strings.Contains(r.ReadError, "cannot read")) {
			t.Errorf("the read error kept raw: %q", r.ReadError)
		}
	}
	if n.lastSeq != 3 || n.conntrack == nil || n.conntrack.Entries != 7 {
		t.Errorf("kept seq %d, conntrack %+v; want 3 and 7 entries (the refused reports left nothing)", n.lastSeq, n.conntrack)
	}
}
