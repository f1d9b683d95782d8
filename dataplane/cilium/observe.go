package cilium

import (
	"fmt"
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// What the decoded maps say: as `cilium-dbg` prints them, and as the
// audit's model.

// FlagNames names the master entry's flags as Cilium does (its
// ServiceFlags.String: the frontend's type first, then the traffic
// policies, scopes, affinity, routability, …).
func (f Frontend) FlagNames() string {
	fl := uint16(f.Flags) | uint16(f.Flags2)<<8
	typ := "ClusterIP"
	switch {
	case fl&FlagExternalIP != 0:
		typ = "ExternalIPs"
	case fl&FlagNodePort != 0:
		typ = "NodePort"
	case fl&FlagLoadBalancer != 0:
		typ = "LoadBalancer"
	case fl&FlagHostPort != 0:
		typ = "HostPort"
	case fl&(Flag2LocalRedirect<<8) != 0:
		typ = "LocalRedirect"
	}
	out := []string{typ}
	add := func(bit uint16, name string) {
		if fl&bit != 0 {
			out = append(out, name)
		}
	}
	add(FlagExtLocalScope, "Local")
	add(Flag2IntLocalScope<<8, "InternalLocal")
	add(Flag2TwoScopes<<8, "two-scopes")
	add(FlagAffinity, "sessionAffinity")
	if fl&FlagRoutable == 0 {
		out = append(out, "non-routable")
	}
	deny := false
	if fl&FlagSourceRange != 0 {
		out = append(out, "check source-range")
		if fl&(Flag2Quarantined<<8) != 0 { // the same bit: deny on a master
			deny = true
			out = append(out, "deny")
		}
	}
	add(Flag2NAT46x64<<8, "46x64")
	add(Flag2L7LB<<8, "l7-load-balancer")
	if fl&(Flag2Loopback<<8) != 0 {
		if typ == "HostPort" {
			out = append(out, "loopback")
		} else {
			out = append(out, "delegate-if-local")
		}
	}
	if !deny && fl&(Flag2Quarantined<<8) != 0 {
		out = append(out, "quarantined")
	}
	add(Flag2DSR<<8, "dsr")
	return strings.Join(out, ", ")
}

// Lines renders the frontends as `cilium-dbg bpf lb list` does, one line
// per service-map entry, sorted ("198.19.0.1:443/TCP (1)
// 198.18.90.1:6443/TCP (1) (1)"; a master "… (0) 0.0.0.0:0 (REVNAT) (0)
// [FLAGS]"; "/i" marks the internal scope): for comparing with the genuine
// tool.
func (lb *LB) Lines() []string {
	var out []string
	for _, f := range lb.Frontends {
		front := fmt.Sprintf("%s/%s", f.Addr, f.Protocol)
		if f.Scope == ScopeInternal {
			front += "/i"
		}
		if f.Mastered {
			none := "0.0.0.0:0"
			if f.Addr.Addr().Is6() {
				none = "[::]:0"
			}
			out = append(out, fmt.Sprintf("%s (0) %s (%d) (0) [%s]", front, none, f.RevNat, f.FlagNames()))
		}
		for i, id := range f.Slots {
			if id == 0 {
				continue
			}
			target := fmt.Sprintf("backend %d (missing)", id)
			if be, ok := lb.Backends[id]; ok {
				target = fmt.Sprintf("%s/%s", be.Addr, be.Protocol)
			}
			out = append(out, fmt.Sprintf("%s (%d) %s (%d) (%d)", front, i+1, target, f.RevNat, i+1))
		}
	}
	slices.Sort(out)
	return out
}

// Observed reduces the decoded maps to the audit's model of what the
// node's services dispatch to, as the genuine agent programs them:
//
//   - a frontend is a master entry of TCP, UDP or SCTP; the per-address
//     ANY entries (which drop traffic to ports no service has), HostPort
//     and local-redirect entries are not services' and are left out;
//   - the node port entry at 0.0.0.0 (or ::) is the node port; Cilium
//     adds one per node address, kept as address frontends that stand
//     for the node port (as IPVS's per-address virtual servers do);
//   - slots 1..Count are the backends new connections go to (the active
//     ones, or the terminating ones when none is active); the slots after
//     them hold terminating and quarantined backends: a terminating one
//     is kept for its connections (audit.Endpoint.Weight 0, "no new
//     connections"), a quarantined one is Cilium's health checking
//     holding a listed backend out (not drift: counted as present);
//   - a frontend without backends is a drop entry (Rejects): a service
//     without endpoints, or a Local scope without local ones;
//   - a frontend with two scopes (externalTrafficPolicy Local) is two
//     frontends: the external scope (the node's own backends) and the
//     internal one ("/i": every backend, for traffic from the node's own
//     pods), whose key is marked Internal and which is judged against
//     the frontend's cluster scope.
//
// A slot whose backend is not in the backends map, or slots without a
// master (a read racing the agent's write), become warnings; the
// frontend keeps what could be resolved.
func (lb *LB) Observed() *audit.Observed {
	o := &audit.Observed{Mode: audit.ModeCilium, Families: lb.Families, NoRules: true, RejectsKnown: true, Rejects: map[audit.FrontendKey]bool{}, Warnings: slices.Clone(lb.Warnings)}
	for i := range lb.Frontends {
		f := &lb.Frontends[i]
		if f.Protocol != "TCP" && f.Protocol != "UDP" && f.Protocol != "SCTP" {
			continue
		}
		if !f.Mastered {
			o.Warnings = append(o.Warnings, fmt.Sprintf("cilium: %s/%s has backend slots but no master entry (read while the agent wrote it?)", f.Addr, f.Protocol))
			continue
		}
		if f.Flags&FlagHostPort != 0 || f.Flags2&(Flag2LocalRedirect|Flag2L7LB) != 0 {
			continue
		}
		o.NoRules = false
		key := audit.FrontendKey{IP: f.Addr.Addr(), Protocol: f.Protocol, Port: f.Addr.Port()}
		if f.Flags&FlagNodePort != 0 && f.Addr.Addr().IsUnspecified() {
			key = audit.NodePortKey(audit.Family(f.Addr.Addr()), f.Protocol, f.Addr.Port())
		}
		clusterIP := f.Flags&(FlagExternalIP|FlagNodePort|FlagLoadBalancer) == 0
		scope := audit.ScopeCluster
		if clusterIP && f.Flags2&Flag2IntLocalScope != 0 || !clusterIP && f.Flags&FlagExtLocalScope != 0 {
			scope = audit.ScopeLocal
		}
		if f.Scope == ScopeInternal {
			key.Internal, scope = true, audit.ScopeCluster
		}
		fam := "lb4"
		if key.Family() == 6 {
			fam = "lb6"
		}
		of := audit.ObservedFrontend{FrontendKey: key, Scope: scope, Chain: fmt.Sprintf("cilium_%s service %d (%s)", fam, f.RevNat, f.FlagNames()),
			Endpoints: make([]audit.Endpoint, 0, len(f.Slots))}
		for s, id := range f.Slots {
			if id == 0 {
				continue
			}
			be, ok := lb.Backends[id]
			if !ok {
				o.Warnings = append(o.Warnings, fmt.Sprintf("cilium: %s/%s slot %d names backend %d, which the backends map lacks", f.Addr, f.Protocol, s+1, id))
				continue
			}
			w := -1
			if s >= f.Count && f.SlotFlags2[s]&Flag2Quarantined == 0 && be.State != Quarantined {
				w = 0 // terminating: its connections only
			}
			of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: be.Addr, Weight: w, Chain: of.Chain})
		}
		if len(of.Endpoints) == 0 && !key.Internal {
			// A drop entry. (An internal scope without backends is a
			// frontend that routes nowhere: judged as one.)
			o.Rejects[key] = true
			continue
		}
		o.Frontends = append(o.Frontends, of)
	}
	o.Normalize()
	return o
}
