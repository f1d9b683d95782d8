// Package synth generates a cluster of any size together with the rules a
// healthy kube-proxy 1.36 would program for it, in the exact layout of the
// captures under audit/testdata/capture: iptables-save text (large cluster
// mode drops the per-endpoint comments, as kube-proxy does above 1,000
// endpoints) and `nft -j list table ip kube-proxy` JSON. Benchmarks and the
// fleet simulation use it where the real cluster cannot hold the scale; the
// tests prove that the audit reads its output as a healthy node.
package synth

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base32"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"sort"
	"strconv"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/iptables"
)

// Spec sizes a synthetic cluster.
type Spec struct {
	// Services is the number of ClusterIP services (one TCP port "http",
	// 80 → 8080), each with EndpointsPerService ready endpoints.
	Services            int
	EndpointsPerService int
	// Comments writes kube-proxy's per-endpoint comments; kube-proxy omits
	// them in large cluster mode (more than 1,000 endpoints).
	Comments bool
}

// Namespace holds every synthetic service.
const Namespace = "synth"

// ClusterCIDR is the pod range the masquerade rules name.
const ClusterCIDR = "198.18.128.0/17"

// MaxServices and MaxEndpoints bound a Spec: addresses stay inside
// 198.18.0.0/15 without overlapping.
const (
	MaxServices  = 12000
	MaxEndpoints = 120000
)

// Validate reports a Spec the generator cannot honour.
func (s Spec) Validate() error {
	if s.Services < 1 || s.Services > MaxServices {
		return fmt.Errorf("synth: %d services (want 1..%d)", s.Services, MaxServices)
	}
	if s.EndpointsPerService < 1 || s.Services*s.EndpointsPerService > MaxEndpoints {
		return fmt.Errorf("synth: %d endpoints (want 1..%d)", s.Services*s.EndpointsPerService, MaxEndpoints)
	}
	return nil
}

// ServiceName is the name of service i.
func ServiceName(i int) string { return fmt.Sprintf("svc-%05d", i) }

// VIP is the cluster IP of service i (198.19.192.0 upwards).
func VIP(i int) netip.Addr { return addAddr(netip.MustParseAddr("198.19.192.0"), i) }

// EndpointAddr is the address of endpoint j of service i (198.18.0.16
// upwards, dense).
func (s Spec) EndpointAddr(i, j int) netip.Addr {
	return addAddr(netip.MustParseAddr("198.18.0.16"), i*s.EndpointsPerService+j)
}

func addAddr(a netip.Addr, n int) netip.Addr {
	b := a.As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += uint32(n)
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// Replaced returns a copy of sl whose endpoint j is the k-th address past
// the cluster's own endpoints: a pod replaced by a new one.
func (s Spec) Replaced(sl discoveryv1.EndpointSlice, j, k int) discoveryv1.EndpointSlice {
	c := *sl.DeepCopy()
	c.Endpoints[j].Addresses = []string{s.EndpointAddr(0, s.Services*s.EndpointsPerService+k).String()}
	return c
}

// APIObjects is Objects as one list, for a fake clientset.
func (s Spec) APIObjects() []runtime.Object {
	svcs, slices := s.Objects()
	objs := make([]runtime.Object, 0, len(svcs)+len(slices))
	for i := range svcs {
		objs = append(objs, &svcs[i])
	}
	for i := range slices {
		objs = append(objs, &slices[i])
	}
	return objs
}

// Objects returns the Services and EndpointSlices of the cluster, one slice
// per service (slices of up to 1,000 endpoints, as the controller makes).
func (s Spec) Objects() ([]corev1.Service, []discoveryv1.EndpointSlice) {
	svcs := make([]corev1.Service, 0, s.Services)
	var slices []discoveryv1.EndpointSlice
	tcp := corev1.ProtocolTCP
	name, port := "http", int32(8080)
	for i := range s.Services {
		svcs = append(svcs, corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: Namespace, Name: ServiceName(i)},
			Spec: corev1.ServiceSpec{
				Type:       corev1.ServiceTypeClusterIP,
				ClusterIP:  VIP(i).String(),
				ClusterIPs: []string{VIP(i).String()},
				Ports:      []corev1.ServicePort{{Name: "http", Port: 80, Protocol: tcp}},
			},
		})
		for start := 0; start < s.EndpointsPerService; start += 1000 {
			sl := discoveryv1.EndpointSlice{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: Namespace, Name: fmt.Sprintf("%s-%d", ServiceName(i), start/1000),
					Labels: map[string]string{discoveryv1.LabelServiceName: ServiceName(i)},
				},
				AddressType: discoveryv1.AddressTypeIPv4,
				Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &port, Protocol: &tcp}},
			}
			for j := start; j < min(start+1000, s.EndpointsPerService); j++ {
				sl.Endpoints = append(sl.Endpoints, discoveryv1.Endpoint{Addresses: []string{s.EndpointAddr(i, j).String()}})
			}
			slices = append(slices, sl)
		}
	}
	return svcs, slices
}

