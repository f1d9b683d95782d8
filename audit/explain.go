package audit

import (
	"net/netip"
	"slices"
	"sort"
)

// Trace statuses.
const (
	TraceOK      = "ok"      // in the rules and in the cluster
	TraceStale   = "stale"   // in the rules, no longer in the cluster
	TraceMissing = "missing" // in the cluster, not in the rules
	// TraceUnaudited: in the cluster, of an IP family whose rules were
	// not read (a dump of the other family only).
	TraceUnaudited = "not audited"
)

// EndpointTrace is one endpoint of a frontend, as the rules and the
// cluster see it.
type EndpointTrace struct {
	Endpoint string `json:"endpoint"`
	Status   string `json:"status"`
	// Chain is the rule object holding the DNAT (KUBE-SEP-…, an nftables
	// chain), when the rules have one.
	Chain string `json:"chain,omitempty"`
}

// FrontendTrace is one way traffic enters a service port on the node.
type FrontendTrace struct {
	Frontend string       `json:"frontend"`
	Kind     FrontendKind `json:"kind,omitempty"`
	Scope    Scope        `json:"scope"`
	// Status is missing when the node has no rule for the frontend, stale
	// when no service has it any more.
	Status    string          `json:"status"`
	Chain     string          `json:"chain,omitempty"`
	Endpoints []EndpointTrace `json:"endpoints"`
}

// PortTrace is one service port traced through a node's rules.
type PortTrace struct {
	Service  string `json:"service"`
	Port     string `json:"port"`
	Protocol string `json:"protocol"`
	// Family is the IP family of the port's frontends (a dual-stack
	// service has a trace per family); 0 for rules no service owns.
	Family    int             `json:"family,omitempty"`
	Frontends []FrontendTrace `json:"frontends"`
	// StaleFlows are the node's conntrack flows of the port still DNATed
	// to an endpoint that is gone (its StaleConntrack findings).
	StaleFlows []FlowTrace `json:"staleFlows,omitempty"`
}

// FlowTrace is a node's stale flows to one endpoint that is gone.
type FlowTrace struct {
	Endpoint string `json:"endpoint"`
	Flows    int    `json:"flows"`
	Detail   string `json:"detail"`
}

// AttachStaleFlows puts a node's StaleConntrack findings under the port
// they belong to (a port of a service that is gone gets a trace of its
// own), for explain.
func AttachStaleFlows(ports []PortTrace, findings []TimedFinding, service string) []PortTrace {
	for _, f := range findings {
		if f.Kind != StaleConntrack || (service != "" && f.Service != service) {
			continue
		}
		ft := FlowTrace{Endpoint: f.Endpoint, Flows: f.Flows, Detail: f.Detail}
		i := slices.IndexFunc(ports, func(p PortTrace) bool {
			return p.Service == f.Service && p.Port == f.Port && p.Protocol == f.Protocol && (p.Family == 0 || f.Family == 0 || p.Family == f.Family)
		})
		if i < 0 {
			ports = append(ports, PortTrace{Service: f.Service, Port: f.Port, Protocol: f.Protocol, Family: f.Family, Frontends: []FrontendTrace{}})
			i = len(ports) - 1
		}
		ports[i].StaleFlows = append(ports[i].StaleFlows, ft)
	}
	return ports
}

// Explain traces what an SRE traces by hand: for each service port the
// node should program (only service, namespace/name, when given), each
// frontend's rule, its service chain and every endpoint with its DNAT,
// marked ok, stale or missing against the cluster. Without a service
// filter, rules no service owns come last as stale frontends.
func Explain(exp Expected, obs *Observed, service string) []PortTrace {
	byKey := make(map[FrontendKey]*ObservedFrontend, len(obs.Frontends))
	for i := range obs.Frontends {
		byKey[obs.Frontends[i].FrontendKey] = &obs.Frontends[i]
	}
	expected := map[FrontendKey]bool{}
	var out []PortTrace
	for _, p := range exp.Ports {
		for _, fe := range p.Frontends {
			expected[fe.FrontendKey] = true
		}
		if service != "" && p.Name.Service() != service {
			continue
		}
		pt := PortTrace{Service: p.Name.Service(), Port: p.Name.Port, Protocol: p.Protocol, Family: p.Family}
		audited := slices.Contains(obs.Families, p.Family)
		for _, fe := range p.Frontends {
			if !audited {
				pt.Frontends = append(pt.Frontends, FrontendTrace{Frontend: fe.FrontendKey.String(), Kind: fe.Kind, Scope: fe.Scope,
					Status: TraceUnaudited, Endpoints: []EndpointTrace{}})
				continue
			}
			of := byKey[fe.FrontendKey]
			want := p.WantFor(of, fe.Scope, obs.Mode)
			ft := FrontendTrace{Frontend: fe.FrontendKey.String(), Kind: fe.Kind, Scope: fe.Scope, Status: TraceOK}
			if of == nil {
				ft.Status = TraceMissing
			} else {
				ft.Chain = of.Chain
			}
			ft.Endpoints = traceEndpoints(want, of)
			pt.Frontends = append(pt.Frontends, ft)
		}
		out = append(out, pt)
	}
	if service == "" {
		var stale []FrontendTrace
		for _, of := range obs.Frontends {
			if expected[of.FrontendKey.external()] || (obs.Mode.perAddressNodePorts() && !of.NodePort && expected[of.nodePortOf()]) {
				continue
			}
			ft := FrontendTrace{Frontend: of.FrontendKey.String(), Scope: of.Scope, Status: TraceStale, Chain: of.Chain}
			ft.Endpoints = traceEndpoints(nil, &of)
			stale = append(stale, ft)
		}
		if len(stale) > 0 {
			out = append(out, PortTrace{Service: "", Frontends: stale})
		}
	}
	return out
}

func traceEndpoints(want []netip.AddrPort, of *ObservedFrontend) []EndpointTrace {
	var out []EndpointTrace
	seen := map[netip.AddrPort]bool{}
	if of != nil {
		expected := map[netip.AddrPort]bool{}
		for _, w := range want {
			expected[w] = true
		}
		for _, e := range of.Endpoints {
			if seen[e.Addr] {
				continue
			}
			seen[e.Addr] = true
			st := TraceOK
			if !expected[e.Addr] {
				st = TraceStale
			}
			out = append(out, EndpointTrace{Endpoint: e.Addr.String(), Status: st, Chain: e.Chain})
		}
	}
	for _, w := range want {
		if !seen[w] {
			out = append(out, EndpointTrace{Endpoint: w.String(), Status: TraceMissing})
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Endpoint < out[j].Endpoint })
	if out == nil {
		out = []EndpointTrace{}
	}
	return out
}
