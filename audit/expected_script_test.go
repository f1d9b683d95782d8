package audit_test

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"sigs.k8s.io/yaml"

	"github.com/proxyaudit/proxyaudit/audit"
)

// TestExpectedScripts checks the expected model (what kube-proxy 1.36
// programs on a node) case by case from testdata/expected: Services and
// EndpointSlices as YAML in, each port's frontends and endpoint sets per
// scope out. The cases include kube-proxy's own pkg/proxy/topology_test.go,
// restated as API objects. Regenerate with
//
//	go test ./audit -run TestExpectedScripts -rewrite
//
// The commands:
//
//	objects
//	<Services, EndpointSlices and Nodes as YAML documents>
//	    replaces the cluster
//	expected node=N [zone=Z]
//	    what node N should have; zone overrides its Node's zone label
//	diff node=N [zone=Z]
//	<frontend endpoint…, one line per frontend, e.g. 198.19.0.1:80/TCP 198.18.128.3:80>
//	    the findings for a node whose rules route so (iptables mode)
func TestExpectedScripts(t *testing.T) {
	datadriven.Walk(t, "testdata/expected", func(t *testing.T, path string) {
		var st *audit.State
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "objects":
				var err error
				if st, err = stateFromYAML(d.Input); err != nil {
					t.Fatalf("%s: %v", d.Pos, err)
				}
				return ""
			case "expected":
				return expectedText(st, audit.ExpectedFor(st, nodeArg(t, st, d)))
			case "diff":
				return diffText(t, st, nodeArg(t, st, d), d.Input)
			}
			t.Fatalf("%s: unknown command %q", d.Pos, d.Cmd)
			return ""
		})
	})
}

// nodeArg is the command's node=N, with zone=Z (when given) overriding its
// Node's zone label in st.
func nodeArg(t *testing.T, st *audit.State, d *datadriven.TestData) string {
	node := arg(t, d, "node")
	if zone, ok := d.Arg("zone"); ok {
		info := st.Nodes[node]
		info.Zone = zone.SingleVal(t)
		st.Nodes[node] = info
	}
	return node
}

// stateFromYAML reduces YAML documents to a State, as the aggregator does
// with its informers' objects.
func stateFromYAML(in string) (*audit.State, error) {
	var svcs []corev1.Service
	var slices []discoveryv1.EndpointSlice
	var nodes []corev1.Node
	for i, doc := range strings.Split(in, "\n---\n") {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
			return nil, fmt.Errorf("document %d: %v", i+1, err)
		}
		var err error
		switch meta.Kind {
		case "Service":
			var s corev1.Service
			err = yaml.UnmarshalStrict([]byte(doc), &s)
			svcs = append(svcs, s)
		case "EndpointSlice":
			var s discoveryv1.EndpointSlice
			err = yaml.UnmarshalStrict([]byte(doc), &s)
			slices = append(slices, s)
		case "Node":
			var n corev1.Node
			err = yaml.UnmarshalStrict([]byte(doc), &n)
			nodes = append(nodes, n)
		default:
			err = fmt.Errorf("kind %q: want Service, EndpointSlice or Node", meta.Kind)
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %v", i+1, err)
		}
	}
	return audit.FromAPI(svcs, slices, nodes), nil
}

func expectedText(st *audit.State, exp audit.Expected) string {
	var b strings.Builder
	for _, s := range st.Services {
		if s.Skip != "" {
			fmt.Fprintf(&b, "%s/%s: no rules (%s)\n", s.Namespace, s.Name, s.Skip)
		}
	}
	for _, p := range exp.Ports {
		fmt.Fprintf(&b, "%s %s IPv%d", p.Name, p.Protocol, p.Family)
		if p.Affinity {
			b.WriteString(" affinity")
		}
		b.WriteString("\n")
		for _, fe := range p.Frontends {
			key := netip.AddrPortFrom(fe.IP, fe.Port).String()
			if fe.NodePort {
				key = fmt.Sprintf("*:%d", fe.Port)
			}
			fmt.Fprintf(&b, "  %s %s/%s → %s\n", fe.Kind, key, fe.Protocol, fe.Scope)
		}
		for _, scope := range []audit.Scope{audit.ScopeCluster, audit.ScopeLocal} {
			eps, used := p.Endpoints[scope]
			if !used {
				continue
			}
			list := "none"
			if len(eps) > 0 {
				s := make([]string, len(eps))
				for i, e := range eps {
					s[i] = e.String()
				}
				list = strings.Join(s, " ")
			}
			fmt.Fprintf(&b, "  %s endpoints: %s\n", scope, list)
		}
		if p.NoTopology != nil {
			s := make([]string, len(p.NoTopology))
			for i, e := range p.NoTopology {
				s[i] = e.String()
			}
			fmt.Fprintf(&b, "  without hints (accepted too): %s\n", strings.Join(s, " "))
		}
	}
	if b.Len() == 0 {
		return "nothing\n"
	}
	return b.String()
}

// diffText is the findings for node with the given frontends, one line
// per finding, or "in sync".
func diffText(t *testing.T, st *audit.State, node, in string) string {
	t.Helper()
	obs := &audit.Observed{Mode: audit.ModeIPTables, Families: []int{4}}
	for _, line := range strings.Split(strings.TrimSpace(in), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		addr, proto, _ := strings.Cut(f[0], "/")
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			t.Fatalf("frontend %q: %v", f[0], err)
		}
		of := audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: ap.Addr(), Protocol: proto, Port: ap.Port()}, Scope: audit.ScopeCluster, Chain: "KUBE-SVC-TEST"}
		for _, e := range f[1:] {
			ep, err := netip.ParseAddrPort(e)
			if err != nil {
				t.Fatalf("endpoint %q: %v", e, err)
			}
			of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: ep, Weight: -1})
		}
		obs.Frontends = append(obs.Frontends, of)
	}
	fs := audit.Diff(audit.ExpectedFor(st, node), obs)
	if len(fs) == 0 {
		return "in sync\n"
	}
	var b strings.Builder
	for _, f := range fs {
		fmt.Fprintf(&b, "%s %s %s\n", f.Kind, f.Service, f.Endpoint)
	}
	return b.String()
}
