package audit

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"
)

// Policy is when a difference becomes a finding.
type Policy struct {
	// Grace is how long a node may lag or differ before it is a finding:
	// the network-programming delay the cluster tolerates.
	Grace time.Duration
	// MissingIntervals is how many collector intervals without a report
	// make a node's collector missing.
	MissingIntervals int
	// DefaultInterval is assumed for nodes that never reported.
	DefaultInterval time.Duration
	// MassShare and MassMinNodes: when at least MassMinNodes nodes and
	// more than MassShare of the reporting nodes drift at once, one
	// MassDivergence finding replaces the node findings.
	MassShare    float64
	MassMinNodes int
	// WeightZeroLimit is how long an IPVS real server may stay at weight
	// 0 after the cluster stopped listing it (graceful termination keeps
	// it while its connections last) before it is a StaleEndpoint; 0
	// never reports one. Measured from when the judge first saw it.
	WeightZeroLimit time.Duration
}

// DefaultWeightZeroLimit covers a pod's default 30 s termination grace,
// IPVS's 15 min idle timeout for an established TCP connection and
// kube-proxy's once-a-minute check of the real servers it is draining.
const DefaultWeightZeroLimit = 30 * time.Minute

// DefaultPolicy is the policy the aggregator starts from.
func DefaultPolicy() Policy {
	return Policy{Grace: 30 * time.Second, MissingIntervals: 3, DefaultInterval: 10 * time.Second, MassShare: 0.5, MassMinNodes: 3,
		WeightZeroLimit: DefaultWeightZeroLimit}
}

// NodeState summarises a node for people.
type NodeState string

// Node states, worst last.
const (
	NodeInSync    NodeState = "InSync"
	NodeLagging   NodeState = "Lagging"   // behind, within grace
	NodeDivergent NodeState = "Divergent" // rules match no recent version, past grace
	NodeStuck     NodeState = "Stuck"     // behind past grace
	NodeNoRules   NodeState = "NoRules"   // no rules past grace
	NodeMissing   NodeState = "Missing"   // collector silent
	NodePending   NodeState = "Pending"   // no report yet, within the allowance
)

// LagStats are percentiles of a node's observed programming latency: how
// long after a change the node's reports first showed it. Reports come
// once per collector interval, so each sample is an upper bound at that
// resolution.
type LagStats struct {
	Samples int     `json:"samples"`
	P50     float64 `json:"p50Seconds"`
	P90     float64 `json:"p90Seconds"`
	P99     float64 `json:"p99Seconds"`
	Max     float64 `json:"maxSeconds"`
}

// NodeStatus is one node as the judge sees it.
type NodeStatus struct {
	Node       string    `json:"node"`
	State      NodeState `json:"state"`
	Mode       Mode      `json:"mode,omitempty"`
	LastReport time.Time `json:"lastReport,omitzero"`
	// Services counts the services the node should program; the others
	// split them by state (InSync = Services − Lagging − Divergent).
	Services  int `json:"services"`
	InSync    int `json:"inSync"`
	Lagging   int `json:"lagging"`
	Divergent int `json:"divergent"`
	// Watermark: every cluster change before it shows in the node's rules
	// (as of its last report).
	Watermark time.Time `json:"watermark,omitzero"`
	Lag       LagStats  `json:"programmingLag"`
	ReadError string    `json:"readError,omitempty"`
	// KubeProxy is what kube-proxy's own metrics said last.
	KubeProxy *KubeProxySignal `json:"kubeProxy,omitempty"`
	// Collector is what the node's collector says its reads cost.
	Collector *CollectorCost `json:"collector,omitempty"`
	// Warnings are facts about the node that are not findings (a
	// kube-proxy release known to misbehave in the node's mode).
	Warnings []string `json:"warnings,omitempty"`
	// StaleFlows counts the node's conntrack flows still DNATed to
	// endpoints that are gone (its StaleConntrack findings), whatever the
	// state of its rules.
	StaleFlows int `json:"staleFlows,omitempty"`
}

