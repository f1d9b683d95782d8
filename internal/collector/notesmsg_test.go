//go:build linux

package collector

import (
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// ruleMsg builds an NFT_MSG_NEWRULE body of kube-proxy's table.
func ruleMsg(chain string, exprs ...[]netlink.Attribute) []byte {
	return nltest.RuleMsg(unix.NFPROTO_IPV4, "kube-proxy", chain, exprs...)
}

// The message builders nf_tables decoders' tests share.
var (
	exprAttr    = nltest.Expr
	be32        = nltest.BE32
	verdictExpr = nltest.Verdict
)

// elemMsg builds an NFT_MSG_NEWSETELEM body of service-ips with one
// element.
func elemMsg(key []byte, chain string) []byte { return nltest.ElemMsg("service-ips", key, chain) }

// Malformed kernel messages never panic, and reading what the notes read
// of one (a rule's table and chain) allocates in proportion to it; the
// decoders' own fuzzing is in dataplane.
func FuzzNotesChainOf(f *testing.F) {
	f.Add(ruleMsg("services", exprAttr("lookup", nil)))
	f.Add([]byte{2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			nl.RuleChainOf(data)
			nl.ChainOf(data)
		})
		if limit := 64 + 2*float64(len(data)); allocs > limit {
			t.Fatalf("%d bytes read with %.0f allocations (limit %.0f)", len(data), allocs, limit)
		}
	})
}
