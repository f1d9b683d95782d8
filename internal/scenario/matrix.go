// Package scenario holds the service matrix that exercises every rule
// shape kube-proxy writes, how it is applied to a local cluster, and the
// captures of each node's rules that become the audit package's golden
// fixtures. The end-to-end suites (internal/e2e) and the demo drive it.
package scenario

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// Nodes of the matrix cluster: both zones, both proxy modes, both iptables
// backends.
var Nodes = []localcluster.NodeSpec{
	{Name: "ipt-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "ipt-b", Mode: localcluster.ModeIPTables, Zone: "zone-b", LegacyIPTables: true},
	{Name: "nft-a", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
	{Name: "nft-b", Mode: localcluster.ModeNFTables, Zone: "zone-b"},
}

// Namespace holds every matrix object.
const Namespace = "matrix"

func ptr[T any](v T) *T { return &v }

func svcPort(name string, port int32, proto corev1.Protocol) corev1.ServicePort {
	return corev1.ServicePort{Name: name, Port: port, Protocol: proto}
}

func epPort(name string, port int32, proto corev1.Protocol) discoveryv1.EndpointPort {
	return discoveryv1.EndpointPort{Name: ptr(name), Port: ptr(port), Protocol: ptr(proto)}
}

// Endpoint builds an endpoint; state is "ready", "notready" or "terminating"
// (serving and terminating); node and zone may be empty.
func Endpoint(ip, state, node, zone string, hintZones ...string) discoveryv1.Endpoint {
	e := discoveryv1.Endpoint{Addresses: []string{ip}}
	switch state {
	case "ready":
		e.Conditions = discoveryv1.EndpointConditions{Ready: ptr(true), Serving: ptr(true), Terminating: ptr(false)}
	case "notready":
		e.Conditions = discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(false), Terminating: ptr(false)}
	case "terminating":
		e.Conditions = discoveryv1.EndpointConditions{Ready: ptr(false), Serving: ptr(true), Terminating: ptr(true)}
	default:
		panic("unknown endpoint state " + state)
	}
	if node != "" {
		e.NodeName = ptr(node)
	}
	if zone != "" {
		e.Zone = ptr(zone)
	}
	if len(hintZones) > 0 {
		e.Hints = &discoveryv1.EndpointHints{}
		for _, z := range hintZones {
			e.Hints.ForZones = append(e.Hints.ForZones, discoveryv1.ForZone{Name: z})
		}
	}
	return e
}

// Entry is one matrix service with its EndpointSlices.
type Entry struct {
	Service *corev1.Service
	Slices  []*discoveryv1.EndpointSlice
}

func slice(svc, name string, ports []discoveryv1.EndpointPort, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: name, Labels: map[string]string{
			discoveryv1.LabelServiceName: svc, discoveryv1.LabelManagedBy: "proxyaudit-tests"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       ports,
		Endpoints:   eps,
	}
}

func service(name string, mut func(*corev1.ServiceSpec), ports ...corev1.ServicePort) *corev1.Service {
	s := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: name}, Spec: corev1.ServiceSpec{Ports: ports}}
	if mut != nil {
		mut(&s.Spec)
	}
	return s
}

