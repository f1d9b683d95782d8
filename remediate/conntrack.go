package remediate

import (
	"fmt"
	"hash/fnv"
	"math"
	"slices"
	"strings"
	"time"
)

// ConntrackPolicy says whether stale conntrack entries are deleted.
type ConntrackPolicy struct {
	// Enabled: delete the stale UDP entries of nodes whose rules are in
	// sync (kube-proxy's own cleanup, where it did not happen).
	Enabled bool
	// TCPServices ("namespace/name") also have their stale TCP connection
	// attempts (SYN_SENT) deleted. An answered TCP connection is never
	// deleted: the collector refuses it whatever it is asked.
	TCPServices map[string]bool
}

// StalePair is one frontend's stale flows to one gone destination: what a
// StaleConntrack finding names.
type StalePair struct {
	Service  string // namespace/name
	Port     string // the service port's name
	Protocol string // UDP, TCP
	// Frontend is the flows' original destination (audit.FrontendKey's
	// wire form), Dest where they are still DNATed to.
	Frontend, Dest string
	Flows          int
}

// FlushResult is what a node's collector did with one pair: how many
// entries it deleted, or why it refused.
type FlushResult struct {
	Deleted int
	Refused string
}

func (s StalePair) String() string {
	return fmt.Sprintf("%s (%s) → %s: %d flow(s)", s.Frontend, s.Service, s.Dest, s.Flows)
}

// planFlushes decides the conntrack flushes of this round, after the
// rules' ladder (out): for each node whose rules are in sync, that has no
// incident and no action this round, and whose collector reported flows
// still DNATed to endpoints that left. A node whose rules are wrong gets
// the restart instead: a new kube-proxy cleans its conntrack as it syncs,
// and a flush under stale rules would DNAT the next packet to the same
// gone pod. Flushes keep the same fleet budget and breaker as restarts
// (counted apart) and the same holds, per-node cooldown and budget.
func planFlushes(now time.Time, p Policy, nodes []Node, out []Action, busy *int, limit int, hold, holdWhy string) []Action {
	acted := map[string]bool{}
	for _, a := range out {
		acted[a.Node] = true
	}
	flushed, breaker := 0, max(1, int(math.Ceil(p.BreakerShare*float64(len(nodes)))))
	for _, n := range nodes {
		if p.BreakerWindow > 0 && len(recent(n.Incident.Flushes, now, p.BreakerWindow)) > 0 {
			flushed++
		}
	}
	for _, n := range nodes {
		if !n.Healthy || n.Incident.Stage != "" || acted[n.Name] {
			continue
		}
		var pairs []StalePair
		for _, s := range n.Stale {
			if s.Protocol == "UDP" || (s.Protocol == "TCP" && p.Conntrack.TCPServices[s.Service]) {
				pairs = append(pairs, s)
			}
		}
		inc := n.Incident
		if len(pairs) == 0 {
			if inc.FlushHeld != "" {
				// A held flush was paged; the flows are gone since.
				inc.FlushHeld = ""
				out = append(out, Action{Kind: Resolve, Node: n.Name, Incident: inc, Reason: "StaleConntrack: the stale flows paged before are gone"})
			}
			continue
		}
		inc.Flushes = recent(inc.Flushes, now, p.BudgetWindow)
		fresh := p.BreakerWindow > 0 && len(recent(inc.Flushes, now, p.BreakerWindow)) == 0
		held, why := "", ""
		switch {
		case n.Exempt != "":
			held, why = HeldExempt, "node is exempt ("+n.Exempt+")"
		case n.Leaving != "":
			held, why = HeldLeaving, "node is going away ("+n.Leaving+")"
		case hold != "":
			held, why = holdWhy, hold
		case n.Silenced != "":
			held, why = HeldSilenced, n.Silenced
		case len(inc.Flushes) >= p.RestartBudget:
			held, why = HeldSpent, fmt.Sprintf("conntrack flush budget spent (%d in %s): flows keep going stale after being deleted; look for what re-creates them", len(inc.Flushes), p.BudgetWindow)
		case len(inc.Flushes) > 0 && now.Sub(last(inc.Flushes)) < backoff(p, len(inc.Flushes)):
			held, why = HeldCooldown, fmt.Sprintf("flushed %s ago, in cooldown until %s", now.Sub(last(inc.Flushes)).Round(time.Second), last(inc.Flushes).Add(backoff(p, len(inc.Flushes))).UTC().Format(time.RFC3339))
		case *busy >= limit:
			held, why = HeldBudget, fmt.Sprintf("remediation budget reached (%d node(s) at once)", limit)
		case fresh && flushed >= breaker:
			held, why = HeldBreaker, fmt.Sprintf("remediation breaker open: %d node(s) had conntrack entries deleted in the last %s (limit %d: --remediation-breaker-share %g of the fleet); a cause common to them (a kube-proxy release, proxyaudit itself) is likelier", flushed, p.BreakerWindow, breaker, p.BreakerShare)
		}
		if held == HeldCooldown && now.Sub(last(inc.Flushes)) < p.Recheck {
			// Flushed moments ago: the collector's next counts show it.
			// Flows still stale after Recheck are paged (and flushed
			// again once the cooldown ends).
			continue
		}
		what := describePairs(pairs)
		if held != "" {
			sig := heldSig(held, what)
			if inc.FlushHeld == sig {
				continue // paged already
			}
			inc.FlushHeld = sig
			out = append(out, Action{Kind: Page, Node: n.Name, Held: held, Incident: inc,
				Reason: "StaleConntrack: " + what + "; not deleted: " + why})
			continue
		}
		inc.Flushes, inc.FlushHeld = append(inc.Flushes, now), ""
		*busy++
		if fresh {
			flushed++
		}
		out = append(out, Action{Kind: FlushConntrack, Node: n.Name, DryRun: p.Mode == DryRun, Incident: inc, Flush: pairs,
			Reason: "StaleConntrack: " + what + "; the node's rules are in sync: deleting exactly those conntrack entries, so the clients' next packets take the rules"})
	}
	return out
}

// heldSig names a hold and the pairs it held, short: it is kept per node
// in the incident record (a ConfigMap), where a fleet's worth of paged
// holds must fit.
func heldSig(held, what string) string {
	h := fnv.New64a()
	h.Write([]byte(what))
	return fmt.Sprintf("%s:%016x", held, h.Sum64())
}

// describePairs names pairs for a page, sorted, at most five.
func describePairs(pairs []StalePair) string {
	s := make([]string, 0, len(pairs))
	flows := 0
	for _, p := range pairs {
		s = append(s, p.String())
		flows += p.Flows
	}
	slices.Sort(s)
	if len(s) > 5 {
		s = append(s[:5], fmt.Sprintf("and %d more", len(s)-5))
	}
	return fmt.Sprintf("%d flow(s) still DNATed to endpoints that left their service: %s", flows, strings.Join(s, "; "))
}
