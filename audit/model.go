package audit

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Mode is the kind of rules kube-proxy programs on a node, or Cilium's
// service maps where Cilium replaces kube-proxy.
type Mode string

// Proxy modes.
const (
	ModeIPTables Mode = "iptables"
	ModeNFTables Mode = "nftables"
	ModeIPVS     Mode = "ipvs"
	ModeCilium   Mode = "cilium"
)

// perAddressNodePorts: the mode serves a node port with a frontend per
// node address (an IPVS virtual server, a Cilium service entry) beside
// or instead of one for every address.
func (m Mode) perAddressNodePorts() bool { return m == ModeIPVS || m == ModeCilium }

// Dataplane names what programs the node's services in this mode, for
// people: "kube-proxy" or "Cilium".
func (m Mode) Dataplane() string {
	if m == ModeCilium {
		return "Cilium"
	}
	return "kube-proxy"
}

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

// FrontendKey identifies a frontend: an IP, protocol and port. A node
// port listens on the node's addresses of one family: its IP is the zero
// Addr in IPv4 and "::" in IPv6 (NodePortKey makes them), so that a dual-
// stack service's two node ports are two frontends.
type FrontendKey struct {
	NodePort bool
	IP       netip.Addr
	Protocol string // TCP, UDP or SCTP
	Port     uint16
	// Internal marks the internal scope of a Cilium frontend whose
	// traffic policies differ (externalTrafficPolicy Local: "/i", the
	// entry traffic from the node's own pods takes, holding every
	// endpoint). Never in the expected model: it is judged against its
	// frontend's cluster scope.
	Internal bool
}

// external is k without Internal: the frontend an internal scope
// belongs to.
func (k FrontendKey) external() FrontendKey {
	k.Internal = false
	return k
}

// NodePortKey is the key of node port port/proto in IP family fam (4, 6).
func NodePortKey(fam int, proto string, port uint16) FrontendKey {
	k := FrontendKey{NodePort: true, Protocol: proto, Port: port}
	if fam == 6 {
		k.IP = netip.IPv6Unspecified()
	}
	return k
}

// Family is the key's IP family: 4 or 6.
func (k FrontendKey) Family() int {
	if !k.IP.IsValid() {
		return 4
	}
	return Family(k.IP)
}

// nodePortOf is the node port a per-address frontend with k's protocol
// and port would serve in IPVS mode (a virtual server per node address).
func (k FrontendKey) nodePortOf() FrontendKey { return NodePortKey(k.Family(), k.Protocol, k.Port) }

func (k FrontendKey) String() string {
	s := fmt.Sprintf("%s/%s", netip.AddrPortFrom(k.IP, k.Port), k.Protocol)
	if k.NodePort {
		s = fmt.Sprintf("node port %d/%s", k.Port, k.Protocol)
		if k.Family() == 6 {
			s = "IPv6 " + s
		}
	}
	if k.Internal {
		s += " (internal scope)"
	}
	return s
}

// Wire is the key's stable text form, as the stream and findings carry
// it: "198.19.0.10:53/UDP", "nodeport:30080/TCP" (IPv4) or
// "nodeport6:30080/TCP"; an internal scope ends in "/i".
func (k FrontendKey) Wire() string {
	suffix := ""
	if k.Internal {
		suffix = "/i"
	}
	if k.NodePort {
		prefix := "nodeport:"
		if k.Family() == 6 {
			prefix = "nodeport6:"
		}
		return prefix + strconv.Itoa(int(k.Port)) + "/" + k.Protocol + suffix
	}
	return netip.AddrPortFrom(k.IP, k.Port).String() + "/" + k.Protocol + suffix
}

// ParseFrontendKey reverses Wire.
func ParseFrontendKey(s string) (FrontendKey, error) {
	addr, proto, ok := strings.Cut(s, "/")
	proto, internal := strings.CutSuffix(proto, "/i")
	if !ok || (proto != "TCP" && proto != "UDP" && proto != "SCTP") {
		return FrontendKey{}, fmt.Errorf("bad frontend key %q", clipKey(s))
	}
	for fam, prefix := range map[int]string{4: "nodeport:", 6: "nodeport6:"} {
		if p, ok := strings.CutPrefix(addr, prefix); ok {
			n, err := strconv.ParseUint(p, 10, 16)
			if err != nil {
				return FrontendKey{}, fmt.Errorf("bad node port in %q", clipKey(s))
			}
			k := NodePortKey(fam, proto, uint16(n))
			k.Internal = internal
			return k, nil
		}
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return FrontendKey{}, fmt.Errorf("bad frontend key %q", clipKey(s))
	}
	return FrontendKey{IP: ap.Addr(), Protocol: proto, Port: ap.Port(), Internal: internal}, nil
}

