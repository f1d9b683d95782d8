package aggregator

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/proxyaudit/proxyaudit/remediate/effect"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// remediate plans and executes one round over a verdict (leader only).
func (a *Aggregator) remediate(v *audit.Verdict) {
	r := a.cfg.Remediation
	if r == nil {
		return
	}
	// Every call ends when the leadership does: a replica that lost the
	// Lease stops mid-round (the executor also asks before each action).
	ctx, cancel := context.WithTimeout(a.lead.context(), 30*time.Second)
	defer cancel()
	if r.Executor.Flusher == nil {
		r.Executor.Flusher = a // flushes go to the nodes' collectors, over their streams
	}
	if r.Executor.Journal == nil {
		r.Executor.Journal = a.journal // the status page's record of actions
	}
	if err := r.Executor.Load(ctx); err != nil {
		a.cfg.Log.Warn("cannot read the incident record: nothing is repaired this round", zap.Error(err))
		return
	}
	if len(v.Nodes) > 0 { // a view without nodes is not one to prune by
		if err := r.Executor.Prune(ctx, func(name string) bool { return a.view.Node(name) != nil }); err != nil {
			a.cfg.Log.Warn("cannot prune the incident record", zap.Error(err))
		}
	}
	byNode := map[string][]audit.TimedFinding{}
	storm := false
	for _, f := range v.Findings {
		if f.Kind == audit.MassDivergence {
			storm = true
		}
		byNode[f.Node] = append(byNode[f.Node], f)
	}
	a.stormNotice(storm, v)
	fleet := remediate.Fleet{Storm: storm}
	notices := map[string]remediate.Notice{}
	kinds := map[string]string{}
	for _, st := range v.Nodes {
		node := a.view.Node(st.Node)
		if node == nil {
			continue // reports, but is not (or no longer) in the cluster
		}
		fs := byNode[st.Node]
		n := a.remediationNode(ctx, r, node, st, fs, storm)
		fleet.Nodes = append(fleet.Nodes, n)
		notices[st.Node] = remediate.Notice{Evidence: evidence(fs), Since: earliest(fs)}
		kinds[st.Node] = string(st.State)
	}
	if r.Pause != nil {
		fleet.Paused = r.Pause.Held(ctx)
	}
	if r.Alertmanager != nil {
		a.alertmanager(ctx, r.Alertmanager, &fleet, kinds, notices, v)
	}
	now := a.cfg.Clock.Now()
	a.holding(remediate.Hold(now, r.Policy, fleet), fleet.Paused != "")
	actions := remediate.Plan(now, r.Policy, fleet)
	for _, act := range actions {
		if act.Held != "" {
			a.cfg.Metrics.HeldDecisions.WithLabelValues(act.Held).Inc()
		}
	}
	if len(actions) == 0 {
		return
	}
	if err := r.Executor.Execute(ctx, actions, notices); err != nil {
		a.cfg.Log.Warn("remediation round had failures", zap.Error(err))
	}
}

