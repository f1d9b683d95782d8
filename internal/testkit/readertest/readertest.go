// Package readertest holds what the tests of every dataplane reader share: a
// captured cluster read back, findings compared with the golden file
// beside the capture (rewritten when the test binary's -update is set), and
// the fuzz target's check that a hostile dump costs what its size allows.
package readertest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Cluster reads dir/cluster.json, a capture's `kubectl get -o json` list of
// Services, EndpointSlices and Nodes.
func Cluster(t testing.TB, dir string) *audit.State {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "cluster.json"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(data)
	if err != nil {
		t.Fatalf("%s: %v", dir, err)
	}
	return st
}

// Match compares fs, as indented JSON, with the file at path; with update
// it writes them there instead. A nil list is written as [].
func Match(t testing.TB, path string, fs []audit.Finding, update bool) {
	t.Helper()
	if fs == nil {
		fs = []audit.Finding{}
	}
	got, _ := json.MarshalIndent(fs, "", "  ")
	got = append(got, '\n')
	if update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run the test with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("findings differ from %s (review, then run the test with -update):\n got: %s", path, got)
	}
}

// Reading and diffing a dump may allocate at most AllocPerByte per input
// byte plus AllocBase, and take at most TimePerByte per byte plus TimeBase:
// what a hostile dump costs follows its size (the captures allocate 10-40
// bytes per byte). The time bound is loose: fuzzing machines are shared, it
// catches blowups, not slowness.
const (
	AllocPerByte = 200
	AllocBase    = 4 << 20
	TimePerByte  = 20 * time.Microsecond
	TimeBase     = 2 * time.Second
)

// Fuzz checks one reader: no panic, an error or a model whose frontends
// are sorted and unique, a diff that does not panic either, and both within
// their allocation and time bounds.
func Fuzz(f *testing.F, parse func(io.Reader) (*audit.Observed, error)) {
	st := &audit.State{Nodes: map[string]audit.NodeInfo{}}
	f.Fuzz(func(t *testing.T, data []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		defer func() {
			took := time.Since(start)
			runtime.ReadMemStats(&after)
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > AllocBase+AllocPerByte*uint64(len(data)) {
				t.Errorf("%d input bytes allocated %d bytes (%d per byte; the bound is %d per byte)", len(data), alloc, alloc/uint64(max(len(data), 1)), AllocPerByte)
			}
			if took > TimeBase+TimePerByte*time.Duration(len(data)) {
				t.Errorf("%d input bytes took %s", len(data), took)
			}
		}()
		obs, err := parse(bytes.NewReader(data))
		if err != nil {
			if obs != nil {
				t.Fatal("a model returned with an error")
			}
			return
		}
		for i := 1; i < len(obs.Frontends); i++ {
			if obs.Frontends[i-1].FrontendKey.Compare(obs.Frontends[i].FrontendKey) >= 0 {
				t.Fatalf("frontends not sorted and unique at %d", i)
			}
		}
		_ = audit.Diff(audit.ExpectedFor(st, "n"), obs)
	})
}

// Seeds adds the files matching glob to f's corpus, whole and cut down to
// their first lines (small inputs keep the fuzzer fast), and extra.
func Seeds(f *testing.F, glob string, extra ...string) {
	paths, _ := filepath.Glob(glob)
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		f.Add(data)
		if len(data) > 2048 {
			cut := data[:2048]
			if i := bytes.LastIndexByte(cut, '\n'); i > 0 {
				cut = cut[:i+1]
			}
			f.Add(cut)
		}
	}
	for _, e := range extra {
		f.Add([]byte(e))
	}
}

