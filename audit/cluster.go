package audit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"sort"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"sigs.k8s.io/yaml"
)

// LabelServiceProxyName marks services that another proxy implements;
// kube-proxy writes no rules for them.
const LabelServiceProxyName = "service.kubernetes.io/service-proxy-name"

// State is the cluster as the audit needs it: services, their endpoints and
// the nodes' topology, reduced from API objects at the door.
type State struct {
	Services []Service
	Nodes    map[string]NodeInfo
}

// NodeInfo is what the audit needs of a Node.
type NodeInfo struct {
	Zone string
	// KubeProxyVersion is status.nodeInfo.kubeProxyVersion: set by the
	// kubelets of the releases whose IPVS mode could hang (deprecated
	// since 1.29, so often empty today).
	KubeProxyVersion string
	// Quiet is why the node's collector is not expected to report ("":
	// it is).
	Quiet Quiet
}

// Service is one Service with the endpoints of all its EndpointSlices.
type Service struct {
	Namespace, Name string
	// Skip is why kube-proxy writes no rules for it (headless, ExternalName,
	// service-proxy-name), or empty.
	Skip        string
	ClusterIPs  []netip.Addr
	ExternalIPs []netip.Addr
	LBIPs       []netip.Addr
	Ports       []corev1.ServicePort
	ITPLocal    bool
	ETPLocal    bool
	Affinity    bool
	Slices      []Slice
}

// Slice is one EndpointSlice reduced to what kube-proxy reads.
type Slice struct {
	Family    int
	Ports     []SlicePort
	Endpoints []SliceEndpoint
}

// SlicePort is a named port of an EndpointSlice.
type SlicePort struct {
	Name     string
	Protocol string
	Port     uint16
}

// SliceEndpoint is one endpoint with its conditions and hints.
type SliceEndpoint struct {
	Addr                        netip.Addr
	Ready, Serving, Terminating bool
	NodeName                    string
	ZoneHints, NodeHints        []string
}

// ServiceEndpoints bounds the service endpoints kube-proxy would program
// for the state on one node, per IP family: each slice's ports times its
// endpoints (a rule per pair), summed. It is counted in one pass, so a
// caller can refuse a state whose expected model would be too large to
// build before building it.
func (st *State) ServiceEndpoints() int {
	n := 0
	for i := range st.Services {
		if st.Services[i].Skip != "" {
			continue
		}
		for _, sl := range st.Services[i].Slices {
			n += len(sl.Ports) * len(sl.Endpoints)
		}
	}
	return n
}

// ErrNotAList is returned for cluster input that is not a v1 List.
var ErrNotAList = errors.New(`cluster input is not a v1 List (expected the output of "kubectl get services,endpointslices,nodes -A -o json" or "-o yaml")`)

// CaptureCommand saves a cluster dump that can be judged.
const CaptureCommand = "kubectl get services,endpointslices,nodes -A -o json > cluster.json"

// ClusterInput counts what a cluster dump held, so that a caller can
// refuse one that cannot be judged.
type ClusterInput struct {
	Services int
	// Proxied are the Services kube-proxy writes rules for (not headless,
	// not ExternalName): their endpoints come from EndpointSlices, and
	// every cluster holds at least default/kubernetes's.
	Proxied int
	Slices  int
	Nodes   int
}

// Complete says why a dump cannot be judged: a dump without Services
// makes every rule on a node stale, one without the EndpointSlices of
// Services that select pods makes every endpoint stale, one without Nodes
// cannot say which node a rule dump is of. Nil: it can.
func (in ClusterInput) Complete() error {
	var why string
	switch {
	case in.Nodes == 0:
		why = "it holds no Nodes (a node's rules cannot be matched to it, nor endpoints to their nodes)"
	case in.Services == 0:
		why = "it holds no Services (every rule on the node would be reported as a stale service)"
	case in.Proxied > 0 && in.Slices == 0:
		why = fmt.Sprintf("it holds %d Services and no EndpointSlices (every endpoint on the node would be reported stale)", in.Proxied)
	default:
		return nil
	}
	return fmt.Errorf("%s: capture a complete one with %s", why, CaptureCommand)
}

