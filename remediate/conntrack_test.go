package remediate

import (
	"strings"
	"testing"
	"time"
)

func stale(name string, pairs ...StalePair) Node {
	return Node{Name: name, Healthy: true, Stale: pairs}
}

var (
	dnsPair   = StalePair{Service: "kube-system/kube-dns", Port: "dns", Protocol: "UDP", Frontend: "198.19.0.10:53/UDP", Dest: "198.18.132.2:53", Flows: 4}
	tcpPair   = StalePair{Service: "shop/api", Port: "http", Protocol: "TCP", Frontend: "198.19.0.20:80/TCP", Dest: "198.18.132.9:8080", Flows: 1}
	flushable = func() Policy { p := policy(Restart); p.Conntrack.Enabled = true; return p }
)

func TestPlanFlushes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		policy Policy
		fleet  Fleet
		want   string
		says   string // in the last action's reason
	}{
		{"off by default", policy(Restart), Fleet{Nodes: append(healthy("a", "b"), stale("c", dnsPair))}, "", ""},
		{"a node in sync has its stale UDP entries deleted", flushable(),
			Fleet{Nodes: append(healthy("a", "b"), stale("c", dnsPair))}, "c:FlushConntrack", "198.19.0.10:53/UDP (kube-system/kube-dns) → 198.18.132.2:53: 4 flow(s)"},
		{"dry-run says what it would delete", func() Policy { p := flushable(); p.Mode = DryRun; return p }(),
			Fleet{Nodes: append(healthy("a", "b"), stale("c", dnsPair))}, "c:FlushConntrack[dry]", "deleting exactly those"},
		{"TCP only when the service is named", flushable(),
			Fleet{Nodes: append(healthy("a", "b"), stale("c", tcpPair))}, "", ""},
		{"TCP of a named service", func() Policy { p := flushable(); p.Conntrack.TCPServices = map[string]bool{"shop/api": true}; return p }(),
			Fleet{Nodes: append(healthy("a", "b"), stale("c", tcpPair, dnsPair))}, "c:FlushConntrack", "5 flow(s)"},
		{"a drifted node gets the restart, not a flush", flushable(),
			Fleet{Nodes: append(healthy("a", "b"), func() Node { n := drifted("c"); n.Stale = []StalePair{dnsPair}; return n }())}, "c:RestartProxy", ""},
		{"a node with an open incident waits for it", flushable(),
			Fleet{Nodes: append(healthy("a", "b"), func() Node {
				n := stale("c", dnsPair)
				n.Incident = Incident{Stage: StageRestarted, Opened: ago(3 * time.Minute), Restarts: []time.Time{ago(3 * time.Minute)}}
				return n
			}())}, "c:Resolve", "back in sync"},
		{"no flush in a storm", flushable(), Fleet{Storm: true, Nodes: append(healthy("a", "b"), stale("c", dnsPair))}, "", ""},
		{"paused: paged, not deleted", flushable(), Fleet{Paused: "by ops", Nodes: append(healthy("a", "b"), stale("c", dnsPair))}, "c:Page", "not deleted: remediation paused by ops"},
		{"exempt", flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node { n := stale("c", dnsPair); n.Exempt = "label x"; return n }())}, "c:Page", "exempt"},
		{"silenced", flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node { n := stale("c", dnsPair); n.Silenced = "silenced by ana"; return n }())}, "c:Page", "silenced by ana"},
		{"a held flush is paged once", flushable(), Fleet{Paused: "by ops", Nodes: append(healthy("a", "b"), func() Node {
			n := stale("c", dnsPair)
			n.Incident.FlushHeld = heldSig(HeldPaused, describePairs([]StalePair{dnsPair}))
			return n
		}())}, "", ""},
		{"just flushed: waits for the collector's next counts, silently", flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node {
			n := stale("c", dnsPair)
			n.Incident.Flushes = []time.Time{ago(time.Second)}
			return n
		}())}, "", ""},
		{"still stale after the recheck, in cooldown: paged", flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node {
			n := stale("c", dnsPair)
			n.Incident.Flushes = []time.Time{ago(3 * time.Minute)}
			return n
		}())}, "c:Page", "in cooldown"},
		{"budget of flushes per node", flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node {
			n := stale("c", dnsPair)
			n.Incident.Flushes = []time.Time{ago(5 * time.Hour), ago(4 * time.Hour), ago(3 * time.Hour)}
			return n
		}())}, "c:Page", "flush budget spent"},
		{"the fleet budget holds flushes too", flushable(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d"), stale("e", dnsPair), stale("f", dnsPair), stale("g", dnsPair))},
			"e:FlushConntrack f:FlushConntrack g:Page", "remediation budget reached"},
		{"a restart this round takes the fleet budget first", func() Policy { p := flushable(); p.MaxConcurrent = 1; return p }(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d"), drifted("e"), stale("f", dnsPair))}, "e:RestartProxy f:Page", "budget"},
		{"the breaker counts flushed nodes", func() Policy {
			p := flushable()
			p.MaxConcurrent = 5
			p.MaxUnhealthy = MustBudget("100%")
			p.BreakerShare = 0.2
			return p
		}(),
			Fleet{Nodes: append(healthy("a", "b", "c", "d", "e", "f", "g"), stale("x", dnsPair), stale("y", dnsPair), stale("z", dnsPair))},
			"x:FlushConntrack y:FlushConntrack z:Page", "breaker open: 2 node(s) had conntrack entries deleted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := Plan(t0, tc.policy, tc.fleet)
			if describe(got) != tc.want {
				t.Fatalf("got %q, want %q (%+v)", describe(got), tc.want, got)
			}
			if tc.says != "" && !strings.Contains(got[len(got)-1].Reason, tc.says) {
				t.Fatalf("reason %q does not say %q", got[len(got)-1].Reason, tc.says)
			}
		})
	}
}