// Observed is the audit's reading of the rules WriteIPTablesSave writes.
func (s Spec) Observed() (*audit.Observed, error) {
	var b bytes.Buffer
	if err := s.WriteIPTablesSave(&b); err != nil {
		return nil, err
	}
	return iptables.Parse(&b)
}

// portProtoHash is kube-proxy's chain-name hash.
func portProtoHash(s string) string {
	h := sha256.Sum256([]byte(s))
	return base32.StdEncoding.EncodeToString(h[:])[:16]
}

func (s Spec) svcPortName(i int) string { return Namespace + "/" + ServiceName(i) + ":http" }

// WriteIPTablesSave writes the nat table as `iptables-save -t nat` prints it
// for a healthy nf_tables-backend kube-proxy: chain declarations, the
// jump rules, KUBE-SERVICES, then each service and endpoint chain.
func (s Spec) WriteIPTablesSave(w io.Writer) error {
	if err := s.Validate(); err != nil {
		return err
	}
	bw := bufio.NewWriterSize(w, 256<<10)
	bw.WriteString("# Generated by iptables-save v1.8.9 (nf_tables)\n*nat\n")
	bw.WriteString(":PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n")
	bw.WriteString(":KUBE-MARK-MASQ - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\n:KUBE-SERVICES - [0:0]\n")
	for i := range s.Services {
		fmt.Fprintf(bw, ":KUBE-SVC-%s - [0:0]\n", portProtoHash(s.svcPortName(i)+"tcp"))
		for j := range s.EndpointsPerService {
			fmt.Fprintf(bw, ":KUBE-SEP-%s - [0:0]\n", s.sepHash(i, j))
		}
	}
	bw.WriteString("-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	bw.WriteString("-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n")
	bw.WriteString("-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n")
	bw.WriteString("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n")
	bw.WriteString("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n")
	bw.WriteString("-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n")
	bw.WriteString("-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully\n")
	for i := range s.Services {
		fmt.Fprintf(bw, "-A KUBE-SERVICES -d %s/32 -p tcp -m comment --comment \"%s cluster IP\" -m tcp --dport 80 -j KUBE-SVC-%s\n",
			VIP(i), s.svcPortName(i), portProtoHash(s.svcPortName(i)+"tcp"))
	}
	bw.WriteString("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n")
	for i := range s.Services {
		s.writeServiceRules(bw, i)
	}
	bw.WriteString("COMMIT\n")
	return bw.Flush()
}

// writeServiceRules writes service i's policy chain and endpoint chains.
func (s Spec) writeServiceRules(bw *bufio.Writer, i int) {
	spn := s.svcPortName(i)
	svc := s.SVCChain(i)
	fmt.Fprintf(bw, "-A %s ! -s %s -d %s/32 -p tcp -m comment --comment \"%s cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ\n", svc, ClusterCIDR, VIP(i), spn)
	n := s.EndpointsPerService
	for j := range n {
		ep := s.EndpointAddr(i, j)
		bw.WriteString("-A " + svc)
		if s.Comments {
			fmt.Fprintf(bw, " -m comment --comment \"%s -> %s:8080\"", spn, ep)
		}
		if j < n-1 {
			fmt.Fprintf(bw, " -m statistic --mode random --probability %0.11f", 1.0/float64(n-j))
		}
		bw.WriteString(" -j " + s.SEPChain(i, j) + "\n")
	}
	for j := range n {
		ep := s.EndpointAddr(i, j)
		sep := s.SEPChain(i, j)
		comment := ""
		if s.Comments {
			comment = " -m comment --comment " + spn
		}
		fmt.Fprintf(bw, "-A %s -s %s/32%s -j KUBE-MARK-MASQ\n", sep, ep, comment)
		fmt.Fprintf(bw, "-A %s -p tcp%s -m tcp -j DNAT --to-destination %s:8080\n", sep, comment, ep)
	}
}

// SVCChain is service i's policy chain (KUBE-SVC-…).
func (s Spec) SVCChain(i int) string { return "KUBE-SVC-" + portProtoHash(s.svcPortName(i)+"tcp") }

// SEPChain is the endpoint chain of service i's endpoint j (KUBE-SEP-…).
func (s Spec) SEPChain(i, j int) string { return "KUBE-SEP-" + s.sepHash(i, j) }

// WritePartialSync writes the iptables-restore --noflush input of one
// kube-proxy partial sync that rewrites the given services' chains with
// the content they already have (each chain declared, which flushes it,
// then its rules). With dispatch, it also rewrites KUBE-SERVICES, KUBE-
// NODEPORTS and KUBE-MARK-MASQ whole, as kube-proxy 1.36 does at every
// sync; without, only the services' chains (the shape of the churn in
// ../shared/TESTBED.md).
func (s Spec) WritePartialSync(w io.Writer, services []int, dispatch bool) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	bw.WriteString("*nat\n")
	if dispatch {
		bw.WriteString(":KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n")
	}
	for _, i := range services {
		fmt.Fprintf(bw, ":%s - [0:0]\n", s.SVCChain(i))
		for j := range s.EndpointsPerService {
			fmt.Fprintf(bw, ":%s - [0:0]\n", s.SEPChain(i, j))
		}
	}
	if dispatch {
		bw.WriteString("-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n")
		for i := range s.Services {
			fmt.Fprintf(bw, "-A KUBE-SERVICES -d %s/32 -p tcp -m comment --comment \"%s cluster IP\" -m tcp --dport 80 -j %s\n",
				VIP(i), s.svcPortName(i), s.SVCChain(i))
		}
		bw.WriteString("-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS\n")
	}
	for _, i := range services {
		s.writeServiceRules(bw, i)
	}
	bw.WriteString("COMMIT\n")
	return bw.Flush()
}

