package remediate

import (
	"fmt"
	"math"
	"sort"
	"time"
)

// Mode is how far remediation may go.
type Mode string

// Modes, from harmless to the full ladder.
const (
	// DryRun decides as if it could act, and only says what it would do.
	DryRun Mode = "dry-run"
	// Restart restarts the node's kube-proxy pod, and pages when that
	// does not help.
	Restart Mode = "restart"
	// RestartAndCordon also cordons a node still drifted after a restart.
	RestartAndCordon Mode = "restart-and-cordon"
)

// ParseMode checks a mode flag.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case DryRun, Restart, RestartAndCordon:
		return m, nil
	}
	return "", fmt.Errorf("remediation mode %q: choose dry-run, restart or restart-and-cordon", s)
}

// Policy bounds what remediation may do.
type Policy struct {
	Mode Mode
	// MaxConcurrent nodes in remediation at once: restarted (or flushed)
	// and not yet judged, and, counted apart, cordoned by proxyaudit.
	MaxConcurrent int
	// MaxUnhealthy nodes of the fleet in remediation at once, as a
	// number, a share or all but N (NodeHealthCheck's maxUnhealthy); the
	// smaller of it and MaxConcurrent holds.
	MaxUnhealthy Budget
	// Cooldown is the least time between two restarts of one node; each
	// further restart within BudgetWindow doubles it.
	Cooldown time.Duration
	// RestartBudget restarts per node within BudgetWindow.
	RestartBudget int
	BudgetWindow  time.Duration
	// Recheck is how long after a restart the node is re-audited: still
	// drifted then means the restart did not help.
	Recheck time.Duration
	// BreakerShare and BreakerWindow: once more than BreakerShare of the
	// fleet (at least one node) had kube-proxy restarted within
	// BreakerWindow, no further node is restarted until the window moves
	// on (NodeHealthCheck's maxUnhealthy, over time): a cause that makes
	// node after node drift — a bad kube-proxy rollout, a false alarm in
	// proxyaudit — is likelier than that many broken kube-proxies, and
	// MassDivergence only sees the ones drifting at once.
	BreakerShare  float64
	BreakerWindow time.Duration
	// Windows are when remediation may act; outside them it pages only
	// and says when the next opens. None: at any time.
	Windows Windows
	// Conntrack is whether, and for which protocols, stale conntrack
	// entries are deleted.
	Conntrack ConntrackPolicy
}

// DefaultPolicy is dry-run with conservative limits.
func DefaultPolicy() Policy {
	return Policy{Mode: DryRun, MaxConcurrent: 1, MaxUnhealthy: MustBudget("10%"), Cooldown: 10 * time.Minute,
		RestartBudget: 3, BudgetWindow: 24 * time.Hour, Recheck: 2 * time.Minute, BreakerShare: 0.1, BreakerWindow: time.Hour}
}

// Limit is how many nodes of a fleet of size nodes may be in remediation
// at once: the smaller of MaxConcurrent and MaxUnhealthy.
func (p Policy) Limit(size int) int {
	return min(p.MaxConcurrent, p.MaxUnhealthy.Of(size))
}

// Stage is where a node's incident is on the ladder.
type Stage string

// Stages. An incident without a stage does not exist.
const (
	StageOpen      Stage = "open"      // drift seen and paged; nothing done (yet)
	StageRestarted Stage = "restarted" // kube-proxy restarted, waiting to re-audit
	StageEscalated Stage = "escalated" // the restart did not help; paged (and cordoned in restart-and-cordon)
)

// Incident is a node's remediation state. The executor keeps it in a
// record only proxyaudit writes (a ConfigMap in its namespace), so a new
// leader continues where the old one stopped.
type Incident struct {
	Stage  Stage
	Opened time.Time
	// Restarts are the times kube-proxy was restarted for this node
	// within the budget window (they outlive the incident: the budget is
	// per node, not per incident).
	Restarts []time.Time
	// Cordoned is when proxyaudit cordoned the node (zero if it did not).
	Cordoned time.Time
	// Flushes are the times stale conntrack entries were deleted on the
	// node within the budget window (like Restarts, they outlive the
	// incident); FlushHeld names the hold and pairs the last held flush
	// was paged for (a short digest), so that a hold is paged once, not
	// every round.
	Flushes   []time.Time
	FlushHeld string
}