// Verdict is everything a judge concludes at one instant.
type Verdict struct {
	At       time.Time      `json:"at"`
	Findings []TimedFinding `json:"findings"`
	Nodes    []NodeStatus   `json:"nodes"`
}

// Judge turns each node's assessments over time into findings: grace,
// stuck proxies, silent collectors and the mass-divergence guard. It holds
// per-node memory and reads no clock: every call carries its time.
type Judge struct {
	Policy Policy
	nodes  map[string]*nodeRecord
}

// lagSamples bounds the programming-latency samples kept per node;
// maxPending the changes awaited per service.
const (
	lagSamples = 256
	maxPending = 64
)

type nodeRecord struct {
	expectedSince time.Time // when the judge first expected reports
	reported      time.Time
	alive         time.Time // last heard from, report judged or not (Alive)
	interval      time.Duration
	mode          Mode
	readError     string
	readErrSince  time.Time
	kubeProxy     *KubeProxySignal
	cost          *CollectorCost

	assessed       time.Time
	services       int
	noRules        bool
	noRulesSince   time.Time
	assessments    []ServiceAssessment
	divergentSince map[string]time.Time
	drainingSince  map[string]time.Time // by finding key

	changeSeq uint64
	pending   map[string][]time.Time // changes not yet shown, per service
	lags      []time.Duration        // ring
	lagNext   int
}

// NewJudge returns a judge with no memory.
func NewJudge(p Policy) *Judge {
	if p.MissingIntervals <= 0 {
		p.MissingIntervals = 3
	}
	if p.DefaultInterval <= 0 {
		p.DefaultInterval = 10 * time.Second
	}
	return &Judge{Policy: p, nodes: map[string]*nodeRecord{}}
}

func (j *Judge) record(node string, at time.Time) *nodeRecord {
	r := j.nodes[node]
	if r == nil {
		r = &nodeRecord{expectedSince: at, divergentSince: map[string]time.Time{}, drainingSince: map[string]time.Time{}, pending: map[string][]time.Time{}}
		j.nodes[node] = r
	}
	return r
}

// Heartbeat is one report's facts besides the rules.
type Heartbeat struct {
	At       time.Time
	Interval time.Duration
	Mode     Mode
	// ReadError is the collector's complaint when it could not read the
	// rules (such a report says nothing about them).
	ReadError string
	// KubeProxy, when set, replaces what kube-proxy's metrics said.
	KubeProxy *KubeProxySignal
	// Cost, when set, replaces what the collector said its reads cost.
	Cost *CollectorCost
}

// CollectorCost is what a node's collector says its reads of the rules
// cost: reads by reason since it started (change, backstop, read-now,
// resync, heartbeat) and the last read's wall time, CPU (its own and the
// dump tool's) and bytes. A quiet node's collector reads only when the
// rules changed, or at its backstop interval.
type CollectorCost struct {
	// Version is the collector's own version (its hello): a rolling
	// upgrade is watched node by node.
	Version string `json:"version,omitempty"`
	// Reads nil in a Heartbeat: only the version is new, the counts
	// stand.
	Reads              map[string]uint64 `json:"reads"`
	LastReadSeconds    float64           `json:"lastReadSeconds"`
	LastReadCPUSeconds float64           `json:"lastReadCPUSeconds"`
	LastReadBytes      int64             `json:"lastReadBytes"`
	// LastWholeRead* are the last whole read's: the last read may have
	// read only what changed (nothing, where kube-proxy stopped writing).
	LastWholeReadSeconds    float64 `json:"lastWholeReadSeconds,omitempty"`
	LastWholeReadCPUSeconds float64 `json:"lastWholeReadCPUSeconds,omitempty"`
	LastWholeReadBytes      int64   `json:"lastWholeReadBytes,omitempty"`
	FullReadIntervalSeconds float64 `json:"fullReadIntervalSeconds,omitempty"`
	// SignalLost counts change announcements the node's kernel dropped.
	SignalLost uint64 `json:"signalLost,omitempty"`
	// Reader is what reads the node's rules; Fallbacks counts reads that
	// fell back to the text tool (a rule the reader could not decode),
	// FallbackReason the last one's why.
	Reader         string `json:"reader,omitempty"`
	Fallbacks      uint64 `json:"fallbacks,omitempty"`
	FallbackReason string `json:"fallbackReason,omitempty"`
	// Warnings are what the collector's last whole read noticed that is
	// not a finding; the node's status shows them among its warnings.
	Warnings []string `json:"warnings,omitempty"`
}

