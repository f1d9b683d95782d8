package aggregator

import (
	"slices"
	"strings"

	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// assessor assesses nodes' rules against the cluster state, sharing what
// it can between nodes and between cycles. Evaluate's goroutine alone
// uses it.
type assessor struct {
	metrics *Metrics
	clock   clock.PassiveClock
	// shared is what nodes share at the current cluster generation, deps
	// what each service's expectations depend on, donors the newest
	// baseline per mode and zone (see baseline).
	shared *generation
	deps   audit.Dependents
	donors map[string]*baseline
	// isolated turns peers' baselines and shared service assessments
	// off: the comparison benchmarks' "before".
	isolated bool
}

// generation holds what Evaluate shares between nodes at one cluster
// generation (Evaluate's goroutine only).
type generation struct {
	gen uint64
	// nodes: the assessments made, by node class and root.
	nodes map[[2]uint64][]assessed
	// services: one service's assessment for every node showing the same
	// frontends for it whose expectations of it are the same.
	services map[serviceMemoKey][]serviceAssessed
	// keys: each service's frontend keys over its kept versions.
	keys map[string][]string
	// current indexes the State's services by namespace/name.
	current map[string]*audit.Service
}

type serviceMemoKey struct {
	svc, node, mode string
	families        uint8
	shown           uint64
}

type serviceAssessed struct {
	shown stream.Shown
	x     audit.ServiceAssessment
}

// startGeneration resets what Evaluate shares between nodes when the
// cluster State changed, and brings the services' node dependence up to
// the History.
func (a *assessor) startGeneration(st *audit.State, h *audit.History, gen uint64) {
	if a.shared != nil && a.shared.gen == gen {
		return
	}
	a.deps.Update(h)
	g := &generation{gen: gen, nodes: map[[2]uint64][]assessed{}, services: map[serviceMemoKey][]serviceAssessed{},
		keys: map[string][]string{}, current: make(map[string]*audit.Service, len(st.Services))}
	for i := range st.Services {
		s := &st.Services[i]
		g.current[s.Namespace+"/"+s.Name] = s
	}
	a.shared = g
	if a.donors == nil {
		a.donors = map[string]*baseline{}
	}
}

// assessNode assesses one node's rules: shared with a node of its class
// showing the same rules at this cluster generation, else from the node's
// baseline when it has one, else from a peer's, else in full (IPVS nodes,
// nodes without rules, the first node of its mode). startGeneration must
// have run for st.
func (a *assessor) assessNode(st *audit.State, h *audit.History, n *node, rules *stream.State) []audit.ServiceAssessment {
	zone := st.Nodes[n.name].Zone
	peerKey := rules.Mode + "|" + famKey(rules.Families) + "|" + zone
	as := a.assess(n.name, zone, rules, func() ([]audit.ServiceAssessment, string) {
		if as, ok := a.incremental(st, h, n.name, zone, n.base, rules); ok {
			return as, "incremental"
		}
		if p := a.donors[peerKey]; p != nil && p != n.base && !a.isolated {
			if as, ok := a.incremental(st, h, n.name, zone, p, rules); ok {
				return as, "peer"
			}
		}
		return audit.Assess(st, h, n.name, rules.Observed()), "computed"
	})
	n.base = &baseline{rules: *rules, touchSeq: h.TouchSeq(), node: n.name, zone: zone, services: as}
	if len(as) > 0 && as[0].Service == "" { // sorted: rules no service owns come first
		n.base.services = as[1:]
		// Rare: tampered or long-stale rules.
		mode := audit.Mode(rules.Mode)
		rules.ParsedKeys(func(key string, k audit.FrontendKey) {
			if _, owned := h.Owner(k, mode); !owned {
				n.base.unowned = append(n.base.unowned, key)
			}
		})
	}
	if incrementable(rules) {
		a.donors[peerKey] = n.base
	}
	return as
}

// incrementable says whether a node's rules can be assessed from a
// baseline: IPVS and Cilium have per-address node port frontends no
// service's keys name.
func incrementable(rules *stream.State) bool {
	return rules.Mode != string(audit.ModeIPVS) && rules.Mode != string(audit.ModeCilium) && !rules.NoRules
}

// famKey packs IP families into a comparable value's string.
func famKey(fams []int) string {
	return string([]byte{famBits(fams)})
}

func famBits(fams []int) uint8 {
	var b uint8
	for _, f := range fams {
		b |= 1 << (f & 7)
	}
	return b
}

// incremental reassesses from baseline b (the node's own, or a peer's)
// only the services that changed since, or whose expectations differ
// between b's node and this one; ok is false when b cannot serve.
func (a *assessor) incremental(st *audit.State, h *audit.History, node, zone string, b *baseline, rules *stream.State) ([]audit.ServiceAssessment, bool) {
	if b == nil || !incrementable(rules) || b.rules.Mode != rules.Mode || b.rules.NoRules || !slices.Equal(b.rules.Families, rules.Families) {
		return nil, false
	}
	touched, ok := h.TouchedSince(b.touchSeq)
	// One service costs ~12 µs, a full assessment at the anchors ~0.2 s:
	// incremental wins until about everything changed. (At a quarter, a
	// node assessed late fell to the full path, which made the next ones
	// later: the aggregator fell behind under churn.)
	if !ok || len(touched) > len(st.Services)+16 {
		return nil, false
	}
	mode := audit.Mode(rules.Mode)
	redo := map[string]bool{}
	for _, s := range touched {
		redo[s] = true
	}
	var changed []string
	stream.ChangedKeys(&b.rules, rules, func(key string) {
		changed = append(changed, key)
		if k, err := stream.ParseKey(key); err == nil {
			if o, owned := h.Owner(k, mode); owned {
				redo[o] = true
			}
		}
	})
	a.deps.Differ(b.node, b.zone, node, zone, func(svc string) { redo[svc] = true })
	out := make([]audit.ServiceAssessment, 0, len(b.services)+1)
	for _, x := range b.services {
		if !redo[x.Service] {
			out = append(out, x)
		}
	}
	for svc := range redo {
		if x := a.assessService(st, h, node, zone, rules, svc); x.State != audit.InSync || len(x.Draining) > 0 {
			out = append(out, x)
		}
	}
	// Frontends no kept version of any service has: one divergent
	// assessment, as Assess makes it. Unless some frontend lost its last
	// owner since the baseline, only those unowned then and those changed
	// since can be now (a full walk costs ~1.5 ms at the anchors).
	var unowned []audit.Finding
	check := func(key string, k audit.FrontendKey) {
		if _, owned := h.Owner(k, mode); owned {
			return
		}
		f, _ := rules.Get(key)
		if of, err := f.ToObserved(); err == nil {
			unowned = append(unowned, audit.UnownedFrontend(node, of))
		}
	}
	if h.OwnersLostSince(b.touchSeq) {
		rules.ParsedKeys(check)
	} else {
		seen := map[string]bool{}
		for _, key := range slices.Concat(b.unowned, changed) {
			if seen[key] {
				continue
			}
			seen[key] = true
			if _, ok := rules.Get(key); !ok {
				continue
			}
			if k, err := stream.ParseKey(key); err == nil {
				check(key, k)
			}
		}
	}
	if len(unowned) > 0 {
		audit.SortFindings(unowned)
		out = append(out, audit.ServiceAssessment{State: audit.Divergent, Findings: unowned})
	}
	slices.SortFunc(out, func(x, y audit.ServiceAssessment) int { return strings.Compare(x.Service, y.Service) })
	if len(out) == 0 {
		return nil, true
	}
	return out, true
}

// assessService assesses one service on one node, once per generation for
// every node that shows the same frontends for it and expects the same of
// it (the same mode, families, and audit.Dependents key): after a leader
// change, or under churn, thousands of nodes reassess the same services,
// and most show one of a few versions of each.
func (a *assessor) assessService(st *audit.State, h *audit.History, node, zone string, rules *stream.State, svc string) audit.ServiceAssessment {
	g := a.shared
	keys, ok := g.keys[svc]
	if !ok {
		for _, k := range h.ServiceKeys(svc) {
			keys = append(keys, stream.KeyString(k))
		}
		g.keys[svc] = keys
	}
	shown := rules.Show(keys)
	mk := serviceMemoKey{svc: svc, node: a.deps.Key(svc, node, zone), mode: rules.Mode, families: famBits(rules.Families), shown: shown.Hash()}
	for _, m := range g.services[mk] {
		if m.shown.Same(shown) && !a.isolated {
			a.metrics.ServiceAssessments.WithLabelValues("shared").Inc()
			return m.x
		}
	}
	obs := &audit.Observed{Mode: audit.Mode(rules.Mode), Families: slices.Clone(rules.Families)}
	if len(obs.Families) == 0 {
		obs.Families = []int{4}
	}
	for _, f := range shown.Frontends() {
		if of, err := f.ToObserved(); err == nil {
			obs.Frontends = append(obs.Frontends, of)
		}
	}
	x := audit.AssessService(st, h, node, obs, svc, g.current[svc])
	a.metrics.ServiceAssessments.WithLabelValues("computed").Inc()
	g.services[mk] = append(g.services[mk], serviceAssessed{shown: shown, x: x})
	return x
}

// assessed is one node's rules judged at one cluster generation: every
// node of the same class showing the very same rules gets its findings.
type assessed struct {
	rules *stream.State
	as    []audit.ServiceAssessment
}

// assess judges one node's rules through compute, once per distinct rules
// and node class at a cluster generation: a fleet mostly shows a handful
// of versions of the same rules. compute says how it assessed (computed in
// full, incremental, from a peer's baseline).
func (a *assessor) assess(node, zone string, rules *stream.State, compute func() ([]audit.ServiceAssessment, string)) []audit.ServiceAssessment {
	g := a.shared
	key := [2]uint64{a.deps.Class(node, zone), rules.Root()}
	for _, m := range g.nodes[key] {
		if m.rules.Same(rules) {
			a.metrics.Assessments.WithLabelValues("shared").Inc()
			// Shared as they are: they name the node they were made for,
			// and the judge names the node it reports on (155 KB per
			// lagging node at the anchors were mostly these copies).
			return m.as
		}
	}
	t := a.clock.Now()
	as, how := compute()
	a.metrics.Reconcile.WithLabelValues("assess").Observe(a.clock.Since(t).Seconds())
	a.metrics.Assessments.WithLabelValues(how).Inc()
	g.nodes[key] = append(g.nodes[key], assessed{rules: rules, as: as})
	return as
}