// ParseClusterList reads `kubectl get services,endpointslices,nodes -A -o
// json` (or `-o yaml`) output (a v1 List). Items of other kinds are
// ignored.
func ParseClusterList(data []byte) (*State, error) {
	st, _, err := ParseCluster(data)
	return st, err
}

// ParseCluster is ParseClusterList, and what the dump held.
func ParseCluster(data []byte) (*State, ClusterInput, error) {
	var in ClusterInput
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, in, fmt.Errorf("cluster input is empty: %w", ErrNotAList)
	}
	if data[0] != '{' {
		// kubectl's -o yaml: the same List in YAML.
		j, err := yaml.YAMLToJSON(data)
		if err != nil {
			return nil, in, fmt.Errorf("cluster input is neither JSON nor YAML (%v): %w", err, ErrNotAList)
		}
		data = j
	}
	var list struct {
		Kind  string            `json:"kind"`
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(data, &list); err != nil {
		return nil, in, fmt.Errorf("cluster input: %v: %w", err, ErrNotAList)
	}
	if list.Kind != "List" && list.Kind != "ServiceList" && list.Kind != "EndpointSliceList" && list.Kind != "NodeList" {
		return nil, in, fmt.Errorf("cluster input has kind %q: %w", list.Kind, ErrNotAList)
	}
	var (
		svcs   []corev1.Service
		slices []discoveryv1.EndpointSlice
		nodes  []corev1.Node
	)
	for i, raw := range list.Items {
		var meta struct{ Kind string }
		if err := json.Unmarshal(raw, &meta); err != nil {
			return nil, in, fmt.Errorf("cluster input item %d: %w", i, err)
		}
		var err error
		switch meta.Kind {
		case "Service":
			var s corev1.Service
			err = json.Unmarshal(raw, &s)
			svcs = append(svcs, s)
		case "EndpointSlice":
			var s discoveryv1.EndpointSlice
			err = json.Unmarshal(raw, &s)
			slices = append(slices, s)
		case "Node":
			var n corev1.Node
			err = json.Unmarshal(raw, &n)
			nodes = append(nodes, n)
		}
		if err != nil {
			return nil, in, fmt.Errorf("cluster input item %d (%s): %w", i, meta.Kind, err)
		}
	}
	in = ClusterInput{Services: len(svcs), Slices: len(slices), Nodes: len(nodes)}
	for i := range svcs {
		if svcs[i].Spec.Type != corev1.ServiceTypeExternalName && svcs[i].Spec.ClusterIP != corev1.ClusterIPNone {
			in.Proxied++
		}
	}
	return FromAPI(svcs, slices, nodes), in, nil
}

