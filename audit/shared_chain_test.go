package audit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"testing"
)

// sharedChainIPTables is a hostile iptables-save: n frontends that all
// jump to one KUBE-SVC chain of n endpoints. kube-proxy writes a few
// frontends per policy chain (cluster IP, node port, external and
// load-balancer IPs); a dump that points thousands at one must not cost
// thousands of copies of its endpoints.
func sharedChainIPTables(n int) []byte {
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

// sharedChainNFT is the same in nftables mode: n service-ips elements
// going to one service chain whose numgen map has n endpoints.
func sharedChainNFT(n int) []byte {
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

// sharedChainCluster is one service whose cluster IP and external IPs are
// the hostile dumps' n frontends, with one endpoint.
func sharedChainCluster(t *testing.T, n int) []byte {
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
func allocated(data []byte, parse func(io.Reader) (*Observed, error)) (uint64, *Observed, error) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	obs, err := parse(bytes.NewReader(data))
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc, obs, err
}

// TestSharedPolicyChainsCostLinearMemory: doubling such a dump doubles
// what reading and diffing it allocate, not quadruples it (before: 71, 142
// and 284 KB of iptables-save allocated 27, 101 and 405 MB).
func TestSharedPolicyChainsCostLinearMemory(t *testing.T) {
	for _, tc := range []struct {
		name  string
		dump  func(int) []byte
		parse func(io.Reader) (*Observed, error)
	}{
		{"iptables", sharedChainIPTables, ParseIPTables},
		{"nftables", sharedChainNFT, ParseNFTables},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var prev float64
			for _, n := range []int{500, 1000, 2000} {
				// The frontends are one service's cluster IP and external
				// IPs, with one endpoint: the first is kept, the rest stale.
				st, err := ParseClusterList(sharedChainCluster(t, n))
				if err != nil {
					t.Fatal(err)
				}
				data := tc.dump(n)
				alloc, obs, err := allocated(data, tc.parse)
				if err != nil {
					t.Fatal(err)
				}
				if len(obs.Frontends) != n || len(obs.Frontends[n-1].Endpoints) != n {
					t.Fatalf("%d frontends, the last with %d endpoints; want %d and %d", len(obs.Frontends), len(obs.Frontends[n-1].Endpoints), n, n)
				}
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				fs := Diff(ExpectedFor(st, "n"), obs)
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
		})
	}
}