// clipKey keeps at most 80 bytes of a key that did not parse (%q shows
// them printable).
func clipKey(s string) string { return s[:min(len(s), 80)] }

func (k FrontendKey) less(o FrontendKey) bool { return k.compare(o) < 0 }

// Compare orders keys as a model's frontends are sorted: addresses before
// node ports, then by address, protocol and port.
func (k FrontendKey) Compare(o FrontendKey) int { return k.compare(o) }

func (k FrontendKey) compare(o FrontendKey) int {
	if k.NodePort != o.NodePort {
		if k.NodePort {
			return 1
		}
		return -1
	}
	if c := k.IP.Compare(o.IP); c != 0 {
		return c
	}
	if c := strings.Compare(k.Protocol, o.Protocol); c != 0 {
		return c
	}
	if k.Port != o.Port {
		return int(k.Port) - int(o.Port)
	}
	switch {
	case k.Internal == o.Internal:
		return 0
	case k.Internal:
		return 1
	}
	return -1
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

// FamilyList is the families (4, 6) seen marks, ascending.
func FamilyList(seen [7]bool) []int {
	var out []int
	for _, f := range []int{4, 6} {
		if seen[f] {
			out = append(out, f)
		}
	}
	return out
}

// Merge joins one node's rules read per IP family (iptables-save and
// ip6tables-save, kube-proxy's ip and ip6 nftables tables) into one
// model. The parts must be of one mode and of different families. The
// node has no rules only when no family has any: on an IPv6-only node
// the IPv4 table is empty by design.
func Merge(parts ...*Observed) (*Observed, error) {
	if len(parts) == 0 {
		return nil, fmt.Errorf("no rules to merge")
	}
	if len(parts) == 1 {
		return parts[0], nil
	}
	o := &Observed{Mode: parts[0].Mode, NoRules: true, RejectsKnown: true, Rejects: map[FrontendKey]bool{}}
	var withRules []*Observed
	for _, p := range parts {
		if p.Mode != o.Mode {
			return nil, fmt.Errorf("rules of two modes for one node: %s and %s", o.Mode, p.Mode)
		}
		for _, f := range p.Families {
			if slices.Contains(o.Families, f) {
				return nil, fmt.Errorf("the IPv%d rules given twice: give each family's dump once", f)
			}
			o.Families = append(o.Families, f)
		}
		if !p.NoRules {
			o.NoRules = false
			withRules = append(withRules, p)
		}
		// Rejects are checked only where every family's were read.
		o.RejectsKnown = o.RejectsKnown && p.RejectsKnown
		for k := range p.Rejects {
			o.Rejects[k] = true
		}
		o.Warnings = append(o.Warnings, p.Warnings...)
	}
	if !o.RejectsKnown {
		o.Rejects = nil
	}
	slices.Sort(o.Families)
	if len(withRules) == 1 {
		// One family has rules (a single-stack node): its frontends are
		// normalized already, and shared as they are.
		o.Frontends = withRules[0].Frontends
		return o, nil
	}
	for _, p := range withRules {
		o.Frontends = append(o.Frontends, p.Frontends...)
	}
	o.Normalize()
	return o, nil
}

// MaxLineBytes bounds one line of rule text a reader takes; longer lines
// are an error.
const MaxLineBytes = 64 << 10

// Normalize sorts frontends and endpoints and removes duplicates so that
// comparisons are set operations on sorted data: every reader calls it on
// the model it built, last.
func (o *Observed) Normalize() {
	// Stable: of two frontends with one key the first stays.
	slices.SortStableFunc(o.Frontends, func(a, b ObservedFrontend) int { return a.FrontendKey.compare(b.FrontendKey) })
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
				sorted = SortEndpoints(f.Endpoints)
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

// SortEndpoints sorts endpoints by address and drops repeats (the first
// stays), in place.
func SortEndpoints(eps []Endpoint) []Endpoint {
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

// String names the frontend for people: "cluster IP 198.19.0.10:53/UDP",
// "node port 30080/TCP" (whose key says what it is).
func (f ExpectedFrontend) String() string {
	if f.NodePort {
		return f.FrontendKey.String()
	}
	return string(f.Kind) + " " + f.FrontendKey.String()
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
	// Terminating are the terminating endpoints (serving or not), set
	// only where there are any: Cilium keeps them in the slots after the
	// active ones, for their connections (new ones go to them only when
	// no endpoint is ready and they serve).
	Terminating []netip.AddrPort
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
