package remediate

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

func policy(mode Mode) Policy {
	p := DefaultPolicy()
	p.Mode, p.MaxConcurrent, p.MaxUnhealthy, p.BreakerShare = mode, 2, MustBudget("50%"), 1
	return p
}

func drifted(name string) Node { return Node{Name: name, Drifted: true, Summary: "StuckProxy"} }

func healthy(names ...string) []Node {
	var out []Node
	for _, n := range names {
		out = append(out, Node{Name: n, Healthy: true})
	}
	return out
}

func ago(d time.Duration) time.Time { return t0.Add(-d) }

// describe renders actions as "node:Kind[dry]" for comparison.
func describe(as []Action) string {
	var out []string
	for _, a := range as {
		s := a.Node + ":" + string(a.Kind)
		if a.DryRun {
			s += "[dry]"
		}
		out = append(out, s)
	}
	return strings.Join(out, " ")
}

func TestPlan(t *testing.T) {
	restartedAgo := func(n Node, d time.Duration) Node {
		n.Incident = Incident{Stage: StageRestarted, Opened: ago(d), Restarts: []time.Time{ago(d)}}
		return n
	}
	for _, tc := range []struct {
		name   string
		policy Policy
		fleet  Fleet
		want   string
		says   string // in the first action's reason
	}{
		{"dry-run says what it would do", policy(DryRun),
			Fleet{Nodes: append(healthy("a", "b", "c"), drifted("d"))}, "d:RestartProxy[dry]", "restarting kube-proxy"},
		{"restart", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), drifted("d"))}, "d:RestartProxy", ""},
		{"in sync, nothing to do", policy(Restart), Fleet{Nodes: healthy("a", "b")}, "", ""},
		{"waits for the re-audit after a restart", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(drifted("d"), time.Minute))}, "", ""},
		{"still drifted after the re-audit: page", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(drifted("d"), 3*time.Minute))}, "d:Page", "needs a human"},
		{"still drifted after the re-audit: cordon", policy(RestartAndCordon),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(drifted("d"), 3*time.Minute))}, "d:Cordon", "cordoning"},
		{"an already cordoned node is not cordoned again", policy(RestartAndCordon),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := restartedAgo(drifted("d"), 3*time.Minute)
				n.Unschedulable = true
				return n
			}())}, "d:Page", "needs a human"},
		{"healthy after a restart: resolved", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(Node{Name: "d", Healthy: true}, 3*time.Minute))}, "d:Resolve", "back in sync"},
		{"healthy after proxyaudit cordoned: uncordon", policy(RestartAndCordon),
			Fleet{Nodes: append(healthy("a", "b", "c"), Node{Name: "d", Healthy: true,
				Incident: Incident{Stage: StageEscalated, Opened: ago(time.Hour), Cordoned: ago(time.Minute)}})}, "d:Uncordon", "uncordons"},
		{"max nodes at once", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f"), drifted("g"), drifted("h"), drifted("i"))},
			"g:RestartProxy h:RestartProxy i:Page", ""},
		{"max share of the fleet", func() Policy { p := policy(Restart); p.MaxConcurrent = 5; p.MaxUnhealthy = MustBudget("10%"); return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f", "g"), drifted("h"), drifted("i"), drifted("j"))},
			"h:RestartProxy i:Page j:Page", ""},
		{"a share that rounds to zero acts on nothing", func() Policy { p := policy(Restart); p.MaxUnhealthy = MustBudget("10%"); return p }(),
			Fleet{Nodes: []Node{Node{Name: "a", Healthy: true}, drifted("b")}}, "b:Page", "remediation budget reached"},
		// NodeHealthCheck's forms in a fleet of three, where a share of
		// 10% allows nothing.
		{"all but one of three: two at once", func() Policy { p := policy(Restart); p.MaxConcurrent = 3; p.MaxUnhealthy = MustBudget("-1"); return p }(),
			Fleet{Nodes: []Node{drifted("a"), drifted("b"), {Name: "c", Healthy: true}}}, "a:RestartProxy b:RestartProxy", ""},
		{"all but one of three: the third waits", func() Policy { p := policy(Restart); p.MaxConcurrent = 3; p.MaxUnhealthy = MustBudget("-1"); return p }(),
			Fleet{Nodes: []Node{restartedAgo(drifted("a"), time.Minute), restartedAgo(drifted("b"), time.Minute), drifted("c")}},
			"c:Page", "the smaller of --remediation-max-nodes 3 and --remediation-max-unhealthy -1 of the fleet"},
		{"all but three of three: none", func() Policy { p := policy(Restart); p.MaxUnhealthy = MustBudget("-3"); return p }(),
			Fleet{Nodes: []Node{drifted("a"), {Name: "b", Healthy: true}, {Name: "c", Healthy: true}}}, "a:Page", "remediation budget reached (0 node(s)"},
		{"an absolute budget in a fleet of three", func() Policy { p := policy(Restart); p.MaxUnhealthy = MustBudget("1"); return p }(),
			Fleet{Nodes: []Node{drifted("a"), drifted("b"), {Name: "c", Healthy: true}}}, "a:RestartProxy b:Page", ""},
		{"a share of three rounds down", func() Policy { p := policy(Restart); p.MaxConcurrent = 3; p.MaxUnhealthy = MustBudget("66%"); return p }(),
			Fleet{Nodes: []Node{drifted("a"), drifted("b"), {Name: "c", Healthy: true}}}, "a:RestartProxy b:Page", ""},
		{"nodes already in remediation count", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(drifted("d"), time.Minute), restartedAgo(drifted("e"), time.Minute), drifted("f"))},
			"f:Page", "remediation budget reached"},
		{"cooldown after a recent restart", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident.Restarts = []time.Time{ago(5 * time.Minute)}
				return n
			}())}, "d:Page", "cooldown"},
		{"backoff doubles per restart", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident.Restarts = []time.Time{ago(2 * time.Hour), ago(15 * time.Minute)}
				return n
			}())}, "d:Page", "cooldown"},
		{"restart budget", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident.Restarts = []time.Time{ago(5 * time.Hour), ago(4 * time.Hour), ago(3 * time.Hour)}
				return n
			}())}, "d:Page", "budget spent"},
		{"restarts outside the budget window do not count", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident.Restarts = []time.Time{ago(30 * time.Hour), ago(28 * time.Hour), ago(26 * time.Hour)}
				return n
			}())}, "d:RestartProxy", ""},
		{"breaker: once a share of the fleet was restarted within the window, no new node is", func() Policy { p := policy(Restart); p.BreakerShare = 0.1; return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f", "g", "h"), Node{Name: "i", Healthy: true, Incident: Incident{Restarts: []time.Time{ago(30 * time.Minute)}}},
				drifted("j"))}, "j:Page", "breaker open: 1 node(s)"},
		{"breaker: restarts before the window do not count", func() Policy { p := policy(Restart); p.BreakerShare = 0.1; return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f", "g", "h"), Node{Name: "i", Healthy: true, Incident: Incident{Restarts: []time.Time{ago(2 * time.Hour)}}},
				drifted("j"))}, "j:RestartProxy", ""},
		{"breaker: this round's restarts count", func() Policy { p := policy(Restart); p.BreakerShare, p.MaxConcurrent = 0.1, 5; return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q"), drifted("r"), drifted("s"), drifted("t"))},
			"r:RestartProxy s:RestartProxy t:Page", "breaker open: 2 node(s)"},
		{"storm guard: page only", policy(RestartAndCordon),
			Fleet{Storm: true, Nodes: append(healthy("a"), drifted("b"), drifted("c"), drifted("d"))}, "", ""},
		{"exempt by label", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node { n := drifted("d"); n.Exempt = "label proxyaudit.io/exempt"; return n }())}, "d:Page", "exempt"},
		{"being deleted", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node { n := drifted("d"); n.Leaving = "ToBeDeletedByClusterAutoscaler"; return n }())}, "d:Page", "going away"},
		{"static-pod kube-proxy: instructions", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node { n := drifted("d"); n.StaticProxy = true; return n }())}, "d:Page", "static pod"},
		{"an open incident is paged once", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Exempt = "label"
				n.Incident = Incident{Stage: StageOpen, Opened: ago(time.Minute)}
				return n
			}())}, "", ""},
		{"a blocked incident is repaired once allowed", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident = Incident{Stage: StageOpen, Opened: ago(time.Minute)}
				return n
			}())}, "d:RestartProxy", "again"},
		{"escalated incidents wait for a human", policy(RestartAndCordon),
			Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
				n := drifted("d")
				n.Incident = Incident{Stage: StageEscalated, Opened: ago(time.Hour), Cordoned: ago(time.Minute), Restarts: []time.Time{ago(time.Hour)}}
				return n
			}())}, "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Plan(t0, tc.policy, tc.fleet)
			if d := describe(got); d != tc.want {
				t.Fatalf("got %q, want %q\n%s", d, tc.want, reasons(got))
			}
			if last := len(got) - 1; tc.says != "" && !strings.Contains(got[0].Reason, tc.says) && !strings.Contains(got[last].Reason, tc.says) {
				t.Errorf("reasons %q do not say %q", reasons(got), tc.says)
			}
		})
	}
}