func (s Spec) sepHash(i, j int) string {
	return portProtoHash(s.svcPortName(i) + "tcp" + s.EndpointAddr(i, j).String() + ":8080")
}

// nftChain is kube-proxy's nftables chain name for service i.
// NFTChain is kube-proxy's nftables service chain for service i.
func (s Spec) NFTChain(i int) string { return s.nftChain(i) }

// WriteNFTPartialSync writes the `nft -f` input of one kube-proxy
// nftables-mode sync that rewrites the given services' chains with the
// content they already have (each chain flushed, then its DNAT rule: a new
// anonymous numgen map each time, as kube-proxy makes it); with
// dnatTo, service services[0]'s first endpoint is replaced by that
// address (a drift by hand).
func (s Spec) WriteNFTPartialSync(w io.Writer, services []int, dnatTo netip.AddrPort) error {
	bw := bufio.NewWriterSize(w, 64<<10)
	for k, i := range services {
		chain := s.nftChain(i)
		fmt.Fprintf(bw, "flush chain ip kube-proxy %s\n", chain)
		fmt.Fprintf(bw, "add rule ip kube-proxy %s meta l4proto tcp dnat ip addr . port to numgen random mod %d map { ", chain, s.EndpointsPerService)
		for j := range s.EndpointsPerService {
			if j > 0 {
				bw.WriteString(", ")
			}
			ap := netip.AddrPortFrom(s.EndpointAddr(i, j), 8080)
			if k == 0 && j == 0 && dnatTo.IsValid() {
				ap = dnatTo
			}
			fmt.Fprintf(bw, "%d : %s . %d", j, ap.Addr(), ap.Port())
		}
		bw.WriteString(" }\n")
	}
	return bw.Flush()
}

