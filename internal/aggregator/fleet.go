// The fleet: what this replica knows of the nodes it judges, and the
// decisions made over that knowledge.

package aggregator

import (
	"fmt"
	"slices"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// fleet is the nodes this replica judges (every node when it leads
// alone; its shards' nodes when sharded), their judge, the last verdict,
// and the shards held. Its methods decide and change only the fleet:
// none takes a lock, writes to a stream or calls out. The Aggregator
// calls them holding a.mu, and carries out what they return (streams to
// close or to ask, nodes to forget) once it lets go.
type fleet struct {
	policy  audit.Policy
	nodes   map[string]*node
	judge   *audit.Judge
	verdict *audit.Verdict
	// shards is how many shards the fleet's nodes are spread over (0: not
	// sharded); held are those this replica holds.
	shards int
	held   map[int]bool
}

func newFleet(p audit.Policy, shards int) fleet {
	return fleet{policy: p, shards: shards, nodes: map[string]*node{}, judge: audit.NewJudge(p), held: map[int]bool{}}
}

// decision is what one evaluation decides over the fleet.
type decision struct {
	// v is this replica's verdict: the fleet's when it is not sharded,
	// else its shards' (part, which the leader concludes over).
	v    audit.Verdict
	part audit.Partial
	// gone are the nodes pruned (the judge forgot them and their stream
	// is closed), to be forgotten by the repairs too; asks the streams to
	// ask to read now.
	gone []string
	asks []*conn
}

// tick judges the fleet as of now: names are the nodes the cluster
// expects, c what the evaluation's judgement of the reports left, and
// recovering says the view came back from an outage within the recovery
// grace (drift is held back, and nobody is asked to read now).
func (f *fleet) tick(now time.Time, names []string, c cycle, recovering bool) decision {
	var d decision
	if f.shards == 0 {
		d.v = f.judge.Evaluate(now, names)
	} else {
		var mine []string // names is the view's own: not filtered in place
		for _, n := range names {
			if f.held[shard.Of(n, f.shards)] {
				mine = append(mine, n)
			}
		}
		d.part = f.judge.JudgeNodes(now, mine)
		d.v = audit.Verdict{At: now, Nodes: d.part.Nodes, Findings: append(slices.Clone(d.part.Missing), d.part.Drift...)}
	}
	addConntrack(&d.v, c.stale, c.ctErrs)
	d.gone = f.prune(&d.v)
	audit.WarnKnownBad(&d.v, c.nodeInfo)
	f.warnUnaudited(&d.v, c.families)
	if recovering {
		d.v = holdBackDrift(d.v)
	}
	d.asks = f.readNowDue(now, &d.v, recovering)
	return d
}

// begin starts a term of leading alone: an empty fleet and a new judge
// (collectors resend full snapshots on connecting).
func (f *fleet) begin() {
	f.judge = audit.NewJudge(f.policy)
	f.nodes = map[string]*node{}
	f.verdict = nil
}

// end ends a term of leading alone: the nodes are forgotten, and their
// open streams returned, to be handed over.
func (f *fleet) end() []*conn {
	var open []*conn
	for _, n := range f.nodes {
		if n.conn != nil {
			open = append(open, n.conn)
		}
	}
	f.nodes = map[string]*node{}
	f.verdict = nil
	return open
}

// register makes c node name's stream, from a clean copy of its rules. It
// returns the node, and the stream c replaces (to close) if any.
func (f *fleet) register(name, version string, c *conn, pool *stream.Pool) (n *node, replaced *conn) {
	n = f.nodes[name]
	if n == nil {
		n = &node{name: name}
		f.nodes[name] = n
	}
	replaced = n.conn
	n.conn, n.state, n.complete, n.lastSeq, n.before, n.collectorVersion = c, stream.NewPooledState(pool), false, 0, nil, version
	return n, replaced
}

// job is one node's report due for judgement: its rules as of at.
type job struct {
	n         *node
	snap      stream.State // a copy: its buckets are immutable
	at, shown time.Time
	reuse     bool // the node's assessment of its last judgement stands
	noRule    bool
}

// due picks the reports the view now covers, each to
// be judged as of the time it shows; gen is the cluster state's
// generation. A node's jobs come in the order its reports came: the rules
// earlier reports showed that no judgement reached (node.before), then its
// latest.
func (f *fleet) due(covered time.Time, gen uint64) []job {
	var jobs []job
	for _, n := range f.nodes {
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
				jobs = append(jobs, f.job(n, &b.state, b.version, b.noRules, b.since, at, gen))
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
			jobs = append(jobs, f.job(n, n.state, n.version, n.noRules, n.shownSince, at, gen))
			// Judged as of an earlier time than the latest report: its
			// turn comes.
			n.fresh, n.judged = !at.Equal(n.heard), at
		}
	}
	return jobs
}

// job is node n's rules (of the given version) due for judgement as
// of at; their assessment is reused when neither they nor the cluster
// state (gen) moved since it was made.
func (f *fleet) job(n *node, rules *stream.State, version uint64, noRules bool, shownSince, at time.Time, gen uint64) job {
	j := job{n: n, at: at, shown: shownSince, noRule: noRules}
	if n.assessedVersion == version && n.assessedGen == gen {
		j.reuse = true
	} else {
		j.snap = *rules
		n.assessedVersion, n.assessedGen = version, gen
	}
	return j
}

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