func reasons(as []Action) string {
	var b strings.Builder
	for _, a := range as {
		fmt.Fprintf(&b, "  %s %s: %s\n", a.Node, a.Kind, a.Reason)
	}
	return b.String()
}

// The ladder end to end, as rounds of the planner with the incident
// carried over (as the executor would keep it in annotations).
func TestPlanLadder(t *testing.T) {
	p := policy(RestartAndCordon)
	n := drifted("d")
	fleet := func() Fleet { return Fleet{Nodes: append(healthy("a", "b", "c"), n)} }
	step := func(at time.Duration, want string) {
		t.Helper()
		as := Plan(t0.Add(at), p, fleet())
		if d := describe(as); d != want {
			t.Fatalf("at %s: got %q, want %q\n%s", at, d, want, reasons(as))
		}
		for _, a := range as {
			n.Incident = a.Incident
		}
	}
	step(0, "d:RestartProxy")
	step(time.Minute, "")
	step(3*time.Minute, "d:Cordon")
	step(4*time.Minute, "")
	n.Drifted, n.Healthy, n.Unschedulable = false, true, true
	step(5*time.Minute, "d:Uncordon")
	if n.Incident.Stage != "" || len(n.Incident.Restarts) != 1 {
		t.Fatalf("after resolution: %+v", n.Incident)
	}
	// Drifting again soon after: the cooldown holds, people are told.
	n.Drifted, n.Healthy, n.Unschedulable = true, false, false
	step(6*time.Minute, "d:Page")
}

