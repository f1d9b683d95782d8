package aggregator

import (
	"context"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/shard"
)

// maxPartialBytes bounds a partial read from a peer: at ~1 KB per node
// status, 64 MiB is ten times the nodes a replica is sized for.
const maxPartialBytes = 64 << 20

// partialStale is how long the leader goes on using a holder's last
// partial when the holder does not answer: a replica that is gone loses
// its shards within a Lease duration, and its nodes are judged again by
// their new holder.
const partialStale = 10 * time.Second

func (a *Aggregator) sharded() bool { return a.cfg.Shards != nil }

func (a *Aggregator) shardOf(node string) int { return shard.Of(node, a.cfg.Shards.Count) }

// ownsLocked says whether this replica takes node's stream and judges
// it: the leader, or its shard's holder. a.mu held.
func (a *Aggregator) ownsLocked(node string) bool {
	if !a.sharded() {
		return a.lead.isLeading()
	}
	return a.fleet.held[a.shardOf(node)]
}

// holderOf is who takes node's stream ("" while nobody does).
func (a *Aggregator) holderOf(node string) string {
	if !a.sharded() {
		leader, _ := a.lead.now()
		return leader
	}
	return a.shardHolder(a.shardOf(node))
}

func (a *Aggregator) shardHolder(k int) string {
	if h := a.cfg.Shards.Holders(); k < len(h) {
		return h[k]
	}
	return ""
}

// HoldShard takes shard k's streams and judges its nodes until ctx ends
// (the coordinator's OnShard). When it ends (the shard given up, lost,
// or the coordinator stopping) only that shard's streams are closed, each
// sent on to the new holder when it is known, and only its nodes are
// forgotten: the rest of the replica's fleet is not touched.
func (a *Aggregator) HoldShard(ctx context.Context, k int) {
	a.mu.Lock()
	a.fleet.held[k] = true
	n := len(a.fleet.held)
	a.mu.Unlock()
	a.cfg.Metrics.ShardsHeld.Set(float64(n))
	a.cfg.Log.Info("holding a shard: taking its collectors' streams", zap.Int("shard", k), zap.Int("held", n))
	<-ctx.Done()
	a.mu.Lock()
	delete(a.fleet.held, k)
	n = len(a.fleet.held)
	var open []*conn
	for name, nd := range a.fleet.nodes {
		if a.shardOf(name) != k {
			continue
		}
		if nd.conn != nil {
			open = append(open, nd.conn)
		}
		delete(a.fleet.nodes, name)
		a.fleet.judge.Forget(name)
	}
	a.mu.Unlock()
	a.cfg.Metrics.ShardsHeld.Set(float64(n))
	holder := a.shardHolder(k)
	for _, c := range open {
		a.redirect(c, holder)
		c.Close()
	}
	a.cfg.Log.Info("shard given up: its streams handed over", zap.Int("shard", k), zap.String("holder", holder), zap.Int("streams", len(open)))
}

// Judging says whether this replica judges nodes: the leader, or (with
// shards) a replica holding some; its view's freshness then matters (the
// watch barrier runs while it does).
func (a *Aggregator) Judging() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.judgingLocked()
}

func (a *Aggregator) judgingLocked() bool { return a.lead.isLeading() || len(a.fleet.held) > 0 }

// concludeFleet is the leader's part with shards: every holder's partial
// (its own included) concluded as one verdict, the guard over the whole
// fleet, each finding dated by when the fleet's verdicts first held it.
// recovering is the leader's own view's recovery: drift is held back.
func (a *Aggregator) concludeFleet(now time.Time, prev *audit.Verdict, recovering bool) audit.Verdict {
	parts, unheard := a.gatherPartials(a.lead.context(), now)
	v, departed := a.concluder.conclude(now, parts, unheard, recovering)
	a.cfg.Metrics.ShardsUnheard.Set(float64(len(unheard)))
	if len(unheard) > 0 && (a.unheardLogged.IsZero() || now.Sub(a.unheardLogged) > time.Minute) {
		a.unheardLogged = now
		a.cfg.Log.Warn("shards without a partial verdict: their nodes are left out of the findings until a replica holding them answers",
			zap.Ints("shards", unheard), zap.Strings("holders", a.cfg.Shards.Holders()))
	}
	a.markFound(prev, &v, now)
	a.mu.Lock()
	if a.lead.isLeading() {
		a.fleet.verdict = &v
	}
	a.mu.Unlock()
	// A holder forgets the nodes it judged, but the leader remediated
	// them, whoever held them: its per-node memory must not grow with
	// node churn.
	if r := a.cfg.Remediation; r != nil {
		for _, n := range departed {
			r.Executor.Forget(n)
		}
	}
	return v
}

