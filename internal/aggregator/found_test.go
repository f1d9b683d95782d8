package aggregator

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
)

// TestFindingsKeepWhenFound: a finding is dated by the first verdict that
// held it, whatever later verdicts recompute; one that cleared and came
// back is found again, and each first publication is measured once.
func TestFindingsKeepWhenFound(t *testing.T) {
	a := New(Config{}, &view.View{})
	since := t0.Add(-40 * time.Second)
	stale := audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "n1", Service: "ns/a", Port: "http", Kind: audit.StaleEndpoint, Endpoint: "198.18.0.7:80"}}
	stuck := audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "n1", Kind: audit.StuckProxy, Detail: "up to 31s ago"}}
	verdict := func(fs ...audit.TimedFinding) *audit.Verdict { return &audit.Verdict{Findings: fs} }
	v1 := verdict(stale)
	a.markFound(nil, v1, t0)
	if got := v1.Findings[0].Found; !got.Equal(t0) {
		t.Fatalf("a new finding is found now: got %s", got)
	}
	// The judge recomputes it with another detail a second later: same
	// finding, same time found; a new one beside it is found then.
	stuck2 := stuck
	stuck2.Detail = "up to 32s ago"
	v2 := verdict(stale, stuck2)
	a.markFound(v1, v2, t0.Add(time.Second))
	if !v2.Findings[0].Found.Equal(t0) || !v2.Findings[1].Found.Equal(t0.Add(time.Second)) {
		t.Fatalf("found %s and %s, want %s and %s", v2.Findings[0].Found, v2.Findings[1].Found, t0, t0.Add(time.Second))
	}
	// Cleared, then back: found again.
	v3 := verdict(stuck2)
	a.markFound(v2, v3, t0.Add(2*time.Second))
	v4 := verdict(stale, stuck2)
	a.markFound(v3, v4, t0.Add(3*time.Second))
	if !v4.Findings[0].Found.Equal(t0.Add(3*time.Second)) || !v4.Findings[1].Found.Equal(t0.Add(time.Second)) {
		t.Fatalf("after clearing and coming back: found %s and %s", v4.Findings[0].Found, v4.Findings[1].Found)
	}
	// Two first publications of the StaleEndpoint and one of the
	// StuckProxy, each measured from its since.
	count := func(k audit.Kind) (n uint64, sum float64) {
		var m dto.Metric
		if err := a.cfg.Metrics.FindingDelay.WithLabelValues(string(k)).(prometheus.Metric).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
	}
	if n, sum := count(audit.StaleEndpoint); n != 2 || sum != 40+43 {
		t.Errorf("StaleEndpoint delays: %d observations summing to %.0f s, want 2 (40 s and 43 s)", n, sum)
	}
	if n, sum := count(audit.StuckProxy); n != 1 || sum != 41 {
		t.Errorf("StuckProxy delays: %d observations summing to %.0f s, want 1 (41 s)", n, sum)
	}
}

func TestHoldBackDriftKeepsOnlyCollectorMissing(t *testing.T) {
	v := audit.Verdict{
		Findings: []audit.TimedFinding{
			{Finding: audit.Finding{Node: "a", Kind: audit.StuckProxy}},
			{Finding: audit.Finding{Node: "a", Kind: audit.StaleEndpoint}},
			{Finding: audit.Finding{Node: "b", Kind: audit.CollectorMissing}},
			{Finding: audit.Finding{Node: "c", Kind: audit.NoRules}},
		},
		Nodes: []audit.NodeStatus{{Node: "a", State: audit.NodeStuck}, {Node: "b", State: audit.NodeMissing},
			{Node: "c", State: audit.NodeNoRules}, {Node: "d", State: audit.NodeInSync}},
	}
	h := holdBackDrift(v)
	if len(h.Findings) != 1 || h.Findings[0].Kind != audit.CollectorMissing {
		t.Errorf("findings held back: %+v", h.Findings)
	}
	want := []audit.NodeState{audit.NodeLagging, audit.NodeMissing, audit.NodeLagging, audit.NodeInSync}
	for i, n := range h.Nodes {
		if n.State != want[i] {
			t.Errorf("%s: %s, want %s", n.Node, n.State, want[i])
		}
	}
	if v.Nodes[0].State != audit.NodeStuck {
		t.Error("holdBackDrift changed its input")
	}
}
