package aggregator

import (
	"context"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
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
	v, part := con.judgeLocked(now, names)
	addConntrack(&v, c.stale, c.ctErrs)
	gone := a.pruneLocked(&v)
	audit.WarnKnownBad(&v, c.nodeInfo)
	a.warnUnauditedLocked(&v, c.families)
	recovering := now.Before(a.Recovering())
	if recovering {
		v = holdBackDrift(v)
	}
	asks := a.readNowDue(now, &v, recovering)
	prev := a.verdict
	con.publishLocked(now, prev, &v, part, recovering) // releases a.mu
	a.askReadNow(asks)
	for _, name := range gone {
		a.cfg.Metrics.NoRulesSeen.DeleteLabelValues(name)
		con.forget(name)
	}
	fv, ok := con.fleet(now, prev, &v, recovering)
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
			a.cfg.Reports.Offer(a.leadContext(), v)
		}
	}
}

// cycle is what an evaluation's judgement of the reports leaves for its
// conclusion.
type cycle struct {
	nodeInfo         map[string]audit.NodeInfo
	families         []int // the IP families the cluster has services in
	stale            []audit.TimedFinding
	ctErrs           map[string]string
	jobs             int
	held, assessedAt time.Duration // for a slow cycle's log
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
		jobs := a.dueLocked(covered, gen)
		a.mu.Unlock()
		c.jobs = len(jobs)
		a.startGeneration(st, h, gen)
		services := servicesProgrammed(st)
		for _, j := range jobs {
			as := j.n.assessments
			if !j.reuse {
				as = a.assessNode(st, h, j.n, &j.snap)
			}
			a.mu.Lock()
			j.n.assessments = as
			lags := a.judge.Observe(j.n.name, j.at, j.shown, services, j.noRule, as, h)
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
			a.sent(c.send(&stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "a change is crossing the grace period"}}))
		}()
		a.cfg.Metrics.ReadNow.Inc()
	}
}

// job is one node's report due for judgement: its rules as of at.
type job struct {
	n         *node
	snap      stream.State // a copy: its buckets are immutable
	at, shown time.Time
	reuse     bool // the node's assessment of its last judgement stands
	noRule    bool
}

// dueLocked picks the reports the view now covers (a.mu held), each to
// be judged as of the time it shows; gen is the cluster state's
// generation. A node's jobs come in the order its reports came: the rules
// earlier reports showed that no judgement reached (node.before), then its
// latest.
func (a *Aggregator) dueLocked(covered time.Time, gen uint64) []job {
	var jobs []job
	for _, n := range a.nodes {
		if !n.fresh || !n.complete {
			continue
		}
		// Rules earlier reports showed: judged first, each as of its own
		// time when the view covers it (else as of the covered time, and
		// again next cycle), so that a drift is dated when the node first
		// showed it, and when the latest report is newer than the view.
		kept := n.before[:0]
		for _, b := range n.before {
			if at, ok := judgeAt(b.at, b.since, n.judged, covered); ok {
				jobs = append(jobs, a.jobLocked(n, &b.state, b.version, b.noRules, b.since, at, gen))
				n.judged = at
			}
			if b.at.After(n.judged) {
				kept = append(kept, b) // not judged as of its time yet
			}
		}
		clear(n.before[len(kept):])
		n.before = kept
		if len(kept) > 0 {
			continue // the latest report's turn comes after theirs
		}
		if at, ok := judgeAt(n.heard, n.shownSince, n.judged, covered); ok {
			jobs = append(jobs, a.jobLocked(n, n.state, n.version, n.noRules, n.shownSince, at, gen))
			// Judged as of an earlier time than the latest report: its
			// turn comes.
			n.fresh, n.judged = !at.Equal(n.heard), at
		}
	}
	return jobs
}

