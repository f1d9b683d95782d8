package aggregator

import (
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// baseline is a node's last assessment and what it was made from, so the
// next one reassesses only the services that changed since: those whose
// kept versions the History touched, and those owning a frontend the
// node's rules changed. At the anchors a full assessment costs ~0.2-0.4 s;
// under 100 changes a second a node's report changes a few hundred.
type baseline struct {
	rules     stream.State
	touchSeq  uint64
	class     uint64
	byService map[string]audit.ServiceAssessment // not in sync, or draining
}

// assessNode assesses one node's rules: shared with a node of its class
// showing the same rules at this cluster generation, else from the node's
// baseline when it has one, else in full (IPVS nodes, nodes without rules,
// a changed class, a large change).
func (a *Aggregator) assessNode(st *audit.State, h *audit.History, n *node, rules *stream.State) []audit.ServiceAssessment {
	class := a.classes(n.name)
	as := a.assess(n.name, rules, func() ([]audit.ServiceAssessment, string) {
		if as, ok := a.incremental(st, h, n, rules, class); ok {
			return as, "incremental"
		}
		return audit.Assess(st, h, n.name, rules.Observed()), "computed"
	})
	n.base = &baseline{rules: *rules, touchSeq: h.TouchSeq(), class: class, byService: make(map[string]audit.ServiceAssessment, len(as))}
	for _, x := range as {
		if x.Service != "" {
			n.base.byService[x.Service] = x
		}
	}
	return as
}

// incremental reassesses from the node's baseline only the services that
// changed since; ok is false when the baseline cannot serve.
func (a *Aggregator) incremental(st *audit.State, h *audit.History, n *node, rules *stream.State, class uint64) ([]audit.ServiceAssessment, bool) {
	b := n.base
	if b == nil || b.class != class || rules.Mode == string(audit.ModeIPVS) || rules.NoRules ||
		b.rules.Mode != rules.Mode || b.rules.NoRules || !slices.Equal(b.rules.Families, rules.Families) {
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
	stream.ChangedKeys(&b.rules, rules, func(key string) {
		if k, err := stream.ParseKey(key); err == nil {
			if o, owned := h.Owner(k, mode); owned {
				redo[o] = true
			}
		}
	})
	byService := make(map[string]audit.ServiceAssessment, len(b.byService))
	for k, v := range b.byService {
		byService[k] = v
	}
	current := a.currentServices(st)
	for svc := range redo {
		obs := &audit.Observed{Mode: mode, Families: slices.Clone(rules.Families)}
		if len(obs.Families) == 0 {
			obs.Families = []int{4}
		}
		for _, k := range h.ServiceKeys(svc) {
			if f, ok := rules.Get(stream.KeyString(k)); ok {
				if of, err := f.ToObserved(); err == nil {
					obs.Frontends = append(obs.Frontends, of)
				}
			}
		}
		x := audit.AssessService(st, h, n.name, obs, svc, current[svc])
		if x.State == audit.InSync && len(x.Draining) == 0 {
			delete(byService, svc)
		} else {
			byService[svc] = x
		}
	}

	out := make([]audit.ServiceAssessment, 0, len(byService)+1)
	for _, x := range byService {
		out = append(out, x)
	}
	// Frontends no kept version of any service has: one divergent
	// assessment, as Assess makes it.
	var unowned []audit.Finding
	rules.Keys(func(key string) {
		k, err := stream.ParseKey(key)
		if err != nil {
			return
		}
		if _, owned := h.Owner(k, mode); owned {
			return
		}
		f, _ := rules.Get(key)
		if of, err := f.ToObserved(); err == nil {
			unowned = append(unowned, audit.UnownedFrontend(n.name, of))
		}
	})
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

// currentServices indexes the current services by namespace/name, once per
// cluster generation.
func (a *Aggregator) currentServices(st *audit.State) map[string]*audit.Service {
	if a.current == nil || a.currentOf != st {
		a.current, a.currentOf = make(map[string]*audit.Service, len(st.Services)), st
		for i := range st.Services {
			s := &st.Services[i]
			a.current[s.Namespace+"/"+s.Name] = s
		}
	}
	return a.current
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
// full, incremental).
func (a *Aggregator) assess(node string, rules *stream.State, compute func() ([]audit.ServiceAssessment, string)) []audit.ServiceAssessment {
	key := [2]uint64{a.classes(node), rules.Root()}
	for _, m := range a.memo[key] {
		if m.rules.Same(rules) {
			a.cfg.Metrics.Assessments.WithLabelValues("shared").Inc()
			// Shared as they are: they name the node they were made for,
			// and the judge names the node it reports on (155 KB per
			// lagging node at the anchors were mostly these copies).
			return m.as
		}
	}
	t := a.cfg.Clock.Now()
	as, how := compute()
	a.cfg.Metrics.Reconcile.WithLabelValues("assess").Observe(a.cfg.Clock.Since(t).Seconds())
	a.cfg.Metrics.Assessments.WithLabelValues(how).Inc()
	a.memo[key] = append(a.memo[key], assessed{rules: rules, as: as})
	return as
}
