package aggregator

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// Evaluate assesses every node that reported since the last call and
// concludes; the loop in Run calls it every second. How the judgement of
// the nodes becomes the fleet's verdict is the conclusion's (alone: it is
// the verdict; with shards, each replica judges the nodes of the shards it
// holds and publishes that partial verdict, and the leader reads every
// holder's and concludes for the fleet).
func (a *Aggregator) Evaluate() {
	if !a.Judging() || a.view.Synced() != nil || a.blind() {
		return
	}
	start := a.cfg.Clock.Now()
	c := a.judgeReports(start)
	names := a.view.ExpectedNodes()
	con := a.conclusion()
	a.mu.Lock()
	if !a.judgingLocked() {
		a.mu.Unlock()
		return
	}
	now := a.cfg.Clock.Now()
	recovering := now.Before(a.Recovering())
	d := a.fleet.tick(now, names, c, recovering)
	prev := a.fleet.verdict
	con.publishLocked(now, prev, &d.v, d.part, recovering) // releases a.mu
	a.askReadNow(d.asks)
	for _, name := range d.gone {
		a.cfg.Metrics.NoRulesSeen.DeleteLabelValues(name)
		con.forget(name)
	}
	fv, ok := con.fleet(now, prev, &d.v, recovering)
	if !ok {
		// A shard holder only: the leader concludes.
		a.cfg.Metrics.Reconcile.WithLabelValues("evaluate").Observe(a.cfg.Clock.Since(start).Seconds())
		return
	}
	a.finish(start, c, prev, fv, recovering)
}

// finish publishes the fleet's verdict v: metrics, the log of what
// changed, and (unless drift is held back after an outage) remediation and
// the reports.
func (a *Aggregator) finish(start time.Time, c cycle, prev, v *audit.Verdict, recovering bool) {
	a.cfg.Metrics.setVerdict(v)
	took := a.cfg.Clock.Since(start)
	a.cfg.Metrics.Reconcile.WithLabelValues("evaluate").Observe(took.Seconds())
	if took > slowEvaluation {
		a.cfg.Log.Warn("slow evaluation: every finding waits for it", zap.Duration("took", took), zap.Int("reports_judged", c.jobs),
			zap.Int("nodes", len(v.Nodes)), zap.Duration("cluster_state_held_after", c.held), zap.Duration("assessed_after", c.assessedAt))
	}
	a.logChanges(prev, v)
	if !recovering {
		a.handOff(v)
		if a.cfg.Reports != nil {
			a.cfg.Reports.Offer(a.lead.context(), v)
		}
	}
}

// judgeReports judges, under the view's read lock, every report the
// cluster state now covers (see View.Covered; a later cycle takes the
// rest), and every node's conntrack counts.
func (a *Aggregator) judgeReports(start time.Time) cycle {
	c := cycle{ctErrs: map[string]string{}}
	covered := a.view.Covered()
	a.view.Read(func(st *audit.State, h *audit.History, gen uint64) {
		c.held = a.cfg.Clock.Since(start)
		c.nodeInfo, c.families = st.Nodes, audit.ServiceFamilies(st)
		a.mu.Lock()
		jobs := a.fleet.due(covered, gen)
		a.mu.Unlock()
		c.jobs = len(jobs)
		a.assessor.startGeneration(st, h, gen)
		services := servicesProgrammed(st)
		for _, j := range jobs {
			as := j.n.assessments
			if !j.reuse {
				as = a.assessor.assessNode(st, h, j.n, &j.snap)
			}
			a.mu.Lock()
			j.n.assessments = as
			lags := a.fleet.judge.Observe(j.n.name, j.at, j.shown, services, j.noRule, as, h)
			a.mu.Unlock()
			for _, l := range lags {
				a.cfg.Metrics.ProgrammingLag.Observe(max(l, 0).Seconds())
			}
		}
		c.stale = a.judgeConntrack(h, c.ctErrs)
		c.assessedAt = a.cfg.Clock.Since(start)
	})
	return c
}

// askReadNow sends each read-now request on its own: a collector slow to
// read its socket must not hold up the evaluation (a write may wait out
// its 10 s deadline).
func (a *Aggregator) askReadNow(asks []*conn) {
	for _, c := range asks {
		go func() {
			a.cfg.Metrics.sent(c.send(&stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "a change is crossing the grace period"}}))
		}()
		a.cfg.Metrics.ReadNow.Inc()
	}
}