// KubeProxySignal is kube-proxy's own account of its syncs, from its
// metrics: the second signal. Times are the node's clock, shown to people
// and never used for grace.
type KubeProxySignal struct {
	LastSync               time.Time `json:"lastSync,omitzero"`
	LastQueued             time.Time `json:"lastQueued,omitzero"`
	EndpointChangesPending int       `json:"endpointChangesPending"`
	ServiceChangesPending  int       `json:"serviceChangesPending"`
	Error                  string    `json:"error,omitempty"`
	// Version is kube-proxy's git version, from kubernetes_build_info.
	Version string `json:"version,omitempty"`
}

// Alive records that node's collector was heard from at at, before its
// report could be judged (it waits behind others): a node heard from is
// not missing, though its rules are judged only from its reports.
func (j *Judge) Alive(node string, at time.Time) {
	r := j.record(node, at)
	if at.After(r.alive) {
		r.alive = at
	}
}

// Heard records that node's collector reported.
func (j *Judge) Heard(node string, hb Heartbeat) {
	r := j.record(node, hb.At)
	r.reported, r.interval = hb.At, hb.Interval
	if hb.Mode != "" {
		r.mode = hb.Mode
	}
	if hb.KubeProxy != nil {
		r.kubeProxy = hb.KubeProxy
	}
	switch {
	case hb.Cost == nil:
	case hb.Cost.Reads == nil && r.cost != nil: // the version alone: the counts kept
		c := *r.cost
		c.Version = hb.Cost.Version
		r.cost = &c
	case hb.Cost.Reads == nil:
		c := *hb.Cost
		c.Reads = map[string]uint64{}
		r.cost = &c
	default:
		r.cost = hb.Cost
	}
	if hb.ReadError == "" {
		r.readError, r.readErrSince = "", time.Time{}
		return
	}
	if r.readError == "" {
		r.readErrSince = hb.At
	}
	r.readError = hb.ReadError
}

