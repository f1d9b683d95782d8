package audit

import (
	"sort"
	"time"
)

// ServiceState is how a node's rules for one service compare with the
// cluster.
type ServiceState string

// Service states.
const (
	InSync    ServiceState = "InSync"
	Lagging   ServiceState = "Lagging"
	Divergent ServiceState = "Divergent"
)

// ServiceAssessment says how one service differs on one node.
type ServiceAssessment struct {
	// Service is namespace/name; empty for rules no known service owns.
	Service string
	State   ServiceState
	// Since is when the node fell behind, for Lagging: when the version
	// after the one the node shows appeared. Zero for Divergent: only the
	// caller knows when it first saw the divergence.
	Since time.Time
	// Findings are the differences from the current version.
	Findings []Finding
	// Draining are IPVS real servers at weight 0 that the current version
	// no longer lists: normal while their connections last, a leftover
	// once older than the judge's WeightZeroLimit. A service with only
	// these is InSync.
	Draining []Finding
}

// Assess compares a node's rules with the current cluster state (which
// h.Update must have recorded) and, for
// every service that differs, with the service's recent versions. It
// returns only services that are not in sync or hold draining IPVS real
// servers, sorted by service; a node
// with no rules at all returns nil (the caller reports NoRules).
func Assess(st *State, h *History, node string, obs *Observed) []ServiceAssessment {
	if obs.NoRules {
		return nil
	}
	exp := ExpectedFor(st, node)
	raw := Diff(exp, obs)
	drain := Draining(exp, obs)
	if len(raw) == 0 && len(drain) == 0 {
		return nil
	}
	current := make(map[string]*Service, len(st.Services))
	for i := range st.Services {
		s := &st.Services[i]
		current[s.Namespace+"/"+s.Name] = s
	}
	expected := map[FrontendKey]bool{}
	for _, p := range exp.Ports {
		for _, fe := range p.Frontends {
			expected[fe.FrontendKey] = true
		}
	}
	byKey := make(map[FrontendKey]*ObservedFrontend, len(obs.Frontends))
	affected := map[string]bool{}
	var unowned []ObservedFrontend
	for i := range obs.Frontends {
		of := &obs.Frontends[i]
		byKey[of.FrontendKey] = of
		if expected[of.FrontendKey.external()] {
			continue
		}
		if o, ok := ownerOf(h.owner, of, obs.Mode); ok {
			affected[o] = true
		} else {
			unowned = append(unowned, *of)
		}
	}
	for _, f := range raw {
		if f.Kind != StaleService && f.Service != "" && current[f.Service] != nil {
			affected[f.Service] = true
		}
	}
	draining := map[string][]Finding{}
	for _, f := range drain {
		draining[f.Service] = append(draining[f.Service], f)
		affected[f.Service] = true
	}
	var out []ServiceAssessment
	for svc := range affected {
		a := assessService(st, h, node, obs, byKey, svc, current[svc])
		a.Draining = draining[svc]
		if a.State != InSync || len(a.Draining) > 0 {
			out = append(out, a)
		}
	}
	if len(unowned) > 0 {
		a := ServiceAssessment{State: Divergent}
		for _, of := range unowned {
			f := staleService(of)
			f.Node = node
			a.Findings = append(a.Findings, f)
		}
		SortFindings(a.Findings)
		out = append(out, a)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Service < out[j].Service })
	return out
}

// AssessService assesses one service on one node, as Assess does for
// each service it finds affected. obs must hold the node's frontends for
// the service's keys (ServiceKeys; in IPVS mode also the per-address
// virtual servers of its node ports), and may hold more. cur is the
// service's current version (nil when deleted). The result is InSync with
// no draining when the node shows the current version.
func AssessService(st *State, h *History, node string, obs *Observed, svc string, cur *Service) ServiceAssessment {
	byKey := make(map[FrontendKey]*ObservedFrontend, len(obs.Frontends))
	for i := range obs.Frontends {
		byKey[obs.Frontends[i].FrontendKey] = &obs.Frontends[i]
	}
	a := assessService(st, h, node, obs, byKey, svc, cur)
	// Only IPVS has weights: elsewhere nothing can be draining.
	if cur != nil && obs.Mode == ModeIPVS {
		one := &State{Nodes: st.Nodes, Services: []Service{*cur}}
		keys := map[FrontendKey]bool{}
		for _, k := range h.ServiceKeys(svc) {
			keys[k] = true
		}
		a.Draining = Draining(ExpectedFor(one, node), restrict(obs, byKey, keys))
	}
	return a
}

func ownerOf(owner map[FrontendKey]string, of *ObservedFrontend, mode Mode) (string, bool) {
	if o, ok := owner[of.FrontendKey.external()]; ok {
		return o, true
	}
	if mode.perAddressNodePorts() && !of.NodePort {
		// IPVS has a virtual server per node address for a node port,
		// Cilium a service entry.
		o, ok := owner[of.nodePortOf()]
		return o, ok
	}
	return "", false
}

// assessService matches the node's rules for one service against its
// current and then older versions.
func assessService(st *State, h *History, node string, obs *Observed, byKey map[FrontendKey]*ObservedFrontend, svc string, cur *Service) ServiceAssessment {
	versions := h.Versions(svc)
	// Every frontend any version had: rules for a frontend the version
	// lacks count against that version.
	keys := map[FrontendKey]bool{}
	if cur != nil {
		for _, k := range serviceKeys(cur) {
			keys[k] = true
		}
	}
	for _, v := range versions {
		if v.Svc != nil {
			for _, k := range serviceKeys(v.Svc) {
				keys[k] = true
			}
		}
	}
	mine := restrict(obs, byKey, keys)
	diffAt := func(s *Service) []Finding {
		one := &State{Nodes: st.Nodes}
		if s != nil {
			one.Services = []Service{*s}
		}
		return Diff(ExpectedFor(one, node), mine)
	}
	a := ServiceAssessment{Service: svc, Findings: diffAt(cur)}
	if len(a.Findings) == 0 {
		a.State = InSync
		return a
	}
	// Newest first; the last version is the current one (or absent).
	for i := len(versions) - 2; i >= 0; i-- {
		if len(diffAt(versions[i].Svc)) == 0 {
			a.State, a.Since = Lagging, versions[i+1].Since
			return a
		}
	}
	a.State = Divergent
	return a
}

// restrict returns the part of obs whose frontends are in keys (with
// Cilium's internal scopes of them and, in IPVS and Cilium modes, the
// per-address frontends of those node ports).
func restrict(obs *Observed, byKey map[FrontendKey]*ObservedFrontend, keys map[FrontendKey]bool) *Observed {
	o := &Observed{Mode: obs.Mode, Families: obs.Families, RejectsKnown: obs.RejectsKnown, Rejects: map[FrontendKey]bool{}}
	for k := range keys {
		if of, ok := byKey[k]; ok {
			o.Frontends = append(o.Frontends, *of)
		}
		k.Internal = true // Cilium's internal scope of it
		if of, ok := byKey[k]; ok {
			o.Frontends = append(o.Frontends, *of)
		}
		k.Internal = false
		if obs.Rejects[k] {
			o.Rejects[k] = true
		}
	}
	if obs.Mode.perAddressNodePorts() {
		for _, of := range obs.Frontends {
			if !of.NodePort && !keys[of.FrontendKey] && keys[of.nodePortOf()] {
				o.Frontends = append(o.Frontends, of)
			}
		}
	}
	o.Normalize()
	return o
}
