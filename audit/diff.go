package audit

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

type expIndex struct {
	port *ExpectedPort
	fe   ExpectedFrontend
}

// frontendIndex maps every expected frontend of the families the rules
// cover to its port.
type frontendIndex map[FrontendKey]expIndex

func expectedIndex(exp Expected, obs *Observed) frontendIndex {
	fams := map[int]bool{}
	for _, f := range obs.Families {
		fams[f] = true
	}
	idx := frontendIndex{}
	for i := range exp.Ports {
		p := &exp.Ports[i]
		if !fams[p.Family] {
			continue
		}
		for _, fe := range p.Frontends {
			idx[fe.FrontendKey] = expIndex{p, fe}
		}
	}
	return idx
}

// match finds the expected frontend an observed one implements: itself,
// or in IPVS and Cilium modes the node port a per-address frontend serves;
// for Cilium's internal scope of a Local frontend, that frontend with the
// cluster scope (its key marked Internal).
func (idx frontendIndex) match(k FrontendKey, mode Mode) (expIndex, bool) {
	e, ok := idx[k.external()]
	if !ok && mode.perAddressNodePorts() && !k.NodePort {
		e, ok = idx[k.nodePortOf()]
	}
	if ok && k.Internal {
		// Cilium's internal scope of a Local frontend holds every
		// endpoint; a frontend of one scope has none.
		if e.fe.Scope != ScopeLocal {
			return expIndex{}, false
		}
		e.fe.Scope, e.fe.FrontendKey.Internal = ScopeCluster, true
	}
	return e, ok
}

// Unaudited lists the IP families exp has service ports in that obs does
// not cover: the node's rules of that family were not read, so nothing
// can be said of them (they are not in sync, they are unknown).
func Unaudited(exp Expected, obs *Observed) []int {
	var out []int
	for _, p := range exp.Ports {
		if !slices.Contains(obs.Families, p.Family) && !slices.Contains(out, p.Family) {
			out = append(out, p.Family)
		}
	}
	slices.Sort(out)
	return out
}

// Diff compares what a node should have with what its rules hold and
// returns the differences, sorted and without duplicates. Each endpoint
// difference is reported once per service port and scope, however many
// frontends (cluster IP, node port, load-balancer IP) lead to it.
func Diff(exp Expected, obs *Observed) []Finding {
	idx := expectedIndex(exp, obs)
	wantAny := false
	for _, e := range idx {
		if len(e.port.Want(e.fe.Scope, obs.Mode)) > 0 {
			wantAny = true
			break
		}
	}
	if obs.NoRules {
		if !wantAny {
			return nil
		}
		detail := fmt.Sprintf("no kube-proxy service rules at all (%s mode): the table was flushed or kube-proxy never programmed it; every service through this node fails", obs.Mode)
		if obs.Mode == ModeCilium {
			detail = "no service entries at all in Cilium's LB maps: the maps were emptied or the agent never programmed them; every service through this node fails"
		}
		return []Finding{{Node: exp.Node, Kind: NoRules, Detail: detail}}
	}

	// Findings are gathered, then sorted stably and their duplicates
	// dropped (the first emitted is kept): no key is built per finding.
	var out []Finding
	emit := func(f Finding) {
		f.Node = exp.Node
		out = append(out, f)
	}
	matched := map[FrontendKey]bool{}
	// Frontends sharing one endpoint slice (one policy chain) and one
	// expected port and scope find the same endpoints, and emit dedupes
	// them: compared once, so a dump pointing thousands of frontends at
	// one chain costs its size, not its square.
	type compared struct {
		first *Endpoint
		n     int
		port  *ExpectedPort
		scope Scope
	}
	done := map[compared]bool{}
	for _, of := range obs.Frontends {
		e, ok := idx.match(of.FrontendKey, obs.Mode)
		key := e.fe.FrontendKey
		if !ok {
			emit(staleService(of))
			continue
		}
		matched[key] = true
		if len(of.Endpoints) > 0 {
			c := compared{&of.Endpoints[0], len(of.Endpoints), e.port, e.fe.Scope}
			if done[c] {
				continue
			}
			done[c] = true
		}
		scope := e.fe.Scope
		want := e.port.WantFor(&of, scope, obs.Mode)
		got := map[netip.AddrPort]Endpoint{}
		for _, ep := range of.Endpoints {
			got[ep.Addr] = ep
		}
		base := Finding{Service: e.port.Name.Service(), Port: e.port.Name.Port, Protocol: e.port.Protocol, Family: e.port.Family, Scope: scope}
		wantSet := map[netip.AddrPort]bool{}
		for _, a := range want {
			wantSet[a] = true
			if ep, ok := got[a]; !ok || ep.draining() {
				f := base
				f.Kind, f.Endpoint = MissingEndpoint, a.String()
				f.Detail = fmt.Sprintf("%s should route to %s but the rules behind %s do not", e.fe, a, of.Chain)
				if ok && obs.Mode == ModeCilium {
					f.Detail += " (it is there as a terminating backend, after the active slots: no new connections)"
				} else if ok {
					f.Detail += " (it is there at IPVS weight 0: no new connections)"
				}
				emit(f)
			}
		}
		for _, ep := range of.Endpoints {
			if wantSet[ep.Addr] {
				continue
			}
			if ep.draining() && obs.Mode != ModeCilium {
				continue // a draining real server is judged by its age (Draining)
			}
			if ep.draining() && slices.Contains(e.port.Terminating, ep.Addr) {
				continue // Cilium keeps a terminating endpoint for its connections
			}
			f := base
			f.Kind, f.Endpoint = StaleEndpoint, ep.Addr.String()
			f.Detail = fmt.Sprintf("%s routes to %s via %s, which the cluster no longer lists for %s (%s scope)", e.fe, ep.Addr, ep.Chain, e.port.Name, scope)
			emit(f)
		}
	}
	// Missing frontends, in the expected model's order so that the first
	// frontend named in a deduplicated finding is deterministic.
	for i := range exp.Ports {
		p := &exp.Ports[i]
		for _, fe := range p.Frontends {
			if _, covered := idx[fe.FrontendKey]; !covered || matched[fe.FrontendKey] {
				continue
			}
			want := p.Want(fe.Scope, obs.Mode)
			f := Finding{Service: p.Name.Service(), Port: p.Name.Port, Protocol: p.Protocol, Family: p.Family, Scope: fe.Scope, Kind: MissingService}
			switch {
			case len(want) > 0:
				what := "rule"
				if obs.Mode == ModeCilium {
					what = "service entry in Cilium's maps"
				}
				f.Detail = fmt.Sprintf("no %s for %s, which should route to %s", what, fe, joinAddrs(want, len(want)))
				emit(f)
			case fe.Kind == KindClusterIP && fe.Scope == ScopeCluster && obs.RejectsKnown && !obs.Rejects[fe.FrontendKey]:
				f.Detail = fmt.Sprintf("no REJECT rule for %s, which has no endpoints", fe)
				if obs.Mode == ModeCilium {
					f.Detail = fmt.Sprintf("no service entry for %s, which has no endpoints (Cilium drops its traffic with an entry of no backends; without one it is not a service to the datapath)", fe)
				}
				emit(f)
			}
		}
	}
	SortFindings(out)
	return slices.CompactFunc(out, sameFinding)
}