// remediationNode is what the planner knows of one node of the verdict
// (st, its findings fs): its state, stale flows, exemption, whether it is
// leaving, how its kube-proxy runs. Unless dry-run, it also sets the
// node's condition (in a storm, never to drifted).
func (a *Aggregator) remediationNode(ctx context.Context, r *Remediation, node *corev1.Node, st audit.NodeStatus, fs []audit.TimedFinding, storm bool) remediate.Node {
	n := remediate.Node{
		Name:          st.Node,
		Drifted:       st.State == audit.NodeStuck || st.State == audit.NodeDivergent || st.State == audit.NodeNoRules,
		Healthy:       st.State == audit.NodeInSync,
		Summary:       summary(st, fs),
		Dataplane:     dataplaneOf(st.Mode),
		Unschedulable: node.Spec.Unschedulable,
		Incident:      r.Executor.Incident(st.Node),
	}
	for _, f := range fs {
		if f.Kind == audit.StaleConntrack && f.Frontend != "" {
			n.Stale = append(n.Stale, remediate.StalePair{Service: f.Service, Port: f.Port, Protocol: f.Protocol, Frontend: f.Frontend, Dest: f.Endpoint, Flows: f.Flows})
		}
	}
	if _, ok := node.Labels[r.ExemptLabel]; ok && r.ExemptLabel != "" {
		n.Exempt = "label " + r.ExemptLabel
	}
	if q := audit.QuietOf(node); q.Leaving() {
		n.Leaving = string(q)
	}
	if n.Drifted && !storm {
		n.StaticProxy, n.NoProxyPod = r.Executor.Inspect(ctx, st.Node, n.Dataplane)
	} else {
		n.StaticProxy, n.NoProxyPod = r.Executor.Learned(st.Node)
	}
	if r.Policy.Mode != remediate.DryRun {
		// In a storm the drift is most likely the aggregator's or the
		// API's: no node is marked, as node-health controllers (NHC,
		// draino) may act on the condition across the whole fleet.
		if status, reason, msg, ok := remediate.Condition(st, n.Summary); ok && !(storm && status == corev1.ConditionTrue) {
			if err := r.Executor.SetCondition(ctx, node, status, reason, msg); err != nil {
				a.cfg.Log.Warn("cannot set the node condition", zap.String("node", st.Node), zap.Error(err))
			}
		}
	}
	return n
}

// alertmanager keeps every incident an alert in Alertmanager (in a storm,
// the storm one alert, not one per node) and marks the nodes whose alert
// a silence mutes, or every drifted node when Alertmanager cannot be
// asked.
func (a *Aggregator) alertmanager(ctx context.Context, am *effect.Alertmanager, fleet *remediate.Fleet, kinds map[string]string, notices map[string]remediate.Notice, v *audit.Verdict) {
	var alerts []remediate.Alert
	for _, n := range fleet.Nodes {
		if !remediate.Alerting(n) || (fleet.Storm && n.Incident.Stage == "") {
			continue
		}
		al := remediate.NodeAlert(n, kinds[n.Name])
		al.Evidence = notices[n.Name].Evidence
		if al.Since.IsZero() {
			al.Since = notices[n.Name].Since
		}
		alerts = append(alerts, al)
	}
	if fleet.Storm {
		for _, f := range v.Findings {
			if f.Kind == audit.MassDivergence {
				a.remedy.mu.Lock()
				since := a.remedy.stormSince
				a.remedy.mu.Unlock()
				alerts = append(alerts, remediate.Alert{Kind: string(audit.MassDivergence), Severity: remediate.SeverityCritical, Summary: f.Detail,
					Action: "nothing is repaired and no node is marked until it is over: suspect the API or the aggregator's view, not the nodes", Since: since})
				break
			}
		}
	}
	if err := am.Sync(ctx, alerts); err != nil {
		a.cfg.Log.Warn("cannot keep incidents firing in Alertmanager", zap.Error(err))
	}
	silenced, hold := am.Silenced(ctx)
	for i := range fleet.Nodes {
		n := &fleet.Nodes[i]
		switch {
		case silenced[n.Name] != "":
			n.Silenced = silenced[n.Name]
		case hold != "" && n.Drifted:
			n.Silenced = hold
		}
	}
}

