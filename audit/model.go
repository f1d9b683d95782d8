package audit

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
)

// Mode is the kind of rules kube-proxy programs on a node.
type Mode string

// Proxy modes.
const (
	ModeIPTables Mode = "iptables"
	ModeNFTables Mode = "nftables"
	ModeIPVS     Mode = "ipvs"
)

// Scope says which endpoint set a frontend dispatches to: every usable
// endpoint of the service (cluster) or only those on this node (local, for
// internalTrafficPolicy or externalTrafficPolicy Local).
type Scope string

// Scopes.
const (
	ScopeCluster Scope = "cluster"
	ScopeLocal   Scope = "local"
)

// FrontendKind is how traffic reaches a service on a node.
type FrontendKind string

// Frontend kinds.
const (
	KindClusterIP    FrontendKind = "cluster IP"
	KindNodePort     FrontendKind = "node port"
	KindLoadBalancer FrontendKind = "load-balancer IP"
	KindExternalIP   FrontendKind = "external IP"
)

// FrontendKey identifies a frontend: an IP (zero for node ports, which
// listen on the node's addresses), protocol and port.
type FrontendKey struct {
	NodePort bool
	IP       netip.Addr
	Protocol string // TCP, UDP or SCTP
	Port     uint16
}

func (k FrontendKey) String() string {
	if k.NodePort {
		return fmt.Sprintf("node port %d/%s", k.Port, k.Protocol)
	}
	return fmt.Sprintf("%s/%s", netip.AddrPortFrom(k.IP, k.Port), k.Protocol)
}

func (k FrontendKey) less(o FrontendKey) bool {
	if k.NodePort != o.NodePort {
		return !k.NodePort
	}
	if c := k.IP.Compare(o.IP); c != 0 {
		return c < 0
	}
	if k.Protocol != o.Protocol {
		return k.Protocol < o.Protocol
	}
	return k.Port < o.Port
}

// Endpoint is one DNAT target (or IPVS real server) seen in a node's rules.
type Endpoint struct {
	Addr netip.AddrPort
	// Weight is the IPVS weight; -1 where the mode has none.
	Weight int
	// ActiveConns and InactiveConns are IPVS connection counts, for
	// people reading a node's rules; they change every second, so they
	// are not streamed and never compared.
	ActiveConns, InactiveConns int `json:",omitempty"`
	// Chain is the rule object that holds it (KUBE-SEP-…, an nftables
	// chain), for explanations.
	Chain string
}

// ObservedFrontend is a frontend found in a node's rules with the endpoints
// it can send traffic to.
type ObservedFrontend struct {
	FrontendKey
	Scope Scope
	// Chain is the service chain (KUBE-SVC-…, service-…) or IPVS virtual
	// server the frontend dispatches through.
	Chain string
	// Name is namespace/name:port when the rules name the service (nftables
	// chain names; iptables comments when kube-proxy writes them). It is for
	// display only: matching never depends on it.
	Name      string
	Endpoints []Endpoint
}

// Observed is the reduced model of one node's kube-proxy rules.
type Observed struct {
	Mode Mode
	// Families lists the IP families the rules cover (4, 6).
	Families []int
	// NoRules means kube-proxy's service dispatch is missing or empty: a
	// flushed table.
	NoRules   bool
	Frontends []ObservedFrontend
	// Rejects holds frontends with a no-endpoints REJECT/drop rule, when
	// RejectsKnown (the input included that table or map).
	Rejects      map[FrontendKey]bool
	RejectsKnown bool
	// Warnings are facts the reader noticed that are not findings.
	Warnings []string
}

// normalize sorts frontends and endpoints and removes duplicates so that
// comparisons are set operations on sorted data.
func (o *Observed) normalize() {
	sort.Slice(o.Frontends, func(i, j int) bool { return o.Frontends[i].FrontendKey.less(o.Frontends[j].FrontendKey) })
	out := o.Frontends[:0]
	// Frontends may share one endpoint slice (a policy chain several
	// frontends go to): sorted once.
	type slice struct {
		first *Endpoint
		n     int
	}
	done := map[slice][]Endpoint{}
	for _, f := range o.Frontends {
		if len(f.Endpoints) > 0 {
			k := slice{&f.Endpoints[0], len(f.Endpoints)}
			sorted, ok := done[k]
			if !ok {
				sorted = sortEndpoints(f.Endpoints)
				done[k] = sorted
			}
			f.Endpoints = sorted
		}
		if len(out) > 0 && out[len(out)-1].FrontendKey == f.FrontendKey {
			continue // e.g. the localhost and primary-address node port rules
		}
		out = append(out, f)
	}
	o.Frontends = out
	sort.Ints(o.Families)
}

// sortEndpoints sorts endpoints by address and drops repeats (the first
// stays), in place.
func sortEndpoints(eps []Endpoint) []Endpoint {
	slices.SortStableFunc(eps, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	return slices.CompactFunc(eps, func(a, b Endpoint) bool { return a.Addr == b.Addr })
}

// ServicePortName is namespace/name plus the port name ("" when unnamed).
type ServicePortName struct {
	Namespace, Name, Port string
}

// Service returns namespace/name.
func (s ServicePortName) Service() string { return s.Namespace + "/" + s.Name }

// String is kube-proxy's form: namespace/name:port, or namespace/name.
func (s ServicePortName) String() string {
	if s.Port == "" {
		return s.Service()
	}
	return s.Service() + ":" + s.Port
}

// ExpectedFrontend is a frontend a node should have.
type ExpectedFrontend struct {
	FrontendKey
	Kind  FrontendKind
	Scope Scope
}

// ExpectedPort is what one service port (in one IP family) should look like
// on one node.
type ExpectedPort struct {
	Name      ServicePortName
	Protocol  string
	Family    int
	Frontends []ExpectedFrontend
	// Endpoints per scope, sorted. A scope the port does not use is absent.
	Endpoints map[Scope][]netip.AddrPort
	// NoTopology is the cluster scope's endpoints when topology hints are
	// ignored, set only where hints narrow them. kube-proxy ignores hints
	// whenever it does not know its node's zone (its own view of its Node
	// can lack the label the cluster has), and then routes to every ready
	// endpoint: live pods, not drift (see Observed).
	NoTopology []netip.AddrPort
	// Affinity is ClientIP session affinity.
	Affinity bool
}

// Expected is what one node's kube-proxy should have programmed.
type Expected struct {
	Node  string
	Ports []ExpectedPort
}

// maxListed is how many addresses a finding's detail names; the rest are
// counted. A person reads a handful; a dump with thousands behind one
// frontend must not make every detail that long.
const maxListed = 8

func joinAddrs(as []netip.AddrPort, total int) string {
	n := min(len(as), maxListed)
	s := make([]string, n)
	for i := range n {
		s[i] = as[i].String()
	}
	out := strings.Join(s, ", ")
	if total > n {
		out += fmt.Sprintf(" and %d more", total-n)
	}
	return out
}