// draining reports an IPVS real server at weight 0: kube-proxy's graceful
// termination keeps it, receiving no new connections, until its
// connections end.
func (e Endpoint) draining() bool { return e.Weight == 0 }

// Draining lists the IPVS real servers at weight 0 that the cluster no
// longer lists for their frontend, as StaleEndpoint findings. Diff leaves
// them out: graceful termination keeps such a real server while its
// connections last, which is normal. Only its age makes it a leftover
// (the Judge's Policy.WeightZeroLimit), as when kube-proxy hung in
// graceful termination and never removed them (kubernetes#71071).
func Draining(exp Expected, obs *Observed) []Finding {
	if obs.Mode != ModeIPVS || obs.NoRules {
		return nil
	}
	idx := expectedIndex(exp, obs)
	var out []Finding
	for _, of := range obs.Frontends {
		e, ok := idx.match(of.FrontendKey, obs.Mode)
		if !ok {
			continue // a stale virtual server: Diff reports it whole
		}
		want := map[netip.AddrPort]bool{}
		for _, a := range e.port.Want(e.fe.Scope, obs.Mode) {
			want[a] = true
		}
		for _, ep := range of.Endpoints {
			if !ep.draining() || want[ep.Addr] {
				continue
			}
			out = append(out, Finding{Node: exp.Node, Service: e.port.Name.Service(), Port: e.port.Name.Port, Protocol: e.port.Protocol, Family: e.port.Family,
				Scope: e.fe.Scope, Kind: StaleEndpoint, Endpoint: ep.Addr.String(),
				Detail: fmt.Sprintf("%s keeps %s at IPVS weight 0 via %s, though the cluster no longer lists it for %s: kube-proxy's graceful termination never removed it",
					e.fe, ep.Addr, ep.Chain, e.port.Name)})
		}
	}
	SortFindings(out)
	return slices.CompactFunc(out, sameFinding)
}

// UnownedFrontend is the StaleService finding for a frontend no service has, on node.
func UnownedFrontend(node string, of ObservedFrontend) Finding {
	f := staleService(of)
	f.Node = node
	return f
}

func staleService(of ObservedFrontend) Finding {
	f := Finding{Protocol: of.Protocol, Family: of.Family(), Scope: of.Scope, Kind: StaleService}
	if of.Name != "" {
		svc, port, _ := strings.Cut(of.Name, ":")
		f.Service, f.Port = svc, port
	}
	eps := make([]netip.AddrPort, min(len(of.Endpoints), maxListed+1))
	for i := range eps {
		eps[i] = of.Endpoints[i].Addr
	}
	target := "no endpoints"
	if len(eps) > 0 {
		target = joinAddrs(eps, len(of.Endpoints))
	}
	f.Detail = fmt.Sprintf("rules for %s (%s) route to %s, but no service has that frontend any more", of.FrontendKey, of.Chain, target)
	return f
}

// Summary counts findings by kind and nodes with findings.
type Summary struct {
	Nodes         int          `json:"nodes"`
	NodesInSync   int          `json:"nodesInSync"`
	NodesDrifted  int          `json:"nodesDrifted"`
	Findings      int          `json:"findings"`
	ByKind        map[Kind]int `json:"byKind"`
	DriftedByNode []string     `json:"driftedNodes"`
}

// Summarize counts findings over the audited nodes. A node is drifted
// when its rules are: stale conntrack flows alone leave it in sync.
func Summarize(nodes []string, fs []Finding) Summary {
	s := Summary{Nodes: len(nodes), Findings: len(fs), ByKind: map[Kind]int{}, DriftedByNode: []string{}}
	drifted := map[string]bool{}
	for _, f := range fs {
		s.ByKind[f.Kind]++
		if f.Kind != StaleConntrack {
			drifted[f.Node] = true
		}
	}
	for _, n := range nodes {
		if drifted[n] {
			s.DriftedByNode = append(s.DriftedByNode, n)
		}
	}
	s.NodesDrifted = len(s.DriftedByNode)
	s.NodesInSync = s.Nodes - s.NodesDrifted
	return s
}
