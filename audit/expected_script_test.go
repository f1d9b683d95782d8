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
				node := arg(t, d, "node")
				if zone, ok := d.Arg("zone"); ok {
					info := st.Nodes[node]
					info.Zone = zone.SingleVal(t)
					st.Nodes[node] = info
				}
				return expectedText(st, audit.ExpectedFor(st, node))
			}
			t.Fatalf("%s: unknown command %q", d.Pos, d.Cmd)
			return ""
		})
	})
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
	}
	if b.Len() == 0 {
		return "nothing\n"
	}
	return b.String()
}