// stormNotice pages once when a mass divergence begins and once when it
// ends, for the fleet, through the notifier that says when the view is
// stale (health.go).
func (a *Aggregator) stormNotice(storm bool, v *audit.Verdict) {
	a.remedy.mu.Lock()
	was := !a.remedy.stormSince.IsZero()
	since := a.remedy.stormSince
	switch {
	case storm && !was:
		a.remedy.stormSince = a.cfg.Clock.Now()
		since = a.remedy.stormSince
	case !storm && was:
		a.remedy.stormSince = time.Time{}
	}
	a.remedy.mu.Unlock()
	if storm == was || a.cfg.Notifier == nil {
		return
	}
	n := remediate.Notice{Action: remediate.Action{Kind: remediate.StormOver, Node: remediate.SelfNode,
		Reason: fmt.Sprintf("the mass divergence that began %s is over; nodes still drifted are handled one by one again", since.UTC().Format(time.RFC3339))}}
	if storm {
		detail := ""
		for _, f := range v.Findings {
			if f.Kind == audit.MassDivergence {
				detail = f.Detail
			}
		}
		n = remediate.Notice{Action: remediate.Action{Kind: remediate.Storm, Node: remediate.SelfNode,
			Reason: "MassDivergence: " + detail + "; suspect the API or the aggregator's view, not the nodes: nothing is repaired and no node is marked until it is over"}, Since: since}
	}
	a.cfg.Notifier.Notify(n) // as the view's staleness is: about the fleet, not a node
}

// summary is one line saying what is wrong with a node.
func summary(st audit.NodeStatus, fs []audit.TimedFinding) string {
	for _, f := range fs {
		if f.Kind == audit.StuckProxy || f.Kind == audit.NoRules {
			return string(f.Kind) + ": " + f.Detail
		}
	}
	svcs := map[string]bool{}
	for _, f := range fs {
		svcs[f.Service] = true
	}
	return fmt.Sprintf("%s: %d finding(s) on %d service(s) whose rules match no recent version of the cluster", st.State, len(fs), len(svcs))
}

// evidence lists a node's service findings, stale ones first.
func evidence(fs []audit.TimedFinding) []string {
	var out []string
	sorted := append([]audit.TimedFinding(nil), fs...)
	rank := map[audit.Kind]int{audit.StaleEndpoint: 0, audit.StaleService: 1, audit.MissingEndpoint: 2, audit.MissingService: 3}
	sort.SliceStable(sorted, func(i, j int) bool { return rank[sorted[i].Kind] < rank[sorted[j].Kind] })
	for _, f := range sorted {
		if f.Service == "" && f.Endpoint == "" {
			continue
		}
		out = append(out, strings.TrimSpace(fmt.Sprintf("%s %s %s %s", f.Kind, f.Service, f.Port, f.Endpoint)))
	}
	return out
}

// earliest is when the first of fs began.
func earliest(fs []audit.TimedFinding) time.Time {
	var t time.Time
	for _, f := range fs {
		if t.IsZero() || f.Since.Before(t) {
			t = f.Since
		}
	}
	return t
}

// holding records why every repair is held ("" when none is), for the
// API and the metric, and logs each change.
func (a *Aggregator) holding(hold string, paused bool) {
	a.remedy.mu.Lock()
	was := a.remedy.hold
	a.remedy.hold = hold
	a.remedy.mu.Unlock()
	byPause, byWindow := 0.0, 0.0
	switch {
	case paused:
		byPause = 1
	case hold != "":
		byWindow = 1
	}
	a.cfg.Metrics.Held.WithLabelValues("paused").Set(byPause)
	a.cfg.Metrics.Held.WithLabelValues("window").Set(byWindow)
	if hold != was {
		if hold == "" {
			a.cfg.Log.Info("repairs no longer held", zap.String("was", was))
		} else {
			a.cfg.Log.Warn("every repair held: pages only", zap.String("why", hold))
		}
	}
}

// RemediationHold is why every repair is held now, or "".
func (a *Aggregator) RemediationHold() string {
	a.remedy.mu.Lock()
	defer a.remedy.mu.Unlock()
	return a.remedy.hold
}

// dataplaneOf is what programs the services of a node whose collector
// reads mode m: Cilium's agent for Cilium's maps, else kube-proxy.
func dataplaneOf(m audit.Mode) remediate.Dataplane {
	if m == audit.ModeCilium {
		return remediate.DataplaneCilium
	}
	return remediate.DataplaneKubeProxy
}