func (s Spec) nftChain(i int) string {
	name := Namespace + "/" + ServiceName(i) + "/tcp/http"
	return "service-" + portProtoHash(name)[:8] + "-" + name
}

// WriteNFTJSON writes `nft -j list table ip kube-proxy` output for a
// healthy nftables-mode kube-proxy: the cluster-ips set, the service-ips
// verdict map, the services dispatch rules and one service chain per
// service whose DNAT picks an endpoint through a numgen map.
func (s Spec) WriteNFTJSON(w io.Writer) error {
	if err := s.Validate(); err != nil {
		return err
	}
	bw := bufio.NewWriterSize(w, 256<<10)
	handle := 10
	next := func() int { handle++; return handle }
	bw.WriteString(`{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"table": {"family": "ip", "name": "kube-proxy", "handle": 3}}`)
	fmt.Fprintf(bw, `, {"set": {"family": "ip", "name": "cluster-ips", "table": "kube-proxy", "type": "ipv4_addr", "handle": %d, "comment": "Active ClusterIPs", "elem": [`, next())
	for i := range s.Services {
		if i > 0 {
			bw.WriteString(", ")
		}
		bw.WriteString(`"` + VIP(i).String() + `"`)
	}
	bw.WriteString("]}}")
	fmt.Fprintf(bw, `, {"map": {"family": "ip", "name": "service-ips", "table": "kube-proxy", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": %d, "comment": "ClusterIP, ExternalIP and LoadBalancer IP traffic", "map": "verdict", "elem": [`, next())
	for i := range s.Services {
		if i > 0 {
			bw.WriteString(", ")
		}
		fmt.Fprintf(bw, `[{"concat": ["%s", "tcp", 80]}, {"goto": {"target": "%s"}}]`, VIP(i), s.nftChain(i))
	}
	bw.WriteString("]}}")
	for _, c := range []string{"nat-prerouting", "services"} {
		fmt.Fprintf(bw, `, {"chain": {"family": "ip", "table": "kube-proxy", "name": "%s", "handle": %d}}`, c, next())
	}
	for i := range s.Services {
		fmt.Fprintf(bw, `, {"chain": {"family": "ip", "table": "kube-proxy", "name": "%s", "handle": %d}}`, s.nftChain(i), next())
	}
	fmt.Fprintf(bw, `, {"rule": {"family": "ip", "table": "kube-proxy", "chain": "nat-prerouting", "handle": %d, "expr": [{"jump": {"target": "services"}}]}}`, next())
	fmt.Fprintf(bw, `, {"rule": {"family": "ip", "table": "kube-proxy", "chain": "services", "handle": %d, "comment": "masquerade clusterIP traffic from outside cluster", "expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": "@cluster-ips"}}, {"match": {"op": "!=", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": {"addr": "198.18.128.0", "len": 17}}}}, {"mangle": {"key": {"meta": {"key": "mark"}}, "value": {"|": [{"meta": {"key": "mark"}}, 16384]}}}]}}`, next())
	fmt.Fprintf(bw, `, {"rule": {"family": "ip", "table": "kube-proxy", "chain": "services", "handle": %d, "expr": [{"vmap": {"key": {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}}, {"meta": {"key": "l4proto"}}, {"payload": {"protocol": "th", "field": "dport"}}]}, "data": "@service-ips"}}]}}`, next())
	for i := range s.Services {
		chain := s.nftChain(i)
		n := s.EndpointsPerService
		fmt.Fprintf(bw, `, {"rule": {"family": "ip", "table": "kube-proxy", "chain": "%s", "handle": %d, "expr": [{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": "tcp"}}, {"dnat": {"family": "ip", "addr": {"map": {"key": {"numgen": {"mode": "random", "mod": %d, "offset": 0}}, "data": {"set": [`, chain, next(), n)
		for j := range n {
			if j > 0 {
				bw.WriteString(", ")
			}
			bw.WriteString(`[` + strconv.Itoa(j) + `, {"concat": ["` + s.EndpointAddr(i, j).String() + `", 8080]}]`)
		}
		bw.WriteString(`]}}}}}]}}`)
	}
	bw.WriteString("]}\n")
	return bw.Flush()
}