// Observe records the assessment of node's rules made as of the given
// time (services is how many services the node should program; noRules
// that it has none); shown is when the node's reports first showed these
// rules (at most at). h is the history the assessment used: its change
// log yields the node's programming latency, returned as the samples this
// assessment completed, each measured to shown: a leader that judged
// nothing for a while (a takeover, a long cycle) must not count its own
// delay as the node's.
func (j *Judge) Observe(node string, at, shown time.Time, services int, noRules bool, as []ServiceAssessment, h *History) []time.Duration {
	if shown.IsZero() || shown.After(at) {
		shown = at
	}
	r := j.record(node, at)
	first := r.assessed.IsZero()
	r.assessed, r.services, r.assessments = at, services, as
	// A node that had no rules lost every service then: a service still
	// wrong when rules come back (a flush that kube-proxy's next sync
	// half repaired) has been wrong since the rules went.
	var wrongSince time.Time
	if r.noRules && !noRules {
		wrongSince = r.noRulesSince
	}
	if noRules {
		if !r.noRules {
			// Whatever the cluster holds, a node without rules has been
			// broken since it first showed none (a report judged later,
			// as of when the view covered it, must not date it later).
			r.noRulesSince = shown
		}
	} else {
		r.noRulesSince = time.Time{}
	}
	r.noRules = noRules

	behind := make(map[string]time.Time, len(as))
	divergent := map[string]time.Time{}
	for _, a := range as {
		switch a.State {
		case Divergent:
			since, ok := r.divergentSince[a.Service]
			if !ok {
				since = at
				if !wrongSince.IsZero() {
					since = wrongSince
				}
			}
			divergent[a.Service] = since // continuous divergence keeps its start
		case Lagging:
			behind[a.Service] = a.Since
		}
	}
	r.divergentSince = divergent
	draining := map[string]time.Time{}
	for _, a := range as {
		for _, f := range a.Draining {
			since, ok := r.drainingSince[f.onNode()]
			if !ok {
				since = at
			}
			draining[f.onNode()] = since
		}
	}
	r.drainingSince = draining

	if first || noRules {
		r.changeSeq = h.LastSeq()
		clear(r.pending)
		return nil
	}
	// A change shows on the node once the version the node matches is at
	// least that change: in sync shows every change; lagging since S shows
	// those before S; divergent shows nothing we can tell. Changes waiting
	// from earlier assessments are settled first; a new change the node
	// already shows becomes a sample at once, and only the rest wait (a map
	// that took every change of a churning cluster kept its size after
	// they settled: ~150 KB per node at 100 changes a second).
	var samples []time.Duration
	for svc, ps := range r.pending {
		if _, div := r.divergentSince[svc]; div {
			continue
		}
		since, lagging := behind[svc]
		keep := ps[:0]
		for _, at0 := range ps {
			if lagging && !at0.Before(since) {
				keep = append(keep, at0)
				continue
			}
			samples = append(samples, max(shown.Sub(at0), 0))
		}
		if len(keep) == 0 {
			delete(r.pending, svc)
		} else {
			r.pending[svc] = keep
		}
	}
	for _, c := range h.ChangesSince(r.changeSeq) {
		_, div := r.divergentSince[c.Service]
		since, lagging := behind[c.Service]
		if div || lagging && !c.At.Before(since) {
			if ps := r.pending[c.Service]; len(ps) < maxPending {
				r.pending[c.Service] = append(ps, c.At)
			}
			continue
		}
		samples = append(samples, max(shown.Sub(c.At), 0))
	}
	r.changeSeq = h.LastSeq()
	for _, s := range samples {
		if len(r.lags) < lagSamples {
			r.lags = append(r.lags, s)
		} else {
			r.lags[r.lagNext] = s
			r.lagNext = (r.lagNext + 1) % lagSamples
		}
	}
	return samples
}

// Cost is what node's collector last said its reads cost (nil: nothing).
func (j *Judge) Cost(node string) *CollectorCost {
	if r := j.nodes[node]; r != nil {
		return r.cost
	}
	return nil
}

// Forget drops a node's memory (it left the cluster).
func (j *Judge) Forget(node string) { delete(j.nodes, node) }

// Evaluate concludes at now. cluster lists the nodes expected to report;
// a node outside it is judged while it reports and forgotten once silent
// (it left the cluster, or is going away), never called missing.
func (j *Judge) Evaluate(now time.Time, cluster []string) Verdict {
	return Conclude(j.Policy, j.JudgeNodes(now, cluster))
}

// Partial is a judge's verdict on its nodes before the mass-divergence
// guard, which must see every node at once: replicas sharing the fleet
// (issue #41) each judge their shards' nodes, and one Conclude over all
// their partials decides for the fleet. Conclude over any split of the
// nodes among judges gives what one judge of them all would
// (TestConcludeOverAnySplit).
type Partial struct {
	At    time.Time    `json:"at"`
	Nodes []NodeStatus `json:"nodes"`
	// Missing are findings about collectors (never held back); Drift
	// about rules, each drifted node's earliest in Drifted.
	Missing []TimedFinding       `json:"missing"`
	Drift   []TimedFinding       `json:"drift"`
	Drifted map[string]time.Time `json:"drifted"`
	// Reporting counts the nodes judged on their rules (neither missing
	// nor pending): the guard's denominator.
	Reporting int `json:"reporting"`
}