func TestFlushRecorded(t *testing.T) {
	got := Plan(t0, flushable(), Fleet{Nodes: append(healthy("a", "b"), stale("c", dnsPair))})
	if len(got) != 1 || len(got[0].Flush) != 1 || got[0].Flush[0] != dnsPair {
		t.Fatalf("flush of %+v", got)
	}
	inc := got[0].Incident
	if inc.Stage != "" || len(inc.Flushes) != 1 || !inc.Flushes[0].Equal(t0) || inc.Empty() {
		t.Fatalf("incident after the flush %+v", inc)
	}
	back, err := DecodeIncident(inc.Encode(), t0)
	if err != nil || back.Encode() != inc.Encode() {
		t.Fatalf("record round trip: %v %s vs %s", err, back.Encode(), inc.Encode())
	}
	// A held page is remembered in the record: the next round does not page
	// again, a different hold does.
	held := Plan(t0, flushable(), Fleet{Paused: "by ops", Nodes: append(healthy("a", "b"), stale("c", dnsPair))})
	n := stale("c", dnsPair)
	n.Incident = held[0].Incident
	if again := Plan(t0.Add(time.Minute), flushable(), Fleet{Paused: "by ops", Nodes: append(healthy("a", "b"), n)}); len(again) != 0 {
		t.Fatalf("paged again: %+v", again)
	}
	if other := Plan(t0.Add(time.Minute), flushable(), Fleet{Nodes: append(healthy("a", "b"), func() Node { m := n; m.Exempt = "label"; return m }())}); describe(other) != "c:Page" {
		t.Fatalf("a new hold: %q", describe(other))
	}
	// Once the flows are gone, the held page is resolved (and the record
	// forgets it).
	gone := Node{Name: "c", Healthy: true, Incident: held[0].Incident}
	if res := Plan(t0.Add(time.Hour), flushable(), Fleet{Nodes: append(healthy("a", "b"), gone)}); describe(res) != "c:Resolve" || res[0].Incident.FlushHeld != "" {
		t.Fatalf("flows gone after a held page: %+v", res)
	}
	// A resolve keeps the flush history (the budget is per node).
	r := Node{Name: "c", Healthy: true, Incident: Incident{Stage: StageOpen, Opened: ago(time.Hour), Flushes: []time.Time{ago(time.Minute)}}}
	if res := Plan(t0, flushable(), Fleet{Nodes: append(healthy("a", "b"), r)}); len(res) != 1 || len(res[0].Incident.Flushes) != 1 {
		t.Fatalf("resolve lost the flushes: %+v", res)
	}
}
