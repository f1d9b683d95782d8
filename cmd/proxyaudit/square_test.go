package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// portsTimesEndpoints writes a cluster with one Service of n ports and one
// EndpointSlice of n ports and n endpoints (n² rules for kube-proxy), and a
// node's iptables-save that has the n frontends but none of the
// endpoints: every pair is a finding.
func portsTimesEndpoints(t testing.TB, n int) (cluster, rules string) {
	var b strings.Builder
	b.WriteString(`{"kind":"List","apiVersion":"v1","items":[{"kind":"Node","metadata":{"name":"n1"}},`)
	b.WriteString(`{"kind":"Service","metadata":{"name":"s","namespace":"d"},"spec":{"clusterIP":"198.19.0.5","clusterIPs":["198.19.0.5"],"ports":[`)
	for i := range n {
		fmt.Fprintf(&b, `%s{"name":"p%d","port":%d,"protocol":"TCP","targetPort":%d}`, comma(i), i, 1000+i, 1000+i)
	}
	b.WriteString(`]}},{"kind":"EndpointSlice","metadata":{"name":"s-1","namespace":"d","labels":{"kubernetes.io/service-name":"s"}},"addressType":"IPv4","ports":[`)
	for i := range n {
		fmt.Fprintf(&b, `%s{"name":"p%d","port":%d,"protocol":"TCP"}`, comma(i), i, 1000+i)
	}
	b.WriteString(`],"endpoints":[`)
	for i := range n {
		fmt.Fprintf(&b, `%s{"addresses":["198.18.%d.%d"],"conditions":{"ready":true}}`, comma(i), i/250, i%250+1)
	}
	b.WriteString(`]}]}`)
	var r strings.Builder
	r.WriteString("*nat\n:KUBE-SERVICES - [0:0]\n")
	for i := range n {
		fmt.Fprintf(&r, ":KUBE-SVC-P%06d - [0:0]\n", i)
	}
	for i := range n {
		fmt.Fprintf(&r, "-A KUBE-SERVICES -d 198.19.0.5/32 -p tcp -m comment --comment \"d/s:p%d cluster IP\" -m tcp --dport %d -j KUBE-SVC-P%06d\n", i, 1000+i, i)
	}
	r.WriteString("COMMIT\n")
	dir := t.TempDir()
	cluster, rules = filepath.Join(dir, "cluster.json"), filepath.Join(dir, "n1.rules")
	if err := os.WriteFile(cluster, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rules, []byte(r.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return cluster, rules
}

func comma(i int) string {
	if i == 0 {
		return ""
	}
	return ","
}

// allocated is the bytes f allocates.
func allocated(f func()) uint64 {
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&m0)
	f()
	runtime.ReadMemStats(&m1)
	return m1.TotalAlloc - m0.TotalAlloc
}

// A Service with n ports and n endpoints is n² rules for kube-proxy and n²
// findings on a node that has none of them (issue #38: 113 KB of input cost
// 654 MB and 4.7 s, 468 KB cost 11 GB). The table lists at most
// maxGroupRows of one kind per service port, the work per pair is bounded,
// and a cluster file asking for more than maxServiceEndpoints is refused
// before the expected model is built.
func TestDiffOfPortsTimesEndpoints(t *testing.T) {
	const n = 300
	cluster, rules := portsTimesEndpoints(t, n)
	var out, errb bytes.Buffer
	code := 0
	alloc := allocated(func() { code = run([]string{"diff", "--cluster", cluster, "--rules", "n1=" + rules}, &out, &errb) })
	if code != exitFindings {
		t.Fatalf("exit %d, want %d; stderr: %s", code, exitFindings, errb.String())
	}
	if !strings.Contains(out.String(), fmt.Sprintf("%d finding(s)", n*n)) {
		t.Errorf("the table does not count the %d findings:\n%.2000s", n*n, out.String())
	}
	if lines := strings.Count(out.String(), "\n"); lines > n*(maxGroupRows+1)+10 {
		t.Errorf("the table has %d lines for %d service ports: want at most %d per port", lines, n, maxGroupRows+1)
	}
	if !strings.Contains(out.String(), fmt.Sprintf("(%d more)", n-maxGroupRows)) {
		t.Errorf("the table does not say how many it left out:\n%.3000s", out.String())
	}
	// 4.9 KB a pair before; ~1.8 KB after (docs/benchmarks.md).
	if per := alloc / (n * n); per > 2500 {
		t.Errorf("diff allocated %d bytes per service endpoint (%d MB): want at most 2500", per, alloc>>20)
	}
	t.Logf("%d×%d: %d MB allocated, %d bytes a pair, %d table lines", n, n, alloc>>20, alloc/(n*n), strings.Count(out.String(), "\n"))

	out.Reset()
	if code := run([]string{"diff", "--cluster", cluster, "--rules", "n1=" + rules, "-o", "json"}, &out, io.Discard); code != exitFindings {
		t.Fatalf("json: exit %d", code)
	}
	var rep struct{ Findings []json.RawMessage }
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil || len(rep.Findings) != n*n {
		t.Errorf("-o json lists %d findings (%v), want every one of %d", len(rep.Findings), err, n*n)
	}

	// Past the bound: refused with what to do, at the cost of reading the file.
	big, bigRules := portsTimesEndpoints(t, 1500)
	errb.Reset()
	alloc = allocated(func() { code = run([]string{"diff", "--cluster", big, "--rules", "n1=" + bigRules}, io.Discard, &errb) })
	if code != exitUsage || !strings.Contains(errb.String(), "2250000 endpoint rules") || !strings.Contains(errb.String(), "-n NAMESPACE") {
		t.Errorf("1500 ports × 1500 endpoints: exit %d, stderr %q; want refused, saying how many and what to do", code, errb.String())
	}
	if alloc > 64<<20 {
		t.Errorf("refusing 1500×1500 allocated %d MB: it should cost the file's parse, not the model's", alloc>>20)
	}
}
