package audit_test

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// FuzzParseClusterList: malformed cluster dumps give errors, never panics,
// and reading one and building every node's expected model costs its size
// plus what kube-proxy would program for it: readertest.AllocPerByte per input byte and
// allocPerRule per endpoint rule (State.ServiceEndpoints, each slice's ports
// × endpoints, which a Service of n ports and n endpoints makes n²; `diff`
// refuses more than 2,000,000 of them before building anything).
func FuzzParseClusterList(f *testing.F) {
	if data, err := os.ReadFile("testdata/capture/clean/cluster.json"); err == nil {
		f.Add(data)
	}
	f.Add([]byte(`{"kind":"List","items":[{"kind":"Service"}]}`))
	f.Add(squareCluster(40))
	f.Fuzz(func(t *testing.T, data []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		st, err := audit.ParseClusterList(data)
		if err != nil {
			return
		}
		rules := st.ServiceEndpoints()
		if rules > 1<<20 {
			return // refused by its callers before a model is built
		}
		for n := range st.Nodes {
			_ = audit.ExpectedFor(st, n)
		}
		took := time.Since(start)
		runtime.ReadMemStats(&after)
		nodes := uint64(max(len(st.Nodes), 1))
		bound := readertest.AllocBase + readertest.AllocPerByte*uint64(len(data)) + nodes*allocPerRule*uint64(rules)
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > bound {
			t.Errorf("%d input bytes with %d endpoint rules on %d node(s) allocated %d bytes; the bound is %d", len(data), rules, nodes, alloc, bound)
		}
		if took > readertest.TimeBase+readertest.TimePerByte*time.Duration(len(data))+time.Duration(nodes*uint64(rules))*timePerRule {
			t.Errorf("%d input bytes with %d endpoint rules on %d node(s) took %s", len(data), rules, nodes, took)
		}
	})
}

// What an endpoint rule may cost in an expected model (~90 bytes measured;
// ~520 when the model was built through a map per port).
const (
	allocPerRule = 256
	timePerRule  = 10 * time.Microsecond
)

// squareCluster is one Service of n ports and one EndpointSlice of n ports
// and n endpoints on one node: n² endpoint rules.
func squareCluster(n int) []byte {
	var b strings.Builder
	b.WriteString(`{"kind":"List","items":[{"kind":"Node","metadata":{"name":"n1"}},{"kind":"Service","metadata":{"name":"s","namespace":"d"},"spec":{"type":"NodePort","clusterIP":"198.19.0.5","clusterIPs":["198.19.0.5"],"ports":[`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"name":"p%d","port":%d,"nodePort":%d}`, i, 1000+i, 30000+i)
	}
	b.WriteString(`]}},{"kind":"EndpointSlice","metadata":{"name":"s-1","namespace":"d","labels":{"kubernetes.io/service-name":"s"}},"addressType":"IPv4","ports":[`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"name":"p%d","port":%d,"protocol":"TCP"}`, i, 1000+i)
	}
	b.WriteString(`],"endpoints":[`)
	for i := range n {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, `{"addresses":["198.18.%d.%d"],"conditions":{"ready":true},"nodeName":"n1"}`, i/250, i%250+1)
	}
	b.WriteString(`]}]}`)
	return []byte(b.String())
}

// The bound above holds for the square at a size the fuzzer rarely reaches.
func TestSquareClusterWithinFuzzBound(t *testing.T) {
	for _, n := range []int{40, 400} {
		data := squareCluster(n)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		st, err := audit.ParseClusterList(data)
		if err != nil {
			t.Fatal(err)
		}
		exp := audit.ExpectedFor(st, "n1")
		runtime.ReadMemStats(&after)
		rules := st.ServiceEndpoints()
		if rules != n*n || len(exp.Ports) != n {
			t.Fatalf("n=%d: %d rules, %d ports", n, rules, len(exp.Ports))
		}
		alloc := after.TotalAlloc - before.TotalAlloc
		if bound := readertest.AllocBase + readertest.AllocPerByte*uint64(len(data)) + allocPerRule*uint64(rules); alloc > bound {
			t.Errorf("n=%d: %d bytes allocated, bound %d", n, alloc, bound)
		}
		t.Logf("n=%d: %d input bytes, %d rules, %d bytes allocated (%d per rule)", n, len(data), rules, alloc, alloc/uint64(rules))
	}
}
