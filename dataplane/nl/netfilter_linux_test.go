//go:build linux

package nl

import (
	"testing"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// Malformed kernel messages never panic, and reading what the notes read
// of one (a rule's table and chain) allocates in proportion to it; the
// decoders' own fuzzing is beside them.
func FuzzChainOf(f *testing.F) {
	f.Add(nltest.RuleMsg(unix.NFPROTO_IPV4, "kube-proxy", "services", nltest.Expr("lookup", nil)))
	f.Add([]byte{2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			RuleChainOf(data)
			ChainOf(data)
		})
		if limit := 64 + 2*float64(len(data)); allocs > limit {
			t.Fatalf("%d bytes read with %.0f allocations (limit %.0f)", len(data), allocs, limit)
		}
	})
}
