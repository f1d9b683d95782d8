// Conntrack in the evaluation: each node's counts judged against the
// history, and the findings put into the verdict.

package aggregator

import (
	"slices"

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

// addConntrack puts the StaleConntrack findings of nodes whose collector
// is heard (a silent one's counts are old) into the verdict, counts each
// node's stale flows, and warns of tables that could not be read. They
// change no node's state: a node's rules may be right while the kernel
// remembers old decisions, and restarting kube-proxy is not the repair.
func addConntrack(v *audit.Verdict, stale []audit.TimedFinding, errs map[string]string) {
	idx := map[string]int{}
	for i, n := range v.Nodes {
		if n.State != audit.NodeMissing && n.State != audit.NodePending {
			idx[n.Node] = i
		}
	}
	added := false
	for _, f := range stale {
		i, ok := idx[f.Node]
		if !ok {
			continue
		}
		if !added {
			// The judge's slices are shared with its later verdicts.
			v.Nodes, v.Findings = slices.Clone(v.Nodes), slices.Clone(v.Findings)
			added = true
		}
		v.Findings = append(v.Findings, f)
		v.Nodes[i].StaleFlows += f.Flows
	}
	for node, err := range errs {
		if i, ok := idx[node]; ok {
			if !added {
				v.Nodes, v.Findings = slices.Clone(v.Nodes), slices.Clone(v.Findings)
				added = true
			}
			v.Nodes[i].Warnings = append(slices.Clone(v.Nodes[i].Warnings), "conntrack could not be read, stale flows are not audited: "+err)
		}
	}
	if added {
		audit.SortTimed(v.Findings)
	}
}