// jobLocked is node n's rules (of the given version) due for judgement as
// of at; their assessment is reused when neither they nor the cluster
// state (gen) moved since it was made.
func (a *Aggregator) jobLocked(n *node, rules *stream.State, version uint64, noRules bool, shownSince, at time.Time, gen uint64) job {
	j := job{n: n, at: at, shown: shownSince, noRule: noRules}
	if n.assessedVersion == version && n.assessedGen == gen {
		j.reuse = true
	} else {
		j.snap = *rules
		n.assessedVersion, n.assessedGen = version, gen
	}
	return j
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

// judgeAt says as of when a node's report can be judged, given the
// time covered up to which the view holds every change (View.Covered):
// the report's own time once covered; before that, the covered time
// itself, when the node already showed the same rules then (from
// shownSince to its report). Never as of a time a judgement already
// passed, nor after the report. Rules shown over a span lag at its end at
// least as much as anywhere in it, so judging them earlier never finds
// more than the report would.
//
// Without the second case a node that reports more often than the view
// catches up waited for a report that happened to fall before the
// covered time, and the next report moved it on again: under churn (the
// view trails by a second or two) a stuck node reporting every 2 s, its
// rules never changing, was found 15-45 s after grace in the fleet
// simulation instead of 1-3 s, and at 5,000 nodes a quarter of the stuck
// nodes 25 s late. A node whose rules change at every report (one just
// thawed, catching up under churn) has no earlier span of the same rules:
// Evaluate then judges the reports before the latest (node.before) when
// the view covers them, or its findings could outlive its repair.
func judgeAt(heard, shownSince, judged, covered time.Time) (time.Time, bool) {
	switch {
	case !heard.After(covered) && heard.After(judged):
		return heard, true
	case heard.After(covered) && !shownSince.IsZero() && !shownSince.After(covered) && covered.After(judged):
		return covered, true
	}
	return time.Time{}, false
}

// pruneLocked drops the nodes the judge forgot (they left the cluster and
// went silent) and whose stream is closed: their rules, baseline and
// assessments. It returns their names, for the remediation's memory. Node
// churn (autoscaling, unique names) must not grow the leader.
func (a *Aggregator) pruneLocked(v *audit.Verdict) []string {
	judged := make(map[string]bool, len(v.Nodes))
	for _, s := range v.Nodes {
		judged[s.Node] = true
	}
	var gone []string
	for name, n := range a.nodes {
		if n.conn == nil && !judged[name] {
			delete(a.nodes, name)
			gone = append(gone, name)
		}
	}
	return gone
}

// maxReadNow bounds the read-now requests of one evaluation: a change
// every node lags behind (an API burst) must not make the whole fleet read
// at once.
const maxReadNow = 100

// readNowMinLag is how far behind a node must have been at its last report
// to be asked: under churn a healthy kube-proxy is nearly always a change
// or two behind (its minimum sync period is 1 s), and asking every such
// node would double the fleet's reads (the 500-node simulation sent 5,504
// requests for 10 stuck nodes without it).
const readNowMinLag = 3 * time.Second

// readNowDue picks the lagging nodes whose oldest missing change crossed
// the grace period after their last report, and that were already more
// than readNowMinLag behind then: without a word from them the finding
// waits for their next interval (up to 10 s by default). Each crossing is
// asked once. a.mu held.
func (a *Aggregator) readNowDue(now time.Time, v *audit.Verdict, recovering bool) []*conn {
	if recovering {
		return nil
	}
	var out []*conn
	for _, s := range v.Nodes {
		if s.State != audit.NodeLagging || s.Watermark.IsZero() || s.LastReport.Sub(s.Watermark) < readNowMinLag {
			continue
		}
		due := s.Watermark.Add(a.cfg.Policy.Grace)
		n := a.nodes[s.Node]
		if n == nil || n.conn == nil || now.Before(due) || !n.heard.Before(due) || n.readNowFor.Equal(due) {
			continue
		}
		n.readNowFor = due
		out = append(out, n.conn)
		if len(out) == maxReadNow {
			break
		}
	}
	return out
}

// holdBackDrift keeps only CollectorMissing findings and shows drifted
// nodes as Lagging: right after an API outage every kube-proxy is catching
// up, and one still behind when the recovery grace ends is reported then,
// with its drift dated from when it began.
func holdBackDrift(v audit.Verdict) audit.Verdict {
	var kept []audit.TimedFinding
	for _, f := range v.Findings {
		if f.Kind == audit.CollectorMissing {
			kept = append(kept, f)
		}
	}
	v.Findings = kept
	nodes := make([]audit.NodeStatus, len(v.Nodes))
	for i, n := range v.Nodes {
		if n.State == audit.NodeStuck || n.State == audit.NodeDivergent || n.State == audit.NodeNoRules {
			n.State = audit.NodeLagging
		}
		nodes[i] = n
	}
	v.Nodes = nodes
	return v
}

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

// warnUnauditedLocked warns of each node whose collector read no rules of
// an IP family the cluster has services in (an image without ip6tables):
// that half of the node is not audited, which is not "in sync".
func (a *Aggregator) warnUnauditedLocked(v *audit.Verdict, families []int) {
	for i := range v.Nodes {
		st := &v.Nodes[i]
		n := a.nodes[st.Node]
		if n == nil || n.state == nil || st.State == audit.NodeMissing || st.State == audit.NodePending {
			continue
		}
		for _, f := range families {
			if !slices.Contains(n.state.Families, f) {
				st.Warnings = append(st.Warnings, fmt.Sprintf("IPv%d not audited: the cluster has IPv%d services, and this node's collector read no IPv%d rules (is %s in its image?)",
					f, f, f, map[int]string{4: "iptables-save", 6: "ip6tables-save"}[f]))
			}
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