// SharedChainIPTables is a hostile iptables-save: n frontends that all
// jump to one KUBE-SVC chain of n endpoints. kube-proxy writes a few
// frontends per policy chain (cluster IP, node port, external and
// load-balancer IPs); a dump that points thousands at one must not cost
// thousands of copies of its endpoints.
func SharedChainIPTables(n int) []byte {
	var b bytes.Buffer
	b.WriteString("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-SHAREDSHAREDSHA - [0:0]\n")
	for i := range n {
		fmt.Fprintf(&b, "-A KUBE-SERVICES -d 198.19.%d.%d/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-SHAREDSHAREDSHA\n", i>>8&255, i&255)
	}
	for i := range n {
		fmt.Fprintf(&b, "-A KUBE-SVC-SHAREDSHAREDSHA -m statistic --mode random --probability 0.5 -j KUBE-SEP-%016d\n", i)
		fmt.Fprintf(&b, "-A KUBE-SEP-%016d -p tcp -m tcp -j DNAT --to-destination 198.18.%d.%d:8080\n", i, i>>8&255, i&255)
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// SharedChainNFT is the same in nftables mode: n service-ips elements
// going to one service chain whose numgen map has n endpoints.
func SharedChainNFT(n int) []byte {
	var elems, dnat []any
	for i := range n {
		elems = append(elems, []any{map[string]any{"concat": []any{fmt.Sprintf("198.19.%d.%d", i>>8&255, i&255), "tcp", 80}},
			map[string]any{"goto": map[string]any{"target": "service-SHARED-x/y/tcp/"}}})
		dnat = append(dnat, []any{i, map[string]any{"concat": []any{fmt.Sprintf("198.18.%d.%d", i>>8&255, i&255), 8080}}})
	}
	doc := map[string]any{"nftables": []any{
		map[string]any{"table": map[string]any{"family": "ip", "name": "kube-proxy"}},
		map[string]any{"map": map[string]any{"family": "ip", "table": "kube-proxy", "name": "service-ips", "type": []any{"ipv4_addr", "inet_proto", "inet_service"}, "map": "verdict", "elem": elems}},
		map[string]any{"rule": map[string]any{"family": "ip", "table": "kube-proxy", "chain": "services", "expr": []any{
			map[string]any{"vmap": map[string]any{"key": "k", "data": "@service-ips"}}}}},
		map[string]any{"rule": map[string]any{"family": "ip", "table": "kube-proxy", "chain": "service-SHARED-x/y/tcp/", "expr": []any{
			map[string]any{"dnat": map[string]any{"family": "ip", "addr": map[string]any{"map": map[string]any{
				"key": map[string]any{"numgen": map[string]any{"mode": "random", "mod": n, "offset": 0}}, "data": map[string]any{"set": dnat}}}}}}}},
	}}
	out, _ := json.Marshal(doc)
	return out
}

// SharedChainCluster is one service whose cluster IP and external IPs are
// the hostile dumps' n frontends, with one endpoint.
func SharedChainCluster(t testing.TB, n int) []byte {
	t.Helper()
	var ext []string
	for i := 1; i < n; i++ {
		ext = append(ext, fmt.Sprintf("198.19.%d.%d", i>>8&255, i&255))
	}
	list := map[string]any{"kind": "List", "items": []any{
		map[string]any{"kind": "Node", "metadata": map[string]any{"name": "n"}},
		map[string]any{"kind": "Service", "metadata": map[string]any{"namespace": "x", "name": "y"},
			"spec": map[string]any{"type": "ClusterIP", "clusterIP": "198.19.0.0", "clusterIPs": []string{"198.19.0.0"}, "externalIPs": ext,
				"ports": []any{map[string]any{"port": 80, "protocol": "TCP", "targetPort": 8080}}}},
		map[string]any{"kind": "EndpointSlice", "metadata": map[string]any{"namespace": "x", "name": "y-1", "labels": map[string]string{"kubernetes.io/service-name": "y"}},
			"addressType": "IPv4", "endpoints": []any{map[string]any{"addresses": []string{"198.18.0.0"}, "conditions": map[string]any{"ready": true}}},
			"ports": []any{map[string]any{"port": 8080, "protocol": "TCP"}}},
	}}
	out, err := json.Marshal(list)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// allocated is what parse allocates on data, in bytes.
func allocated(data []byte, parse func(io.Reader) (*audit.Observed, error)) (uint64, *audit.Observed, error) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	obs, err := parse(bytes.NewReader(data))
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc, obs, err
}

// LinearMemory: doubling a dump of n frontends sharing one policy chain of
// n endpoints (dump(n): SharedChainIPTables, SharedChainNFT) doubles what
// reading and diffing it allocate, not quadruples it (before: 71, 142 and
// 284 KB of iptables-save allocated 27, 101 and 405 MB).
func LinearMemory(t *testing.T, dump func(int) []byte, parse func(io.Reader) (*audit.Observed, error)) {
	var prev float64
	for _, n := range []int{500, 1000, 2000} {
		// The frontends are one service's cluster IP and external
		// IPs, with one endpoint: the first is kept, the rest stale.
		st, err := audit.ParseClusterList(SharedChainCluster(t, n))
		if err != nil {
			t.Fatal(err)
		}
		data := dump(n)
		alloc, obs, err := allocated(data, parse)
		if err != nil {
			t.Fatal(err)
		}
		if len(obs.Frontends) != n || len(obs.Frontends[n-1].Endpoints) != n {
			t.Fatalf("%d frontends, the last with %d endpoints; want %d and %d", len(obs.Frontends), len(obs.Frontends[n-1].Endpoints), n, n)
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		fs := audit.Diff(audit.ExpectedFor(st, "n"), obs)
		if len(fs) != n-1 {
			t.Fatalf("%d findings, want %d stale endpoints", len(fs), n-1)
		}
		runtime.ReadMemStats(&after)
		diffAlloc := after.TotalAlloc - before.TotalAlloc
		perByte := float64(alloc+diffAlloc) / float64(len(data))
		t.Logf("%d frontends × %d endpoints: %d KB dump, read %.1f MB, diff %.1f MB (%d findings), %.0f bytes per input byte",
			n, n, len(data)>>10, float64(alloc)/(1<<20), float64(diffAlloc)/(1<<20), len(fs), perByte)
		if prev > 0 && perByte > 1.5*prev {
			t.Errorf("allocation per input byte grew from %.0f to %.0f when the dump doubled: quadratic", prev, perByte)
		}
		prev = perByte
	}
}

// Apply applies one round of changes to a model, as the collector applies
// them to the state it streams.
func Apply(o *audit.Observed, changed []audit.ObservedFrontend, removed []audit.FrontendKey) *audit.Observed {
	next := map[audit.FrontendKey]audit.ObservedFrontend{}
	for _, f := range o.Frontends {
		next[f.FrontendKey] = f
	}
	for _, k := range removed {
		delete(next, k)
	}
	for _, f := range changed {
		next[f.FrontendKey] = f
	}
	out := &audit.Observed{Mode: o.Mode, Families: o.Families}
	for _, f := range next {
		out.Frontends = append(out.Frontends, f)
	}
	slices.SortFunc(out.Frontends, func(a, b audit.ObservedFrontend) int { return a.FrontendKey.Compare(b.FrontendKey) })
	out.NoRules = len(out.Frontends) == 0
	return out
}