func TestParseMode(t *testing.T) {
	for _, m := range []string{"dry-run", "restart", "restart-and-cordon"} {
		if _, err := ParseMode(m); err != nil {
			t.Error(err)
		}
	}
	if _, err := ParseMode("cordon"); err == nil {
		t.Error("cordon accepted")
	}
}

// Every page instead of a repair names what held it, for the metric of
// held decisions; a silence holds a restart and a cordon alike.
func TestHeldDecisionsSayWhy(t *testing.T) {
	silenced := func(n Node) Node { n.Silenced = "silenced in Alertmanager by alice"; return n }
	restartedAgo := func(n Node, d time.Duration) Node {
		n.Incident = Incident{Stage: StageRestarted, Opened: t0.Add(-d), Restarts: []time.Time{t0.Add(-d)}}
		return n
	}
	windows := func(s string) Windows {
		w, err := ParseWindows(s)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	rc := policy(RestartAndCordon)
	for _, c := range []struct {
		name   string
		p      Policy
		f      Fleet
		held   string
		reason string
	}{
		{"silenced", rc, Fleet{Nodes: append(healthy("a", "b", "c"), silenced(drifted("d")))}, HeldSilenced, "not repaired: silenced in Alertmanager by alice"},
		{"silenced after a restart that did not help: not cordoned", rc,
			Fleet{Nodes: append(healthy("a", "b", "c"), silenced(restartedAgo(drifted("d"), 3*time.Minute)))}, HeldSilenced, "needs a human; not cordoned: silenced in Alertmanager"},
		{"paused", rc, Fleet{Nodes: append(healthy("a", "b", "c"), silenced(drifted("d"))), Paused: "by bob"}, HeldPaused, "remediation paused by bob"},
		{"window", func() Policy { p := rc; p.Windows = windows("Sat 01:00-02:00 UTC"); return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c"), drifted("d"))}, HeldWindow, "outside the maintenance windows"},
		{"budget", func() Policy { p := rc; p.MaxUnhealthy = MustBudget("0"); return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c"), drifted("d"))}, HeldBudget, "remediation budget reached"},
		{"exempt", rc, Fleet{Nodes: append(healthy("a", "b", "c"), func() Node { n := drifted("d"); n.Exempt = "label x"; return n }())}, HeldExempt, "exempt"},
		{"static kube-proxy", rc, Fleet{Nodes: append(healthy("a", "b", "c"), func() Node { n := drifted("d"); n.StaticProxy = true; return n }())}, HeldUnrestartable, "static pod"},
		{"cooldown", rc, Fleet{Nodes: append(healthy("a", "b", "c"), func() Node {
			n := drifted("d")
			n.Incident = Incident{Stage: StageOpen, Opened: ago(time.Hour)}
			n.Incident.Restarts = []time.Time{ago(5 * time.Minute)}
			n.Incident.Stage = ""
			return n
		}())}, HeldCooldown, "cooldown"},
		{"escalated without a hold names none", policy(Restart),
			Fleet{Nodes: append(healthy("a", "b", "c"), restartedAgo(drifted("d"), 3*time.Minute))}, "", "needs a human"},
	} {
		t.Run(c.name, func(t *testing.T) {
			as := Plan(t0, c.p, c.f)
			if len(as) != 1 || as[0].Kind != Page || as[0].Held != c.held || !strings.Contains(as[0].Reason, c.reason) {
				t.Fatalf("got %s held %q: %+v; want one page held %q saying %q", describe(as), func() string {
					if len(as) > 0 {
						return as[0].Held
					}
					return ""
				}(), as, c.held, c.reason)
			}
		})
	}
	// Once the silence is gone, the held incident is repaired.
	n := drifted("d")
	n.Incident = Incident{Stage: StageOpen, Opened: ago(time.Minute)}
	if as := Plan(t0, rc, Fleet{Nodes: append(healthy("a", "b", "c"), n)}); describe(as) != "d:RestartProxy" {
		t.Errorf("silence lifted: %s", describe(as))
	}
}

// One node that goes on reporting drift after proxyaudit cordoned it
// (broken for good, or compromised and lying about itself) must not hold
// every other node's repair: with the chart's default budget (one node),
// 20 nodes under restart-and-cordon for two days, a real stuck node
// elsewhere is restarted. Before, the cordoned liar counted against the
// budget for as long as it lied: 0 restarts, "held: budget". It still
// holds further cordons (the fleet's capacity), which say so.
func TestLyingCordonedNodeHoldsNoOtherRepair(t *testing.T) {
	p := DefaultPolicy()
	p.Mode, p.MaxConcurrent, p.MaxUnhealthy = RestartAndCordon, 1, MustBudget("10%")
	p.BreakerWindow = 0
	nodes := make([]Node, 20)
	for i := range nodes {
		nodes[i] = Node{Name: fmt.Sprintf("n%02d", i), Healthy: true}
	}
	liar, stuck, broken := 0, 7, 13
	restarts := map[string]int{}
	var heldCordon string
	now := t0
	for round := 0; now.Before(t0.Add(48 * time.Hour)); round++ {
		// The liar drifts from the start; a real stuck node a day in, and
		// a node a restart cannot fix too.
		nodes[liar].Drifted, nodes[liar].Healthy = true, false
		if now.After(t0.Add(24 * time.Hour)) {
			if restarts[nodes[stuck].Name] == 0 {
				nodes[stuck].Drifted, nodes[stuck].Healthy = true, false
			}
			nodes[broken].Drifted, nodes[broken].Healthy = true, false
		}
		for _, a := range Plan(now, p, Fleet{Nodes: nodes}) {
			i := map[string]int{nodes[liar].Name: liar, nodes[stuck].Name: stuck, nodes[broken].Name: broken}[a.Node]
			nodes[i].Incident = a.Incident
			switch a.Kind {
			case RestartProxy:
				restarts[a.Node]++
				if a.Node == nodes[stuck].Name { // the restart cures it
					nodes[stuck].Drifted, nodes[stuck].Healthy = false, true
				}
			case Cordon:
				nodes[i].Unschedulable = true
			case Page:
				if a.Node == nodes[broken].Name && a.Held == HeldBudget {
					heldCordon = a.Reason
				}
			}
		}
		now = now.Add(10 * time.Second)
	}
	if !nodes[liar].Unschedulable {
		t.Errorf("the liar was not cordoned: %+v", nodes[liar].Incident)
	}
	if restarts[nodes[stuck].Name] != 1 {
		t.Errorf("the stuck node was restarted %d times in two days beside a cordoned liar, want once", restarts[nodes[stuck].Name])
	}
	if restarts[nodes[broken].Name] == 0 {
		t.Errorf("the broken node was never restarted")
	}
	if nodes[broken].Unschedulable || !strings.Contains(heldCordon, "cordon budget reached") {
		t.Errorf("a second node was cordoned beside the liar (budget one), or its page does not say why not: %q", heldCordon)
	}
}