// heldShards lists the shards this replica holds. a.mu held.
func (a *Aggregator) heldShardsLocked() []int {
	ks := make([]int, 0, len(a.fleet.held))
	for k := range a.fleet.held {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// publishPartial keeps this replica's judgement of its shards for the
// leader to read.
func (a *Aggregator) publishPartial(p audit.Partial, shards []int) {
	a.own.Store(&PartialResponse{Replica: a.cfg.Self, Shards: shards, Partial: p})
	a.partials.publish(p, shards, a.cfg.Clock.Now())
}

// partialOf makes a Partial of the verdict decorations Evaluate made on
// the nodes this replica judged (conntrack, warnings, the hold-back after
// an outage): its nodes are v's, and the findings never held back by the
// guard (collectors missing, stale conntrack) go with the missing ones.
func partialOf(p audit.Partial, v *audit.Verdict, recovering bool) audit.Partial {
	p.Nodes = v.Nodes
	p.Missing = nil
	for _, f := range v.Findings {
		if f.Kind == audit.CollectorMissing || f.Kind == audit.StaleConntrack {
			p.Missing = append(p.Missing, f)
		}
	}
	if recovering {
		p.Drift, p.Drifted = nil, map[string]time.Time{}
	}
	return p
}

// gatherPartials reads every holder's partial (this replica's own from
// memory) and returns the parts covering each shard once, from the
// replica that holds it, and the shards no part covers. Evaluate's
// goroutine only (a.gathered).
func (a *Aggregator) gatherPartials(ctx context.Context, now time.Time) ([]audit.Partial, []int) {
	holders := a.cfg.Shards.Holders()
	distinct := map[string]bool{}
	for _, h := range holders {
		if h != "" && h != a.cfg.Self {
			distinct[h] = true
		}
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	if a.gathered == nil {
		a.gathered = map[string]gathered{}
	}
	// Each goroutine gets its own holder's copy, taken before any of them
	// starts: they write a.gathered (under mu) while this loop would
	// still be reading it.
	last := make(map[string]gathered, len(distinct))
	for h := range distinct {
		last[h] = a.gathered[h]
	}
	for h, g := range last {
		wg.Go(func() {
			resp, n, err := a.fetchPartial(ctx, h, g.mirror.query())
			if err == nil {
				if g.mirror == nil {
					g.mirror = &partialMirror{}
				}
				err = g.mirror.apply(resp)
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				a.cfg.Metrics.PartialReads.WithLabelValues("failed").Inc()
				a.cfg.Log.Warn("could not read a replica's partial verdict: its shards' nodes are shown as last read", zap.String("replica", h), zap.Error(err))
				return
			}
			kind := "full"
			if resp.Since != 0 {
				kind = "changes"
			}
			a.cfg.Metrics.PartialReads.WithLabelValues("ok").Inc()
			a.cfg.Metrics.PartialReadBytes.WithLabelValues(kind).Add(float64(n))
			a.gathered[h] = gathered{mirror: g.mirror, at: now}
		})
	}
	wg.Wait()
	if own := a.own.Load(); own != nil {
		a.gathered[a.cfg.Self] = gathered{own: own, at: now}
	}
	for h, g := range a.gathered {
		if now.Sub(g.at) > partialStale || (!distinct[h] && h != a.cfg.Self) {
			delete(a.gathered, h)
		}
	}
	var parts []audit.Partial
	var unheard []int
	take := map[string]map[int]bool{}
	for k, h := range holders {
		g, ok := a.gathered[h]
		if h == "" || !ok || !slices.Contains(g.shards(), k) {
			unheard = append(unheard, k)
			continue
		}
		if take[h] == nil {
			take[h] = map[int]bool{}
		}
		take[h][k] = true
	}
	for h, ks := range take {
		parts = append(parts, a.only(a.gathered[h].whole(), ks))
	}
	return parts, unheard
}

// only keeps the nodes of p in shards ks: during a handover two replicas
// may both still show a shard's nodes, and each node is taken once, from
// the holder the Leases name.
func (a *Aggregator) only(p audit.Partial, ks map[int]bool) audit.Partial {
	in := func(node string) bool { return ks[a.shardOf(node)] }
	out := audit.Partial{At: p.At, Drifted: map[string]time.Time{}}
	for _, n := range p.Nodes {
		if !in(n.Node) {
			continue
		}
		out.Nodes = append(out.Nodes, n)
		if n.State != audit.NodeMissing && n.State != audit.NodePending {
			out.Reporting++
		}
	}
	for _, f := range p.Missing {
		if in(f.Node) {
			out.Missing = append(out.Missing, f)
		}
	}
	for _, f := range p.Drift {
		if in(f.Node) {
			out.Drift = append(out.Drift, f)
		}
	}
	for n, t := range p.Drifted {
		if in(n) {
			out.Drifted[n] = t
		}
	}
	return out
}