// JudgeNodes judges every node the judge knows, and those of cluster
// (the Nodes the API lists, which are expected to report), as of now.
func (j *Judge) JudgeNodes(now time.Time, cluster []string) Partial {
	for _, n := range cluster {
		j.record(n, now)
	}
	inCluster := make(map[string]bool, len(cluster))
	for _, n := range cluster {
		inCluster[n] = true
	}
	names := make([]string, 0, len(j.nodes))
	for n, r := range j.nodes {
		if last := r.lastHeard(); !inCluster[n] && (last.IsZero() || now.Sub(last) > j.allowance(r)) {
			delete(j.nodes, n)
			continue
		}
		names = append(names, n)
	}
	sort.Strings(names)

	p := Partial{At: now, Drifted: map[string]time.Time{}}
	for _, n := range names {
		st, fs, missing := j.judgeNode(n, j.nodes[n], now)
		p.Nodes = append(p.Nodes, st)
		if missing {
			p.Missing = append(p.Missing, fs...)
			continue
		}
		if st.State == NodePending {
			continue
		}
		p.Reporting++
		for _, f := range fs {
			if s, ok := p.Drifted[n]; !ok || f.Since.Before(s) {
				p.Drifted[n] = f.Since
			}
		}
		p.Drift = append(p.Drift, fs...)
	}
	return p
}

// Conclude makes one verdict of partials over disjoint sets of nodes,
// judged at one time (the first's): the nodes, the findings about
// collectors, and the drift, or — when at least MassMinNodes and more
// than MassShare of the reporting nodes drifted at once — one
// MassDivergence finding in place of the drift.
func Conclude(p Policy, parts ...Partial) Verdict {
	v := Verdict{Findings: []TimedFinding{}}
	drifted := map[string]time.Time{}
	var drift []TimedFinding
	reporting := 0
	for i, part := range parts {
		if i == 0 {
			v.At = part.At
		}
		v.Nodes = append(v.Nodes, part.Nodes...)
		v.Findings = append(v.Findings, part.Missing...)
		drift = append(drift, part.Drift...)
		maps.Copy(drifted, part.Drifted)
		reporting += part.Reporting
	}
	if len(parts) > 1 {
		slices.SortStableFunc(v.Nodes, func(a, b NodeStatus) int { return strings.Compare(a.Node, b.Node) })
	}
	if len(drifted) >= max(p.MassMinNodes, 1) && float64(len(drifted)) > p.MassShare*float64(reporting) {
		var since time.Time
		ds := make([]string, 0, len(drifted))
		for n, s := range drifted {
			ds = append(ds, n)
			if since.IsZero() || s.Before(since) {
				since = s
			}
		}
		sort.Strings(ds)
		v.Findings = append(v.Findings, TimedFinding{Since: since, Finding: Finding{
			Kind: MassDivergence,
			Detail: fmt.Sprintf("%d of %d reporting nodes drifted at once (%s): the aggregator's view of the API or the control-plane path is more likely at fault than every kube-proxy; node findings are held back and nothing should be repaired",
				len(ds), reporting, listSome(ds, 10)),
		}})
	} else {
		v.Findings = append(v.Findings, drift...)
	}
	SortTimed(v.Findings)
	return v
}

