// Conntrack in the evaluation: each node's counts judged against the
// history, and the findings put into the verdict.

package aggregator

import (
	"github.com/proxyaudit/proxyaudit/audit"
)

// judgeConntrack judges every node's last conntrack counts against the
// history (the caller holds the view), and says whose could not be read.
// Evaluations come every second and counts every --conntrack-interval: a
// node's judgement is reused while its counts and the history are the
// same, for a quarter of grace (the latest a stale flow is found past
// grace), so a fleet of steady nodes costs a map lookup each.
func (a *Aggregator) judgeConntrack(h *audit.History, errs map[string]string) []audit.TimedFinding {
	type one struct {
		n    *node
		ct   *audit.Conntrack
		mode audit.Mode
	}
	now, seq := a.cfg.Clock.Now(), h.TouchSeq()
	var out []audit.TimedFinding
	var todo []one
	a.mu.Lock()
	for _, n := range a.fleet.nodes {
		if n.conntrackErr != "" {
			errs[n.name] = n.conntrackErr
		}
		if n.conntrack == nil || !n.complete {
			continue
		}
		if n.ctJudgedFor == n.conntrack && n.ctJudgedSeq == seq && now.Sub(n.ctJudgedAt) < a.cfg.Policy.Grace/4 {
			out = append(out, n.ctJudged...)
			continue
		}
		todo = append(todo, one{n, n.conntrack, audit.Mode(n.state.Mode)})
	}
	a.mu.Unlock()
	for _, o := range todo {
		fs := audit.JudgeConntrack(o.n.name, o.ct, h, o.mode, now, a.cfg.Policy.Grace)
		out = append(out, fs...)
		a.mu.Lock()
		o.n.ctJudged, o.n.ctJudgedFor, o.n.ctJudgedSeq, o.n.ctJudgedAt = fs, o.ct, seq, now
		a.mu.Unlock()
	}
	return out
}