// Node is what the planner knows of one node.
type Node struct {
	Name string
	// Drifted: the judge reports the node's rules wrong past grace
	// (StuckProxy, NoRules, or service findings).
	Drifted bool
	// Healthy: the node reports and its rules are in sync. A node neither
	// drifted nor healthy (collector missing, lagging within grace) is
	// left as it is.
	Healthy bool
	// Summary names what is wrong, for pages.
	Summary string
	// Exempt says why the node must not be touched (label), Leaving why
	// it is going away (deletion, autoscaler): both page, never act.
	Exempt, Leaving string
	// Dataplane is what programs the node's services: kube-proxy, or
	// Cilium's agent (its kube-proxy replacement), restarted instead.
	Dataplane Dataplane
	// StaticProxy: kube-proxy (or the agent) runs as a static (mirror)
	// pod, which the API cannot restart; NoProxyPod: none was found on
	// the node.
	StaticProxy, NoProxyPod bool
	// Unschedulable: the node is already cordoned.
	Unschedulable bool
	// Silenced says who silenced the node's incident in Alertmanager and
	// why (or that Alertmanager cannot be asked): paged, never repaired.
	Silenced string
	// Stale are the node's conntrack flows judged stale past grace.
	Stale    []StalePair
	Incident Incident
}

// Dataplane is what programs a node's services.
type Dataplane string

// Dataplanes.
const (
	DataplaneKubeProxy Dataplane = ""
	DataplaneCilium    Dataplane = "cilium"
)

// Agent names the process a restart restarts, for people.
func (d Dataplane) Agent() string {
	if d == DataplaneCilium {
		return "the Cilium agent"
	}
	return "kube-proxy"
}

// ActionKind is what the executor is asked to do.
type ActionKind string

// Actions.
const (
	// RestartProxy deletes the node's kube-proxy pod (or Cilium agent
	// pod, Action.Dataplane); its DaemonSet makes a new one.
	RestartProxy ActionKind = "RestartProxy"
	Cordon       ActionKind = "Cordon"
	// Uncordon undoes proxyaudit's own cordon only.
	Uncordon ActionKind = "Uncordon"
	// Page tells people (Slack thread, Event); it changes nothing.
	Page ActionKind = "Page"
	// Resolve closes the incident (its state is cleared).
	Resolve ActionKind = "Resolve"
	// ViewStale and ViewFresh are about proxyaudit itself, not a node: its
	// view of the API went stale (findings unknown, nothing repaired) and
	// came back. Node is SelfNode.
	ViewStale ActionKind = "ViewStale"
	ViewFresh ActionKind = "ViewFresh"
	// Storm and StormOver are about the fleet: most nodes drifted at once
	// (MassDivergence; nothing is repaired and no node is paged on its
	// own), and that ended. Node is SelfNode.
	Storm     ActionKind = "Storm"
	StormOver ActionKind = "StormOver"
	// FlushConntrack deletes the node's stale conntrack entries named in
	// Action.Flush, through its collector.
	FlushConntrack ActionKind = "FlushConntrack"
)

// SelfNode is the Node of notices about proxyaudit itself.
const SelfNode = "(proxyaudit)"

// Action is one decision for one node. Incident is the node's state once
// the action is done; the executor records it.
type Action struct {
	Kind ActionKind
	Node string
	// Dataplane is the node's: which pod a RestartProxy deletes.
	Dataplane Dataplane
	Reason    string
	DryRun    bool
	Incident  Incident
	// Held names, for a page instead of a repair, what held the repair
	// (one of the Held* reasons), for the held-decisions metric.
	Held string
	// Flush are the (frontend, destination) pairs a FlushConntrack
	// deletes the entries of.
	Flush []StalePair
}

// What holds a repair, as Action.Held.
const (
	HeldPaused        = "paused"
	HeldWindow        = "window"
	HeldSilenced      = "silenced"
	HeldBudget        = "budget"        // fleet: too many nodes in remediation
	HeldBreaker       = "breaker"       // fleet: too many restarted lately
	HeldCooldown      = "cooldown"      // node: restarted too recently
	HeldSpent         = "spent"         // node: its restart budget is spent
	HeldExempt        = "exempt"        // node: labelled exempt
	HeldLeaving       = "leaving"       // node: being deleted or scaled down
	HeldUnrestartable = "unrestartable" // static kube-proxy, or none found
)

// Fleet is what the planner decides over.
type Fleet struct {
	Nodes []Node
	// Storm: the judge folded a mass divergence; nothing is touched and
	// no node is paged (the aggregator pages once for the fleet).
	Storm bool
	// Paused says who paused remediation fleet-wide, why and until when
	// ("" when it is not): every repair is held, pages go on.
	Paused string
}

// Hold says why no repair may start now, fleet-wide: a pause, or being
// outside the maintenance windows (and when the next opens); "" when
// repairs may.
func Hold(now time.Time, p Policy, f Fleet) string {
	if f.Paused != "" {
		return "remediation paused " + f.Paused
	}
	if open, next := p.Windows.Open(now); !open {
		return fmt.Sprintf("outside the maintenance windows (%s); the next opens at %s", p.Windows, next.UTC().Format(time.RFC3339))
	}
	return ""
}