// judgeNode returns the node's status and findings; missing says its
// findings are about the collector, not the rules.
func (j *Judge) judgeNode(name string, r *nodeRecord, now time.Time) (NodeStatus, []TimedFinding, bool) {
	p := j.Policy
	allowance := j.allowance(r)
	interval := r.interval
	if interval <= 0 {
		interval = p.DefaultInterval
	}
	st := NodeStatus{Node: name, Mode: r.mode, LastReport: r.reported, Services: r.services, ReadError: r.readError, Lag: lagStats(r.lags), KubeProxy: r.kubeProxy, Collector: r.cost}
	if r.cost != nil && len(r.cost.Warnings) > 0 {
		st.Warnings = slices.Clone(r.cost.Warnings)
	}
	switch {
	case r.lastHeard().IsZero() && now.Sub(r.expectedSince) <= allowance:
		st.State = NodePending
		return st, nil, false
	case r.lastHeard().IsZero():
		st.State = NodeMissing
		return st, []TimedFinding{{Since: r.expectedSince, Finding: Finding{Node: name, Kind: CollectorMissing,
			Detail: fmt.Sprintf("no collector has reported for this node since the aggregator started expecting it (%s ago): check the collector DaemonSet pod on this node", now.Sub(r.expectedSince).Round(time.Second))}}}, true
	case now.Sub(r.lastHeard()) > allowance:
		st.State = NodeMissing
		return st, []TimedFinding{{Since: r.lastHeard(), Finding: Finding{Node: name, Kind: CollectorMissing,
			Detail: fmt.Sprintf("last report %s ago (%d intervals of %s): the collector or its stream is down; the node's rules are unknown, not stale", now.Sub(r.lastHeard()).Round(time.Second), p.MissingIntervals, interval)}}}, true
	case r.reported.IsZero():
		// Heard from, its first report still waiting to be judged.
		st.State = NodePending
		return st, nil, false
	case r.readError != "" && now.Sub(r.readErrSince) > allowance:
		st.State = NodeMissing
		return st, []TimedFinding{{Since: r.readErrSince, Finding: Finding{Node: name, Kind: CollectorMissing,
			Detail: "the collector is connected but cannot read the rules: " + r.readError}}}, true
	case r.assessed.IsZero():
		st.State = NodePending
		return st, nil, false
	}

	if r.noRules {
		st.State = NodeLagging
		if r.assessed.Sub(r.noRulesSince) > p.Grace {
			st.State = NodeNoRules
			return st, []TimedFinding{{Since: r.noRulesSince, Finding: Finding{Node: name, Kind: NoRules,
				Detail: r.mode.noRulesDetail(r.assessed.Sub(r.noRulesSince).Round(time.Second))}}}, false
		}
		return st, nil, false
	}

	var out []TimedFinding
	var stuck []string
	var stuckSince time.Time
	watermark := r.assessed
	for _, a := range r.assessments {
		var since time.Time
		switch a.State {
		case Lagging:
			st.Lagging++
			since = a.Since
			if since.Before(watermark) {
				watermark = since
			}
		case Divergent:
			st.Divergent++
			since = r.divergentSince[a.Service]
		}
		for _, f := range a.Draining {
			f.Node = name
			since := r.drainingSince[f.onNode()]
			if age := r.assessed.Sub(since); p.WeightZeroLimit > 0 && age > p.WeightZeroLimit {
				f.Detail += fmt.Sprintf(" (at weight 0 for longer than the %s limit)", p.WeightZeroLimit)
				out = append(out, TimedFinding{Finding: f, Since: since})
			}
		}
		if a.State == InSync || r.assessed.Sub(since) <= p.Grace {
			continue
		}
		if a.State == Lagging {
			stuck = append(stuck, a.Service)
			if stuckSince.IsZero() || since.Before(stuckSince) {
				stuckSince = since
			}
		}
		for _, f := range a.Findings {
			f.Node = name
			out = append(out, TimedFinding{Finding: f, Since: since})
		}
	}
	st.InSync = max(st.Services-st.Lagging-st.Divergent, 0)
	st.Watermark = watermark
	switch {
	case len(stuck) > 0:
		st.State = NodeStuck
		out = append(out, TimedFinding{Since: stuckSince, Finding: Finding{Node: name, Kind: StuckProxy,
			Detail: fmt.Sprintf("%s on this node stopped following the API: its %s still show versions of %d service(s) that changed up to %s ago (%s)%s; restart %s on this node",
				r.mode.Dataplane(), r.mode.rulesNoun(), len(stuck), r.assessed.Sub(stuckSince).Round(time.Second), listSome(stuck, 10), r.kubeProxy.describe(), r.mode.agent())}})
	case len(out) > 0:
		st.State = NodeDivergent
	case st.Lagging > 0 || st.Divergent > 0:
		st.State = NodeLagging
	default:
		st.State = NodeInSync
	}
	return st, out, false
}