// NFTLoadOrder reorders `nft -j list` output so that `nft -j -f` can load
// it: nft lists maps before the chains their verdicts name, and refuses to
// create them in that order. Tables come first, then chains, sets and maps,
// then rules.
func NFTLoadOrder(listing []byte) ([]byte, error) {
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal(listing, &doc); err != nil {
		return nil, fmt.Errorf("nft JSON: %w", err)
	}
	rank := map[string]int{"metainfo": 0, "table": 1, "chain": 2, "set": 3, "map": 3, "rule": 4}
	sort.SliceStable(doc.Nftables, func(i, j int) bool {
		return rank[firstKey(doc.Nftables[i])] < rank[firstKey(doc.Nftables[j])]
	})
	return json.Marshal(doc)
}

func firstKey(m map[string]json.RawMessage) string {
	for k := range m {
		return k
	}
	return ""
}

// Rules is the audit model of what a healthy kube-proxy in iptables mode
// programs for any cluster state st, on a node of a cluster without
// node-local policies: every expected frontend with the endpoints of its
// scope, as the collector reads them.
func Rules(st *audit.State) *audit.Observed { return RulesFor(st, "") }

// RulesFor is Rules on the named node: its Local endpoints, its zone's and
// its own hints.
func RulesFor(st *audit.State, node string) *audit.Observed {
	exp := audit.ExpectedFor(st, node)
	o := &audit.Observed{Mode: audit.ModeIPTables, Families: []int{4}}
	for i := range exp.Ports {
		p := &exp.Ports[i]
		for _, fe := range p.Frontends {
			of := audit.ObservedFrontend{FrontendKey: fe.FrontendKey, Scope: fe.Scope}
			for _, a := range p.Want(fe.Scope, audit.ModeIPTables) {
				of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: a, Weight: -1})
			}
			o.Frontends = append(o.Frontends, of)
		}
	}
	return o
}

// WriteIPVSRestore writes `ipvsadm -R` input for an IPVS-mode kube-proxy
// holding the cluster: a virtual server per service's cluster IP and a
// real server per endpoint (masqueraded, weight 1), of the given services
// (nil: all). With edit, each real server is edited to what it already is
// (`-e`: kube-proxy's IPVS sync rewriting a service's real servers).
func (s Spec) WriteIPVSRestore(w io.Writer, services []int, edit bool) error {
	if err := s.Validate(); err != nil {
		return err
	}
	if services == nil {
		services = make([]int, s.Services)
		for i := range services {
			services[i] = i
		}
	}
	bw := bufio.NewWriterSize(w, 256<<10)
	for _, i := range services {
		vip := netip.AddrPortFrom(VIP(i), 80)
		if !edit {
			fmt.Fprintf(bw, "-A -t %s -s rr\n", vip)
		}
		op := "-a"
		if edit {
			op = "-e"
		}
		for j := range s.EndpointsPerService {
			fmt.Fprintf(bw, "%s -t %s -r %s -m -w 1\n", op, vip, netip.AddrPortFrom(s.EndpointAddr(i, j), 8080))
		}
	}
	return bw.Flush()
}
