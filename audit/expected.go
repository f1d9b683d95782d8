package audit

import (
	"net/netip"
	"slices"

	corev1 "k8s.io/api/core/v1"
)

// ExpectedFor computes what kube-proxy 1.36 on the named node should have
// programmed, mirroring its endpoint selection: ready endpoints, falling back
// to serving+terminating ones; internal and external traffic policy Local;
// topology hints (same zone, same node) used only when every ready endpoint
// carries them and one matches; one port per IP family.
func ExpectedFor(st *State, node string) Expected {
	exp := Expected{Node: node}
	zone := st.Nodes[node].Zone
	for i := range st.Services {
		svc := &st.Services[i]
		if svc.Skip != "" {
			continue
		}
		for _, sp := range svc.Ports {
			for _, cip := range svc.ClusterIPs {
				exp.Ports = append(exp.Ports, expectedPort(svc, sp, Family(cip), cip, node, zone))
			}
		}
	}
	return exp
}

// categorized endpoint, as kube-proxy sees it.
type cep struct {
	addr netip.AddrPort
	*SliceEndpoint
	local bool
}

// dedupe keeps one copy of each address in all (sorted stably by address):
// the last non-terminating copy, or the first when every copy terminates.
func dedupe(all []cep) []cep {
	out := all[:0]
	for i := 0; i < len(all); {
		j, keep := i, all[i]
		for ; j < len(all) && all[j].addr == all[i].addr; j++ {
			if !all[j].Terminating {
				keep = all[j]
			}
		}
		out = append(out, keep)
		i = j
	}
	return out
}

func expectedPort(svc *Service, sp corev1.ServicePort, fam int, clusterIP netip.Addr, node, zone string) ExpectedPort {
	proto := string(sp.Protocol)
	if proto == "" {
		proto = "TCP"
	}
	ep := ExpectedPort{
		Name:      ServicePortName{Namespace: svc.Namespace, Name: svc.Name, Port: sp.Name},
		Protocol:  proto,
		Family:    fam,
		Affinity:  svc.Affinity,
		Endpoints: map[Scope][]netip.AddrPort{},
	}
	internal := ScopeCluster
	if svc.ITPLocal {
		internal = ScopeLocal
	}
	external := ScopeCluster
	if svc.ETPLocal {
		external = ScopeLocal
	}
	port := uint16(sp.Port)
	ep.Frontends = append(ep.Frontends, ExpectedFrontend{FrontendKey{IP: clusterIP, Protocol: proto, Port: port}, KindClusterIP, internal})
	for _, ip := range svc.ExternalIPs {
		if Family(ip) == fam {
			ep.Frontends = append(ep.Frontends, ExpectedFrontend{FrontendKey{IP: ip, Protocol: proto, Port: port}, KindExternalIP, external})
		}
	}
	for _, ip := range svc.LBIPs {
		if Family(ip) == fam {
			ep.Frontends = append(ep.Frontends, ExpectedFrontend{FrontendKey{IP: ip, Protocol: proto, Port: port}, KindLoadBalancer, external})
		}
	}
	if sp.NodePort != 0 {
		ep.Frontends = append(ep.Frontends, ExpectedFrontend{NodePortKey(fam, proto, uint16(sp.NodePort)), KindNodePort, external})
	}
	externallyAccessible := sp.NodePort != 0 || len(svc.LBIPs) > 0 || len(svc.ExternalIPs) > 0
	usesCluster := !svc.ITPLocal || externallyAccessible
	usesLocal := svc.ITPLocal || (svc.ETPLocal && externallyAccessible)

	// Endpoints of this port across slices of this family; an endpoint seen
	// twice keeps the non-terminating copy (the last one), as kube-proxy's
	// cache does. A Service with n ports and n endpoints is n² of these, as
	// it is n² rules for kube-proxy: a sorted slice of small records, not a
	// map, keeps that to ~100 bytes each (docs/benchmarks.md).
	var all []cep
	for si := range svc.Slices {
		sl := &svc.Slices[si]
		if sl.Family != fam {
			continue
		}
		var num uint16
		found := false
		for _, p := range sl.Ports {
			if p.Name == sp.Name && p.Protocol == proto {
				num, found = p.Port, true
				break
			}
		}
		if !found {
			continue
		}
		if all == nil {
			all = make([]cep, 0, len(sl.Endpoints))
		}
		for ei := range sl.Endpoints {
			e := &sl.Endpoints[ei]
			all = append(all, cep{addr: netip.AddrPortFrom(e.Addr, num), SliceEndpoint: e, local: e.NodeName != "" && e.NodeName == node})
		}
	}
	slices.SortStableFunc(all, func(a, b cep) int { return a.addr.Compare(b.addr) })
	all = dedupe(all)

	if usesCluster {
		mode := topologyMode(all, node, zone)
		cl := filter(all, func(c cep) bool { return c.Ready && availableForTopology(c, mode, node, zone) })
		if len(cl) == 0 {
			cl = filter(all, func(c cep) bool { return c.Serving && c.Terminating })
		}
		ep.Endpoints[ScopeCluster] = cl
		if slices.ContainsFunc(all, func(c cep) bool { return c.Terminating }) {
			ep.Terminating = filter(all, func(c cep) bool { return c.Terminating })
		}
		if mode != "" {
			if without := filter(all, func(c cep) bool { return c.Ready }); !slices.Equal(without, cl) {
				ep.NoTopology = without
			}
		}
	}
	if usesLocal {
		loc := filter(all, func(c cep) bool { return c.local && c.Ready })
		if len(loc) == 0 {
			loc = filter(all, func(c cep) bool { return c.local && c.Serving && c.Terminating })
		}
		ep.Endpoints[ScopeLocal] = loc
	}
	return ep
}