// handOff gives a verdict to the remediation rounds. They run one at a
// time beside the evaluations, each on the newest verdict (one a round
// did not get to is replaced, never queued): a round makes API calls for
// every drifting node (its kube-proxy pod, Events, the incident record,
// pages), and run inside the evaluation it held every finding back. At
// 5,000 simulated nodes with 50 stuck, a round took up to 30 s and the
// verdict did not move meanwhile.
func (a *Aggregator) handOff(v *audit.Verdict) {
	a.repair.Lock()
	defer a.repair.Unlock()
	a.repair.next = v
	if a.repair.running {
		return
	}
	a.repair.running = true
	go func() {
		for {
			a.repair.Lock()
			v := a.repair.next
			a.repair.next = nil
			if v == nil {
				a.repair.running = false
				a.repair.Unlock()
				return
			}
			a.repair.Unlock()
			start := a.cfg.Clock.Now()
			a.remediate(v)
			a.cfg.Metrics.Reconcile.WithLabelValues("remediate").Observe(a.cfg.Clock.Since(start).Seconds())
		}
	}()
}

// slowEvaluation is how long an evaluation cycle (every second) may take
// before it is logged: findings are published only at its end.
const slowEvaluation = 2 * time.Second

// findingKey names a finding across verdicts.
func findingKey(f audit.TimedFinding) string {
	return f.Node + "|" + f.Service + "|" + f.Port + "|" + string(f.Kind) + "|" + f.Endpoint
}

// markFound dates each finding of cur by when a verdict first held it: a
// finding prev held keeps its time; a new one is found now, and how long
// after its condition began goes to proxyaudit_finding_delay_seconds. A
// finding that cleared and came back is found again.
func (a *Aggregator) markFound(prev, cur *audit.Verdict, now time.Time) {
	found := map[string]time.Time{}
	if prev != nil {
		for _, f := range prev.Findings {
			found[findingKey(f)] = f.Found
		}
	}
	for i := range cur.Findings {
		f := &cur.Findings[i]
		if at, ok := found[findingKey(*f)]; ok && !at.IsZero() {
			f.Found = at
			continue
		}
		f.Found = now
		a.cfg.Metrics.FindingDelay.WithLabelValues(string(f.Kind)).Observe(max(now.Sub(f.Since), 0).Seconds())
	}
}

// logChanges logs findings that appeared or cleared since the last verdict.
func (a *Aggregator) logChanges(prev, cur *audit.Verdict) {
	old := map[string]bool{}
	if prev != nil {
		for _, f := range prev.Findings {
			old[findingKey(f)] = true
		}
	}
	now := map[string]bool{}
	for _, f := range cur.Findings {
		now[findingKey(f)] = true
		if !old[findingKey(f)] {
			a.cfg.Log.Warn("finding", zap.String("node", f.Node), zap.String("kind", string(f.Kind)), zap.String("service", f.Service),
				zap.String("port", f.Port), zap.String("endpoint", f.Endpoint), zap.Time("since", f.Since), zap.String("detail", f.Detail))
		}
	}
	if prev != nil {
		for _, f := range prev.Findings {
			if !now[findingKey(f)] {
				a.cfg.Log.Info("finding cleared", zap.String("node", f.Node), zap.String("kind", string(f.Kind)), zap.String("service", f.Service), zap.String("endpoint", f.Endpoint))
			}
		}
	}
}

// Run evaluates every second until ctx ends.
func (a *Aggregator) Run(ctx context.Context) {
	t := a.cfg.Clock.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			a.announcePeers()
			a.Evaluate()
		}
	}
}

// servicesProgrammed counts the services kube-proxy programs (not skipped).
func servicesProgrammed(st *audit.State) int {
	n := 0
	for i := range st.Services {
		if st.Services[i].Skip == "" {
			n++
		}
	}
	return n
}

// blind checks the view's freshness. A stale view is not judged from:
// kube-proxies whose watches work would look drifted against it (false
// findings) and repairs would act on them. The last verdict stays, marked
// stale, and one notice goes out when it starts and one when it ends.
func (a *Aggregator) blind() bool {
	since, why := a.view.Stale()
	stale, changed := a.health.observe(since, why, a.cfg.Clock.Now(), a.cfg.RecoveryGrace)
	a.cfg.Metrics.ViewStale.Set(map[bool]float64{true: 1}[stale])
	if !changed {
		return stale
	}
	n := remediate.Notice{Action: remediate.Action{Kind: remediate.ViewFresh, Node: remediate.SelfNode,
		Reason: "the aggregator's watches deliver again; judging resumes (a drift shows after the grace period)"}}
	if stale {
		staleSince, staleWhy := a.health.stale()
		a.cfg.Log.Error("view of the API is stale: findings are unknown, nothing is judged or repaired", zap.Time("since", staleSince), zap.String("why", staleWhy))
		n = remediate.Notice{Action: remediate.Action{Kind: remediate.ViewStale, Node: remediate.SelfNode, Reason: staleWhy}, Since: staleSince}
	} else {
		a.cfg.Log.Info("view of the API is fresh again: judging resumes; node drift held back while kube-proxies reconnect",
			zap.Duration("recovery_grace", a.cfg.RecoveryGrace))
	}
	if a.cfg.Notifier != nil {
		a.cfg.Notifier.Notify(n)
	}
	return stale
}