// Matrix returns the services that cover every rule shape kube-proxy writes.
func Matrix() []Entry {
	tcp, udp, sctp := corev1.ProtocolTCP, corev1.ProtocolUDP, corev1.ProtocolSCTP
	return []Entry{
		// Two TCP ports and a UDP one on one service.
		{service("multi", nil, svcPort("http", 80, tcp), svcPort("metrics", 9090, tcp), svcPort("dns", 53, udp)),
			[]*discoveryv1.EndpointSlice{slice("multi", "multi-1",
				[]discoveryv1.EndpointPort{epPort("http", 8080, tcp), epPort("metrics", 9090, tcp), epPort("dns", 5353, udp)},
				Endpoint("198.18.128.1", "ready", "ipt-a", "zone-a"), Endpoint("198.18.128.2", "ready", "nft-b", "zone-b"), Endpoint("198.18.128.3", "ready", "", ""))}},
		// An unnamed port on SCTP.
		{service("sctp", nil, svcPort("", 3868, sctp)),
			[]*discoveryv1.EndpointSlice{slice("sctp", "sctp-1", []discoveryv1.EndpointPort{epPort("", 3868, sctp)},
				Endpoint("198.18.128.5", "ready", "", ""))}},
		{service("nodeport", func(s *corev1.ServiceSpec) { s.Type = corev1.ServiceTypeNodePort }, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("nodeport", "nodeport-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.10", "ready", "ipt-a", "zone-a"), Endpoint("198.18.128.11", "ready", "nft-a", "zone-a"))}},
		// LoadBalancer with an ingress IP and source ranges (firewall chain).
		{lb("lb", nil), []*discoveryv1.EndpointSlice{slice("lb", "lb-1", []discoveryv1.EndpointPort{epPort("https", 8443, tcp)},
			Endpoint("198.18.128.20", "ready", "ipt-b", "zone-b"), Endpoint("198.18.128.21", "ready", "nft-b", "zone-b"))}},
		// externalTrafficPolicy: Local on a LoadBalancer: the local chain holds only this node's endpoints.
		{lb("etp-local", func(s *corev1.ServiceSpec) {
			s.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
			s.LoadBalancerSourceRanges = nil
		}), []*discoveryv1.EndpointSlice{slice("etp-local", "etp-local-1", []discoveryv1.EndpointPort{epPort("https", 8443, tcp)},
			Endpoint("198.18.128.30", "ready", "ipt-a", "zone-a"), Endpoint("198.18.128.31", "ready", "nft-a", "zone-a"), Endpoint("198.18.128.32", "ready", "ipt-b", "zone-b"))}},
		{service("itp-local", func(s *corev1.ServiceSpec) { s.InternalTrafficPolicy = ptr(corev1.ServiceInternalTrafficPolicyLocal) }, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("itp-local", "itp-local-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.40", "ready", "ipt-a", "zone-a"), Endpoint("198.18.128.41", "ready", "nft-b", "zone-b"))}},
		// Topology hints: every endpoint hinted, so nodes use only their zone's.
		{service("topology", nil, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("topology", "topology-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.50", "ready", "ipt-a", "zone-a", "zone-a"), Endpoint("198.18.128.51", "ready", "nft-a", "zone-a", "zone-a"),
				Endpoint("198.18.128.52", "ready", "ipt-b", "zone-b", "zone-b"))}},
		// One endpoint without hints: hints are ignored everywhere.
		{service("topology-partial", nil, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("topology-partial", "topology-partial-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.55", "ready", "ipt-a", "zone-a", "zone-a"), Endpoint("198.18.128.56", "ready", "ipt-b", "zone-b"))}},
		// Ready, not-ready and terminating endpoints: only the ready one is used.
		{service("mixed-states", nil, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("mixed-states", "mixed-states-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.60", "ready", "", ""), Endpoint("198.18.128.61", "notready", "", ""), Endpoint("198.18.128.62", "terminating", "", ""))}},
		// Nothing ready: fall back to serving+terminating endpoints.
		{service("terminating-only", nil, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("terminating-only", "terminating-only-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.65", "terminating", "", ""), Endpoint("198.18.128.66", "notready", "", ""))}},
		{service("affinity", func(s *corev1.ServiceSpec) {
			s.SessionAffinity = corev1.ServiceAffinityClientIP
			s.SessionAffinityConfig = &corev1.SessionAffinityConfig{ClientIP: &corev1.ClientIPConfig{TimeoutSeconds: ptr(int32(600))}}
		}, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("affinity", "affinity-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.70", "ready", "", ""), Endpoint("198.18.128.71", "ready", "", ""))}},
		// No endpoints at all: REJECT (iptables filter table) / no-endpoint map (nftables).
		{service("no-endpoints", nil, svcPort("http", 80, tcp)), nil},
		// Endpoints split across two slices.
		{service("two-slices", nil, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{
				slice("two-slices", "two-slices-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)}, Endpoint("198.18.128.75", "ready", "", "")),
				slice("two-slices", "two-slices-2", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)}, Endpoint("198.18.128.76", "ready", "", ""))}},
		{service("external-ip", func(s *corev1.ServiceSpec) { s.ExternalIPs = []string{"198.18.96.5"} }, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("external-ip", "external-ip-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.80", "ready", "", ""))}},
		// Services kube-proxy must leave alone.
		{service("headless", func(s *corev1.ServiceSpec) { s.ClusterIP = corev1.ClusterIPNone }, svcPort("http", 80, tcp)),
			[]*discoveryv1.EndpointSlice{slice("headless", "headless-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
				Endpoint("198.18.128.85", "ready", "", ""))}},
		{service("external-name", func(s *corev1.ServiceSpec) {
			s.Type = corev1.ServiceTypeExternalName
			s.ExternalName = "example.invalid"
		}), nil},
		{proxyNamed(), []*discoveryv1.EndpointSlice{slice("other-proxy", "other-proxy-1", []discoveryv1.EndpointPort{epPort("http", 8080, tcp)},
			Endpoint("198.18.128.90", "ready", "", ""))}},
	}
}

func lb(name string, mut func(*corev1.ServiceSpec)) *corev1.Service {
	s := service(name, func(s *corev1.ServiceSpec) {
		s.Type = corev1.ServiceTypeLoadBalancer
		s.LoadBalancerSourceRanges = []string{"198.18.0.0/24"}
		if mut != nil {
			mut(s)
		}
	}, svcPort("https", 443, corev1.ProtocolTCP))
	ingress := map[string]string{"lb": "198.18.97.1", "etp-local": "198.18.97.2"}[name]
	s.Status.LoadBalancer.Ingress = []corev1.LoadBalancerIngress{{IP: ingress}}
	return s
}

func proxyNamed() *corev1.Service {
	s := service("other-proxy", nil, svcPort("http", 80, corev1.ProtocolTCP))
	s.Labels = map[string]string{"service.kubernetes.io/service-proxy-name": "some-other-proxy"}
	return s
}

// Apply creates every entry's service and slices.
func Apply(ctx context.Context, c *localcluster.Cluster, entries []Entry) error {
	for _, e := range entries {
		if _, err := c.CreateService(ctx, e.Service); err != nil {
			return err
		}
		for _, s := range e.Slices {
			if err := c.ApplySlice(ctx, s); err != nil {
				return err
			}
		}
	}
	return nil
}

// Bulk returns a service with n ready endpoints spread over slices of at
// most 500, enough to push kube-proxy into large-cluster mode (no comments)
// when n > 1000.
func Bulk(n int) Entry {
	e := Entry{Service: service("bulk", nil, svcPort("http", 80, corev1.ProtocolTCP))}
	var cur *discoveryv1.EndpointSlice
	for i := 0; i < n; i++ {
		if i%500 == 0 {
			cur = slice("bulk", fmt.Sprintf("bulk-%d", i/500), []discoveryv1.EndpointPort{epPort("http", 8080, corev1.ProtocolTCP)})
			e.Slices = append(e.Slices, cur)
		}
		cur.Endpoints = append(cur.Endpoints, Endpoint(fmt.Sprintf("198.18.%d.%d", 130+i/250, 1+i%250), "ready", "", ""))
	}
	return e
}