// Want is the endpoint set a frontend of this scope dispatches to in the
// given mode. IPVS differs in one way (kubernetes#97081): a local-scope
// virtual server on a node without local endpoints gets the cluster's, so
// that pods on the node can still reach the service (external traffic is
// then dropped by iptables rules, not by IPVS).
func (p *ExpectedPort) Want(scope Scope, mode Mode) []netip.AddrPort {
	want := p.Endpoints[scope]
	if mode == ModeIPVS && scope == ScopeLocal && len(want) == 0 {
		return p.Endpoints[ScopeCluster]
	}
	return want
}

// WantFor is Want for the observed frontend of (nil: not there): when
// hints narrow the cluster scope and of routes to exactly the endpoints
// without them, that is kube-proxy ignoring hints for want of its zone
// (topology.go: "node is missing label"), which it does on its own view of
// its Node; every one of them is a live, ready endpoint, so it is not
// drift.
func (p *ExpectedPort) WantFor(of *ObservedFrontend, scope Scope, mode Mode) []netip.AddrPort {
	want := p.Want(scope, mode)
	if p.NoTopology == nil || of == nil || !slices.Equal(want, p.Endpoints[ScopeCluster]) {
		return want
	}
	i := 0
	for _, e := range of.Endpoints {
		if e.draining() {
			continue
		}
		if i == len(p.NoTopology) || e.Addr != p.NoTopology[i] {
			return want
		}
		i++
	}
	if i != len(p.NoTopology) {
		return want
	}
	return p.NoTopology
}

func filter(all []cep, keep func(cep) bool) []netip.AddrPort {
	n := 0
	for _, c := range all {
		if keep(c) {
			n++
		}
	}
	out := make([]netip.AddrPort, 0, n)
	for _, c := range all {
		if keep(c) {
			out = append(out, c.addr)
		}
	}
	return out
}

// topologyMode is kube-proxy's rule for using hints: same-node hints when
// every ready endpoint has node hints and one names this node; else
// same-zone hints when every ready endpoint has zone hints and one names this
// node's zone; else none.
func topologyMode(all []cep, node, zone string) string {
	hasReady, allNode, forNode, allZone, forZone := false, true, false, true, false
	for _, c := range all {
		if !c.Ready {
			continue
		}
		hasReady = true
		if len(c.NodeHints) == 0 {
			allNode = false
		} else if slices.Contains(c.NodeHints, node) {
			forNode = true
		}
		if len(c.ZoneHints) == 0 {
			allZone = false
		} else if slices.Contains(c.ZoneHints, zone) {
			forZone = true
		}
	}
	switch {
	case !hasReady:
		return ""
	case allNode && forNode:
		return "node"
	case allZone && forZone:
		return "zone"
	}
	return ""
}

func availableForTopology(c cep, mode, node, zone string) bool {
	switch mode {
	case "node":
		return slices.Contains(c.NodeHints, node)
	case "zone":
		return slices.Contains(c.ZoneHints, zone)
	}
	return true
}