// Plan decides this round's actions, at most one per node. It is pure:
// the same fleet, policy and time give the same actions.
func Plan(now time.Time, p Policy, f Fleet) []Action {
	nodes := append([]Node(nil), f.Nodes...)
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].Name < nodes[j].Name })
	limit := p.Limit(len(nodes))
	// Restarts (and conntrack flushes) and cordons have budgets of their
	// own, each the limit: a restarted node counts until its re-audit, a
	// node proxyaudit cordoned for as long as it stays cordoned. A
	// cordoned node that goes on reporting drift (broken, or lying about
	// itself) holds further cordons, so the fleet's capacity is kept, but
	// not the restarts of other nodes: one node could otherwise keep every
	// repair in the fleet from happening.
	restarting, cordoned := 0, 0
	// Nodes restarted within the breaker's window, this round's included.
	restarted, breaker := 0, max(1, int(math.Ceil(p.BreakerShare*float64(len(nodes)))))
	for _, n := range nodes {
		if n.Incident.Stage == StageRestarted {
			restarting++
		}
		if !n.Incident.Cordoned.IsZero() {
			cordoned++
		}
		if p.BreakerWindow > 0 && len(recent(n.Incident.Restarts, now, p.BreakerWindow)) > 0 {
			restarted++
		}
	}
	// fresh is 1 for a node the breaker does not count yet.
	fresh := func(n Node) int {
		if p.BreakerWindow > 0 && len(recent(n.Incident.Restarts, now, p.BreakerWindow)) == 0 {
			return 1
		}
		return 0
	}
	tripped := func(n Node) (string, string) {
		if fresh(n) == 0 || restarted < breaker {
			return "", ""
		}
		return HeldBreaker, fmt.Sprintf("remediation breaker open: %d node(s) had kube-proxy restarted in the last %s (limit %d: --remediation-breaker-share %g of the fleet); a cause common to them (a kube-proxy rollout, the API, proxyaudit itself) is likelier than that many broken kube-proxies",
			restarted, p.BreakerWindow, breaker, p.BreakerShare)
	}
	dry := p.Mode == DryRun
	hold, holdWhy := Hold(now, p, f), HeldWindow
	if f.Paused != "" {
		holdWhy = HeldPaused
	}
	var out []Action
	for _, n := range nodes {
		inc := n.Incident
		inc.Restarts = recent(inc.Restarts, now, p.BudgetWindow)
		act := func(kind ActionKind, reason string, next Incident) {
			out = append(out, Action{Kind: kind, Node: n.Name, Dataplane: n.Dataplane, Reason: reason, DryRun: dry && kind != Page && kind != Resolve, Incident: next})
		}
		check := func() (string, string) {
			if held, why := blocked(n, p, inc, now, restarting, limit, hold, holdWhy); why != "" {
				return held, why
			}
			return tripped(n)
		}
		switch {
		case n.Healthy && inc.Stage != "":
			next := Incident{Restarts: inc.Restarts, Flushes: inc.Flushes, FlushHeld: inc.FlushHeld}
			if !inc.Cordoned.IsZero() {
				act(Uncordon, fmt.Sprintf("rules back in sync since the incident opened %s ago; proxyaudit cordoned this node and now uncordons it", now.Sub(inc.Opened).Round(time.Second)), next)
				continue
			}
			act(Resolve, fmt.Sprintf("rules back in sync; incident lasted %s", now.Sub(inc.Opened).Round(time.Second)), next)
		case !n.Drifted:
			// Nothing to do: in sync without an incident, or not known.
		case f.Storm:
			// Nothing per node: the aggregator pages once for the fleet
			// (Storm), not once per node (500 drifted nodes were 500
			// pages). Incidents open when the storm is over, for nodes
			// still drifted then.
		case inc.Stage == "":
			inc.Stage, inc.Opened = StageOpen, now
			if held, why := check(); why != "" {
				act(Page, n.Summary+"; not repaired: "+why, inc)
				out[len(out)-1].Held = held
				continue
			}
			inc.Stage = StageRestarted
			inc.Restarts = append(inc.Restarts, now)
			restarting++
			restarted += fresh(n)
			act(RestartProxy, n.Summary+"; restarting "+n.Dataplane.Agent()+" on the node", inc)
		case inc.Stage == StageRestarted && now.Sub(last(inc.Restarts)) < p.Recheck:
			// Give the new kube-proxy time to sync before re-auditing.
		case inc.Stage == StageRestarted || inc.Stage == StageOpen:
			// Still drifted: after a restart that did not help, or an open
			// incident whose repair was blocked and may now be allowed.
			if inc.Stage == StageRestarted {
				restarting-- // its restart has been judged
			}
			_, why := check()
			if why == "" {
				inc.Stage = StageRestarted
				inc.Restarts = append(inc.Restarts, now)
				restarting++
				restarted += fresh(n)
				act(RestartProxy, n.Summary+fmt.Sprintf("; still drifted, restarting %s again (%d of %d in %s)", n.Dataplane.Agent(), len(inc.Restarts), p.RestartBudget, p.BudgetWindow), inc)
				continue
			} else if inc.Stage == StageOpen {
				continue // already paged with the reason
			}
			inc.Stage = StageEscalated
			// What holds a cordon: a fleet-wide hold or a silence (the
			// reasons a restart was refused above may not apply to it).
			held := holdWhy
			why = hold
			if why == "" && n.Silenced != "" {
				held, why = HeldSilenced, n.Silenced
			}
			cordonable := p.Mode == RestartAndCordon && !n.Unschedulable && n.Exempt == "" && n.Leaving == ""
			if cordonable && why == "" && cordoned >= limit {
				held, why = HeldBudget, fmt.Sprintf("cordon budget reached (%d node(s) cordoned by proxyaudit at once: the smaller of --remediation-max-nodes %d and --remediation-max-unhealthy %s of the fleet)", limit, p.MaxConcurrent, p.MaxUnhealthy)
			}
			if cordonable && why == "" {
				inc.Cordoned = now
				cordoned++
				act(Cordon, n.Summary+fmt.Sprintf("; still drifted %s after restarting %s: cordoning the node so no new pods land on it", p.Recheck, n.Dataplane.Agent()), inc)
				continue
			}
			tail := ""
			if p.Mode == RestartAndCordon && why != "" {
				tail = "; not cordoned: " + why
			} else {
				held = ""
			}
			act(Page, n.Summary+fmt.Sprintf("; still drifted %s after restarting %s: needs a human", p.Recheck, n.Dataplane.Agent())+tail, inc)
			out[len(out)-1].Held = held
		}
	}
	if p.Conntrack.Enabled && !f.Storm {
		out = planFlushes(now, p, nodes, out, &restarting, limit, hold, holdWhy)
	}
	return out
}