// allowance is how long a node may stay silent: MissingIntervals of its
// collector's interval.
func (j *Judge) allowance(r *nodeRecord) time.Duration {
	interval := r.interval
	if interval <= 0 {
		interval = j.Policy.DefaultInterval
	}
	return time.Duration(j.Policy.MissingIntervals) * interval
}

func listSome(ss []string, n int) string {
	if len(ss) <= n {
		return strings.Join(ss, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(ss[:n], ", "), len(ss)-n)
}

func lagStats(lags []time.Duration) LagStats {
	if len(lags) == 0 {
		return LagStats{}
	}
	s := slices.Clone(lags)
	slices.Sort(s)
	at := func(q float64) float64 {
		i := int(q*float64(len(s))+0.5) - 1
		return s[min(max(i, 0), len(s)-1)].Seconds()
	}
	return LagStats{Samples: len(s), P50: at(0.5), P90: at(0.9), P99: at(0.99), Max: s[len(s)-1].Seconds()}
}

// describe words kube-proxy's own view for a StuckProxy finding.
func (k *KubeProxySignal) describe() string {
	switch {
	case k == nil:
		return ""
	case k.Error != "":
		return "; kube-proxy's metrics could not be read (" + k.Error + ")"
	case k.LastSync.IsZero():
		return fmt.Sprintf("; kube-proxy's own metrics show no successful sync since it started (%d endpoint and %d service changes pending): its syncs fail, see its log",
			k.EndpointChangesPending, k.ServiceChangesPending)
	case k.EndpointChangesPending == 0 && k.ServiceChangesPending == 0:
		return fmt.Sprintf("; kube-proxy's own metrics show no pending changes and a last sync at %s (node clock): it does not know it is behind, so its health check stays green",
			k.LastSync.UTC().Format(time.RFC3339))
	default:
		return fmt.Sprintf("; kube-proxy's own metrics show %d endpoint and %d service changes pending, last sync at %s (node clock): it knows, but is not syncing",
			k.EndpointChangesPending, k.ServiceChangesPending, k.LastSync.UTC().Format(time.RFC3339))
	}
}

// lastHeard is the last time the node's collector was heard from: its
// last judged report, or a report still waiting to be judged.
func (r *nodeRecord) lastHeard() time.Time {
	if r.alive.After(r.reported) {
		return r.alive
	}
	return r.reported
}

// noRulesDetail says that the node has had no service rules for d.
func (m Mode) noRulesDetail(d time.Duration) string {
	if m == ModeCilium {
		return fmt.Sprintf("no service entries in Cilium's LB maps on this node for %s (emptied, or the agent never programmed them): every service is unreachable through it", d)
	}
	return fmt.Sprintf("no kube-proxy service rules on this node for %s (flushed, or kube-proxy not running): every service is unreachable through it", d)
}

// rulesNoun is what the mode's dataplane holds services in.
func (m Mode) rulesNoun() string {
	if m == ModeCilium {
		return "service maps"
	}
	return "rules"
}

// agent is the process a person restarts to repair the mode's dataplane.
func (m Mode) agent() string {
	if m == ModeCilium {
		return "the Cilium agent"
	}
	return "kube-proxy"
}
