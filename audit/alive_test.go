package audit

import (
	"testing"
	"time"
)

// A collector whose reports wait behind a fleet's worth of others (the
// leader is behind) is alive, not missing; one not heard from at all is.
func TestAliveIsNotMissing(t *testing.T) {
	p := DefaultPolicy()
	j := NewJudge(p)
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	for _, n := range []string{"waiting", "silent"} {
		j.Heard(n, Heartbeat{At: t0, Interval: 10 * time.Second})
	}
	// Both reported at t0; for two minutes only "waiting" has reports
	// arriving, none judged yet.
	for at := t0.Add(10 * time.Second); at.Before(t0.Add(2 * time.Minute)); at = at.Add(10 * time.Second) {
		j.Alive("waiting", at)
	}
	v := j.Evaluate(t0.Add(2*time.Minute), []string{"waiting", "silent"})
	missing := map[string]bool{}
	for _, f := range v.Findings {
		if f.Kind == CollectorMissing {
			missing[f.Node] = true
		}
	}
	if missing["waiting"] {
		t.Error("a collector whose reports wait to be judged was called missing")
	}
	if !missing["silent"] {
		t.Error("a collector not heard from for two minutes was not called missing")
	}
	// Heard from before its first report was judged: pending, not missing.
	j.Alive("new", t0.Add(2*time.Minute))
	v = j.Evaluate(t0.Add(2*time.Minute+time.Second), []string{"waiting", "silent", "new"})
	for _, s := range v.Nodes {
		if s.Node == "new" && s.State != NodePending {
			t.Errorf("a node heard from, its first report not judged yet: %s, want %s", s.State, NodePending)
		}
	}
}