// StaticProxyAdvice is what to do about a static kube-proxy, which the API
// cannot restart.
const StaticProxyAdvice = "kube-proxy runs as a static pod here, which the API cannot restart: on the node, move its manifest out of the kubelet's manifest directory (usually /etc/kubernetes/manifests) and back, or `crictl stop` its container"

// blocked says what holds the node's restart now (a Held* reason) and
// why, or "", "".
func blocked(n Node, p Policy, inc Incident, now time.Time, busy, limit int, hold, holdWhy string) (string, string) {
	switch {
	case n.Exempt != "":
		return HeldExempt, "node is exempt (" + n.Exempt + ")"
	case n.Leaving != "":
		return HeldLeaving, "node is going away (" + n.Leaving + ")"
	case n.StaticProxy:
		return HeldUnrestartable, StaticProxyAdvice
	case n.NoProxyPod && n.Dataplane == DataplaneCilium:
		return HeldUnrestartable, "no Cilium agent pod found on the node (check the Cilium agent selector)"
	case n.NoProxyPod:
		return HeldUnrestartable, "no kube-proxy pod found on the node (check the kube-proxy selector)"
	case hold != "":
		return holdWhy, hold
	case n.Silenced != "":
		return HeldSilenced, n.Silenced
	case len(inc.Restarts) >= p.RestartBudget:
		return HeldSpent, fmt.Sprintf("restart budget spent (%d in %s)", len(inc.Restarts), p.BudgetWindow)
	case len(inc.Restarts) > 0 && now.Sub(last(inc.Restarts)) < backoff(p, len(inc.Restarts)):
		return HeldCooldown, fmt.Sprintf("in cooldown until %s", last(inc.Restarts).Add(backoff(p, len(inc.Restarts))).UTC().Format(time.RFC3339))
	case busy >= limit:
		return HeldBudget, fmt.Sprintf("remediation budget reached (%d node(s) at once: the smaller of --remediation-max-nodes %d and --remediation-max-unhealthy %s of the fleet)", limit, p.MaxConcurrent, p.MaxUnhealthy)
	}
	return "", ""
}

// backoff is the cooldown after k restarts: Cooldown, doubling per restart.
func backoff(p Policy, k int) time.Duration {
	return p.Cooldown << max(k-1, 0)
}

func recent(ts []time.Time, now time.Time, window time.Duration) []time.Time {
	var out []time.Time
	for _, t := range ts {
		if now.Sub(t) < window {
			out = append(out, t)
		}
	}
	return out
}

func last(ts []time.Time) time.Time {
	if len(ts) == 0 {
		return time.Time{}
	}
	return ts[len(ts)-1]
}
