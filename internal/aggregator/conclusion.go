// How an evaluation's judgement of the nodes becomes the fleet's verdict:
// the one replica's own, or (with shards) each holder's partial and the
// leader's conclusion over all of them.

package aggregator

import (
	"slices"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// conclusion is the part of an evaluation that depends on whether the
// fleet is sharded; Evaluate calls its methods in this order.
type conclusion interface {
	// judgeLocked judges the expected nodes this replica concludes for
	// (a.mu held).
	judgeLocked(now time.Time, names []string) (audit.Verdict, audit.Partial)
	// publishLocked hands this replica's verdict on (v as Evaluate
	// decorated it; prev the last verdict) and releases a.mu.
	publishLocked(now time.Time, prev, v *audit.Verdict, part audit.Partial, recovering bool)
	// forget: node left the fleet and was pruned.
	forget(node string)
	// fleet is the fleet's verdict, when this replica concludes it (v
	// itself, when it is the fleet's: a.fleet.verdict may point to it, so it
	// is never written again).
	fleet(now time.Time, prev, v *audit.Verdict, recovering bool) (*audit.Verdict, bool)
}

func (a *Aggregator) conclusion() conclusion {
	if a.sharded() {
		return shardedConclusion{a}
	}
	return aloneConclusion{a}
}

// aloneConclusion: one replica judges every node; its verdict is the
// fleet's.
type aloneConclusion struct{ a *Aggregator }

func (c aloneConclusion) judgeLocked(now time.Time, names []string) (audit.Verdict, audit.Partial) {
	return c.a.fleet.judge.Evaluate(now, names), audit.Partial{}
}

func (c aloneConclusion) publishLocked(now time.Time, prev, v *audit.Verdict, _ audit.Partial, _ bool) {
	c.a.markFound(prev, v, now)
	c.a.fleet.verdict = v
	c.a.mu.Unlock()
}

func (c aloneConclusion) forget(node string) {
	if r := c.a.cfg.Remediation; r != nil {
		r.Executor.Forget(node)
	}
}

func (aloneConclusion) fleet(_ time.Time, _, v *audit.Verdict, _ bool) (*audit.Verdict, bool) {
	return v, true
}

// shardedConclusion: each replica judges the nodes of the shards it holds
// and publishes that partial verdict; the leader reads every holder's and
// concludes (concludeFleet), and forgets from the fleet's verdict.
type shardedConclusion struct{ a *Aggregator }

func (c shardedConclusion) judgeLocked(now time.Time, names []string) (audit.Verdict, audit.Partial) {
	var mine []string // names is the view's own: not filtered in place
	for _, n := range names {
		if c.a.fleet.held[c.a.shardOf(n)] {
			mine = append(mine, n)
		}
	}
	part := c.a.fleet.judge.JudgeNodes(now, mine)
	return audit.Verdict{At: now, Nodes: part.Nodes, Findings: append(slices.Clone(part.Missing), part.Drift...)}, part
}

func (c shardedConclusion) publishLocked(_ time.Time, _, v *audit.Verdict, part audit.Partial, recovering bool) {
	shards := c.a.heldShardsLocked()
	c.a.mu.Unlock()
	c.a.publishPartial(partialOf(part, v, recovering), shards)
}

func (shardedConclusion) forget(string) {}

func (c shardedConclusion) fleet(now time.Time, prev, _ *audit.Verdict, recovering bool) (*audit.Verdict, bool) {
	if !c.a.lead.isLeading() {
		return nil, false
	}
	v := c.a.concludeFleet(now, prev, recovering)
	return &v, true
}