// prune drops the nodes the judge forgot (they left the cluster and
// went silent) and whose stream is closed: their rules, baseline and
// assessments. It returns their names, for the remediation's memory. Node
// churn (autoscaling, unique names) must not grow the leader.
func (f *fleet) prune(v *audit.Verdict) []string {
	judged := make(map[string]bool, len(v.Nodes))
	for _, s := range v.Nodes {
		judged[s.Node] = true
	}
	var gone []string
	for name, n := range f.nodes {
		if n.conn == nil && !judged[name] {
			delete(f.nodes, name)
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
// asked once.
func (f *fleet) readNowDue(now time.Time, v *audit.Verdict, recovering bool) []*conn {
	if recovering {
		return nil
	}
	var out []*conn
	for _, s := range v.Nodes {
		if s.State != audit.NodeLagging || s.Watermark.IsZero() || s.LastReport.Sub(s.Watermark) < readNowMinLag {
			continue
		}
		due := s.Watermark.Add(f.policy.Grace)
		n := f.nodes[s.Node]
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

// warnUnaudited warns of each node whose collector read no rules of
// an IP family the cluster has services in (an image without ip6tables):
// that half of the node is not audited, which is not "in sync".
func (f *fleet) warnUnaudited(v *audit.Verdict, families []int) {
	for i := range v.Nodes {
		st := &v.Nodes[i]
		n := f.nodes[st.Node]
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

// maxReadError bounds the read error a node's report may carry.
const maxReadError = 512

// received checks report r, which came on stream c, against node n's
// record (owns: this replica takes n's stream), and keeps what it carries
// besides the rules: its sequence, its conntrack counts, its read error
// (cleaned: people read it in explain, the report and Slack). It returns
// why the stream must end ("" when it goes on).
func (f *fleet) received(n *node, c *conn, owns bool, r *stream.Report, resumed bool) (RejectReason, string) {
	switch {
	case n.conn != c || !owns:
		return ReasonProtocol, "stream superseded"
	case r.Seq <= n.lastSeq && !(resumed && r.Seq == n.lastSeq):
		return ReasonReplay, fmt.Sprintf("report seq %d not after %d: replayed or reordered", r.Seq, n.lastSeq)
	}
	if r.Reads != nil {
		if err := r.Reads.Validate(); err != nil {
			return ReasonInvalid, "invalid report: " + err.Error()
		}
	}
	if err := r.CheckFacts(); err != nil {
		return ReasonInvalid, "invalid report: " + err.Error()
	}
	if ct := r.Conntrack; ct != nil {
		// Kept as soon as it is valid: it does not depend on the rules.
		if ct.Error != "" {
			n.conntrack, n.conntrackErr = nil, safetext.Clean(ct.Error, maxReadError)
		} else if m, err := ct.Model(); err != nil {
			return ReasonInvalid, "invalid report: " + err.Error()
		} else {
			n.conntrack, n.conntrackErr = m, ""
		}
	}
	r.ReadError = safetext.Clean(r.ReadError, maxReadError)
	n.lastSeq = r.Seq
	return "", ""
}

// applied records that report r, arriving at now, brought node n's copy
// of the rules to next (match: its root digest is the collector's): when
// the rules shown began, the rules earlier reports showed that no
// judgement reached yet, and the judge's heartbeat hb. It returns why the
// copy is not the collector's ("" when it is), and whether the node has
// just begun to show no rules.
func (f *fleet) applied(n *node, r *stream.Report, next stream.State, match bool, now time.Time, hb audit.Heartbeat) (why string, emptied bool) {
	prev, wasComplete := *n.state, n.complete
	*n.state = next
	if !match {
		n.complete = false
		return "root digest differs from the aggregator's copy", false
	}
	n.complete = true
	if r.Full || len(r.Frontends) > 0 || len(r.Refs) > 0 || len(r.Removed) > 0 || r.Top != "" || r.Buckets != "" || r.NoRules != n.noRules {
		// The rules the last report showed, if no judgement reached it
		// yet: queued, and judged each as of its own time before this
		// report (judgeAt), so that a drift is dated when the node first
		// showed it (a flush reported at once, then kube-proxy's next
		// sync rewriting part of the table: three reports within the
		// view's second of delay, and the flush dated by the third).
		// Every such report is kept, not only the earliest: a change
		// reported just before the flush, still unjudged when the
		// flush's report came, made the flush's report the one dropped,
		// and the flush was dated a second late (seen on a loaded CI
		// machine in TestE2EFlushSeenAtOnce).
		n.before = slices.DeleteFunc(n.before, func(b shown) bool { return !b.at.After(n.judged) })
		if wasComplete && n.fresh && n.heard.After(n.judged) {
			n.before = keepShown(n.before, shown{state: prev, at: n.heard, since: n.shownSince, version: n.version, noRules: n.noRules})
		}
		n.version++
		n.shownSince = now
	}
	emptied = r.NoRules && !n.noRules
	n.noRules = r.NoRules
	n.heard, n.fresh = now, true
	f.judge.Heard(n.name, hb)
	return "", emptied
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
