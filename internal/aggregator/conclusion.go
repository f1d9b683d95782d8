// How an evaluation's judgement of the nodes becomes the fleet's verdict:
// the one replica's own, or (with shards) each holder's partial and the
// leader's conclusion over all of them.

package aggregator

import (
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// conclusion is what becomes of an evaluation's decision (fleet.tick,
// which judged the nodes this replica holds), depending on whether the
// fleet is sharded; Evaluate calls its methods in this order.
type conclusion interface {
	// publishLocked hands this replica's verdict on (v as the tick
	// decided it; prev the last verdict) and releases a.mu.
	publishLocked(now time.Time, prev, v *audit.Verdict, part audit.Partial, recovering bool)
	// forget: node left the fleet and was pruned.
	forget(node string)
	// fleet is the fleet's verdict, when this replica concludes it (v
	// itself, when it is the fleet's: a.fleet.verdict may point to it,
	// so it is never written again).
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
