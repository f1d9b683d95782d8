package audit

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// A dual-stack NodePort service: a node port in each family, endpoints
// per family.
func dualStackState() *State {
	ep := func(a string) SliceEndpoint {
		return SliceEndpoint{Addr: netip.MustParseAddr(a), Ready: true, Serving: true}
	}
	ports := []SlicePort{{Name: "http", Protocol: "TCP", Port: 8080}}
	return &State{Nodes: map[string]NodeInfo{"n": {}}, Services: []Service{{
		Namespace: "default", Name: "web",
		ClusterIPs: []netip.Addr{netip.MustParseAddr("198.19.0.10"), netip.MustParseAddr("2001:2:0:ffff::10")},
		Ports:      []corev1.ServicePort{{Name: "http", Port: 80, NodePort: 30080, Protocol: corev1.ProtocolTCP}},
		Slices: []Slice{
			{Family: 4, Ports: ports, Endpoints: []SliceEndpoint{ep("198.18.140.1")}},
			{Family: 6, Ports: ports, Endpoints: []SliceEndpoint{ep("2001:2:0:8001::1")}},
		},
	}}}
}

func TestDualStackExpectedAndFound(t *testing.T) {
	exp := ExpectedFor(dualStackState(), "n")
	if len(exp.Ports) != 2 || exp.Ports[0].Family == exp.Ports[1].Family {
		t.Fatalf("a dual-stack port expected once per family: %+v", exp.Ports)
	}
	keys := map[FrontendKey]int{}
	for _, p := range exp.Ports {
		for _, fe := range p.Frontends {
			keys[fe.FrontendKey] = p.Family
			if fe.Family() != p.Family {
				t.Errorf("frontend %s of the IPv%d port is IPv%d", fe.FrontendKey, p.Family, fe.Family())
			}
		}
	}
	if len(keys) != 4 || keys[NodePortKey(4, "TCP", 30080)] != 4 || keys[NodePortKey(6, "TCP", 30080)] != 6 {
		t.Fatalf("frontends: %v (want a cluster IP and a node port per family)", keys)
	}
	// Rules that are right in IPv4 and have nothing in IPv6 (a flushed
	// ip6 table): every IPv6 frontend missing, named with its family;
	// nothing said of IPv4.
	obs := &Observed{Mode: ModeIPTables, Families: []int{4, 6}}
	for _, p := range exp.Ports {
		if p.Family != 4 {
			continue
		}
		for _, fe := range p.Frontends {
			obs.Frontends = append(obs.Frontends, ObservedFrontend{FrontendKey: fe.FrontendKey, Scope: ScopeCluster, Chain: "KUBE-SVC-X",
				Endpoints: []Endpoint{{Addr: netip.MustParseAddrPort("198.18.140.1:8080"), Weight: -1}}})
		}
	}
	obs.Normalize()
	fs := Diff(exp, obs)
	if len(fs) != 1 { // once per port and scope, however many frontends
		t.Fatalf("findings: %+v", fs)
	}
	for _, f := range fs {
		if f.Kind != MissingService || f.Family != 6 {
			t.Errorf("finding %s family %d, want MissingService of IPv6", f.Kind, f.Family)
		}
	}
	if got := Unaudited(exp, obs); got != nil {
		t.Errorf("both families read, yet %v not audited", got)
	}
	// Only IPv4 read: IPv6 is not audited, and not a finding either.
	obs.Families = []int{4}
	if fs := Diff(exp, obs); len(fs) != 0 {
		t.Errorf("IPv4 only read: findings %+v", fs)
	}
	if got := Unaudited(exp, obs); !slices.Equal(got, []int{6}) {
		t.Errorf("IPv4 only read: not audited %v, want [6]", got)
	}
	for _, pt := range Explain(exp, obs, "") {
		for _, ft := range pt.Frontends {
			if (pt.Family == 6) != (ft.Status == TraceUnaudited) {
				t.Errorf("explain IPv%d %s: %s", pt.Family, ft.Frontend, ft.Status)
			}
		}
	}
}

func TestMergeFamilies(t *testing.T) {
	v4 := &Observed{Mode: ModeNFTables, Families: []int{4}, RejectsKnown: true,
		Frontends: []ObservedFrontend{{FrontendKey: NodePortKey(4, "TCP", 30080)}}}
	v6 := &Observed{Mode: ModeNFTables, Families: []int{6}, NoRules: true, RejectsKnown: true}
	m, err := Merge(v6, v4)
	if err != nil || m.NoRules || !slices.Equal(m.Families, []int{4, 6}) || len(m.Frontends) != 1 || !m.RejectsKnown {
		t.Fatalf("merged %+v, %v", m, err)
	}
	// An IPv6-only node: the IPv4 table empty by design, not "no rules".
	m, _ = Merge(&Observed{Mode: ModeNFTables, Families: []int{4}, NoRules: true},
		&Observed{Mode: ModeNFTables, Families: []int{6}, Frontends: []ObservedFrontend{{FrontendKey: NodePortKey(6, "TCP", 30080)}}})
	if m.NoRules {
		t.Error("an IPv6-only node read as without rules")
	}
	m, _ = Merge(&Observed{Mode: ModeIPTables, Families: []int{4}, NoRules: true}, &Observed{Mode: ModeIPTables, Families: []int{6}, NoRules: true})
	if !m.NoRules {
		t.Error("both families empty: not NoRules")
	}
	if _, err := Merge(v4, v4); err == nil || !strings.Contains(err.Error(), "IPv4 rules given twice") {
		t.Errorf("one family twice: %v", err)
	}
	if _, err := Merge(v4, &Observed{Mode: ModeIPVS, Families: []int{6}}); err == nil {
		t.Error("two modes merged")
	}
}