// FromAPI reduces API objects to the audit's State.
func FromAPI(services []corev1.Service, slices []discoveryv1.EndpointSlice, nodes []corev1.Node) *State {
	st := &State{Nodes: map[string]NodeInfo{}}
	for _, n := range nodes {
		// Deprecated, and what it is for: kubelets of the known-bad
		// kube-proxy releases wrote it.
		//lint:ignore SA1019 the only version record of the known-bad releases
		st.Nodes[n.Name] = NodeInfo{Zone: n.Labels[corev1.LabelTopologyZone], KubeProxyVersion: n.Status.NodeInfo.KubeProxyVersion, Quiet: QuietOf(&n)}
	}
	bySvc := map[[2]string][]Slice{}
	for i := range slices {
		s := &slices[i]
		name := s.Labels[discoveryv1.LabelServiceName]
		if name == "" {
			continue
		}
		var fam int
		switch s.AddressType {
		case discoveryv1.AddressTypeIPv4:
			fam = 4
		case discoveryv1.AddressTypeIPv6:
			fam = 6
		default:
			continue // FQDN slices are not proxied
		}
		rs := Slice{Family: fam}
		for _, p := range s.Ports {
			if p.Port == nil {
				continue
			}
			sp := SlicePort{Protocol: "TCP", Port: uint16(*p.Port)}
			if p.Name != nil {
				sp.Name = *p.Name
			}
			if p.Protocol != nil {
				sp.Protocol = string(*p.Protocol)
			}
			rs.Ports = append(rs.Ports, sp)
		}
		for _, e := range s.Endpoints {
			if len(e.Addresses) == 0 {
				continue
			}
			addr, err := netip.ParseAddr(e.Addresses[0])
			if err != nil {
				continue
			}
			c := e.Conditions
			se := SliceEndpoint{
				Addr:        addr.Unmap(),
				Ready:       c.Ready == nil || *c.Ready,
				Serving:     c.Serving == nil || *c.Serving,
				Terminating: c.Terminating != nil && *c.Terminating,
			}
			if e.NodeName != nil {
				se.NodeName = *e.NodeName
			}
			if e.Hints != nil {
				for _, z := range e.Hints.ForZones {
					se.ZoneHints = append(se.ZoneHints, z.Name)
				}
				for _, n := range e.Hints.ForNodes {
					se.NodeHints = append(se.NodeHints, n.Name)
				}
			}
			rs.Endpoints = append(rs.Endpoints, se)
		}
		k := [2]string{s.Namespace, name}
		bySvc[k] = append(bySvc[k], rs)
	}
	for i := range services {
		s := &services[i]
		rs := Service{
			Namespace: s.Namespace, Name: s.Name,
			Ports:    s.Spec.Ports,
			ITPLocal: s.Spec.InternalTrafficPolicy != nil && *s.Spec.InternalTrafficPolicy == corev1.ServiceInternalTrafficPolicyLocal,
			ETPLocal: s.Spec.ExternalTrafficPolicy == corev1.ServiceExternalTrafficPolicyLocal &&
				(s.Spec.Type == corev1.ServiceTypeNodePort || s.Spec.Type == corev1.ServiceTypeLoadBalancer),
			Affinity: s.Spec.SessionAffinity == corev1.ServiceAffinityClientIP,
			Slices:   bySvc[[2]string{s.Namespace, s.Name}],
		}
		switch {
		case s.Spec.Type == corev1.ServiceTypeExternalName:
			rs.Skip = "ExternalName service"
		case s.Labels[LabelServiceProxyName] != "":
			rs.Skip = "implemented by proxy " + s.Labels[LabelServiceProxyName]
		case s.Spec.ClusterIP == corev1.ClusterIPNone || s.Spec.ClusterIP == "":
			rs.Skip = "headless service"
		}
		ips := s.Spec.ClusterIPs
		if len(ips) == 0 && s.Spec.ClusterIP != "" {
			ips = []string{s.Spec.ClusterIP}
		}
		rs.ClusterIPs = parseAddrs(ips)
		rs.ExternalIPs = parseAddrs(s.Spec.ExternalIPs)
		for _, ing := range s.Status.LoadBalancer.Ingress {
			// An ingress in Proxy mode is handled by the load balancer, not the node.
			if ing.IP == "" || (ing.IPMode != nil && *ing.IPMode == corev1.LoadBalancerIPModeProxy) {
				continue
			}
			rs.LBIPs = append(rs.LBIPs, parseAddrs([]string{ing.IP})...)
		}
		st.Services = append(st.Services, rs)
	}
	sort.Slice(st.Services, func(i, j int) bool {
		a, b := st.Services[i], st.Services[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		return a.Name < b.Name
	})
	return st
}

func parseAddrs(ss []string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		if a, err := netip.ParseAddr(s); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// ServiceFamilies lists the IP families (4, 6) the cluster's proxied
// services have cluster IPs in, ascending.
func ServiceFamilies(st *State) []int {
	var seen [7]bool
	for i := range st.Services {
		if st.Services[i].Skip != "" {
			continue
		}
		for _, ip := range st.Services[i].ClusterIPs {
			seen[Family(ip)] = true
		}
	}
	return FamilyList(seen)
}

func Family(a netip.Addr) int {
	if a.Is4() {
		return 4
	}
	return 6
}
