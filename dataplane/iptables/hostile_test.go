package iptables

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

// A dump whose frontends all jump to one long external chain (its jump to
// the service's policy chain first, then thousands of conditional rules)
// cost frontends × the chain's length: each frontend walked the chain
// backwards again (6.3 MB took 24 s). Each chain is followed once now.
func TestSharedExternalChainWalkedOnce(t *testing.T) {
	const frontends, length = 3000, 3000
	p := &parser{rules: map[chainKey][]iptRule{}}
	ext := []iptRule{{jump: "KUBE-SVC-AAAAAAAAAAAAAAAA"}}
	for range length {
		ext = append(ext, iptRule{jump: "KUBE-MARK-MASQ", cond: true})
	}
	p.rules[keyString("KUBE-EXT-AAAAAAAAAAAAAAAA")] = ext
	var svc []iptRule
	for i := range frontends {
		svc = append(svc, iptRule{dst: netip.AddrFrom4([4]byte{198, 19, byte(i >> 8), byte(i)}), proto: "TCP", dport: 80, hasDport: true,
			jump: "KUBE-EXT-AAAAAAAAAAAAAAAA"})
	}
	p.rules[keyServices] = svc
	out := p.frontTable(4)
	if len(out) != frontends {
		t.Fatalf("%d frontends, want %d", len(out), frontends)
	}
	for k, f := range out {
		if f.policy != "KUBE-SVC-AAAAAAAAAAAAAAAA" || f.scope != audit.ScopeCluster {
			t.Fatalf("%v reaches %+v", k, f)
		}
	}
	if p.walked > length+1 {
		t.Errorf("%d rules looked at for %d frontends of one %d-rule chain: want it walked once", p.walked, frontends, length+1)
	}
}

// hostileExtDump is iptables-save output of n frontends sharing one
// external chain of n rules; long puts the chain's jump to the policy
// chain first (walked to the end), else last (found at once).
func hostileExtDump(n int, long bool) []byte {
	var b bytes.Buffer
	b.WriteString("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-EXT-AAAAAAAAAAAAAAAA - [0:0]\n:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]\n")
	for i := range n {
		fmt.Fprintf(&b, "-A KUBE-SERVICES -d 198.19.%d.%d/32 -p tcp -m comment --comment \"ns/s%d:p external IP\" -m tcp --dport 80 -j KUBE-EXT-AAAAAAAAAAAAAAAA\n", i>>8&255, i&255, i)
	}
	jump := "-A KUBE-EXT-AAAAAAAAAAAAAAAA -j KUBE-SVC-AAAAAAAAAAAAAAAA\n"
	if long {
		b.WriteString(jump)
	}
	b.WriteString(strings.Repeat("-A KUBE-EXT-AAAAAAAAAAAAAAAA -s 10.0.0.0/8 -j KUBE-MARK-MASQ\n", n))
	if !long {
		b.WriteString(jump)
	}
	b.WriteString("COMMIT\n")
	return b.Bytes()
}

// BenchmarkSharedExternalChain parses the hostile dump beside one of the
// same size whose chain ends with its jump: the ratio is what the shared
// chain costs (docs/benchmarks.md).
func BenchmarkSharedExternalChain(b *testing.B) {
	for _, n := range []int{10000, 40000} {
		for _, long := range []bool{false, true} {
			dump := hostileExtDump(n, long)
			name := map[bool]string{false: "benign", true: "hostile"}[long]
			b.Run(fmt.Sprintf("%s-%dKB", name, len(dump)>>10), func(b *testing.B) {
				b.ReportAllocs()
				b.SetBytes(int64(len(dump)))
				for b.Loop() {
					if _, err := Parse(bytes.NewReader(dump)); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
