package nftables_test

import (
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/dataplane/nftables"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

func FuzzParseNFTables(f *testing.F) {
	readertest.Seeds(f, "../../audit/testdata/capture/clean/nft-*.rules", `{"nftables": []}`, `{"nftables": [{"map": {"family": "ip", "table": "kube-proxy", "name": "service-ips", "elem": [[{"concat": ["1.2.3.4", "tcp", 80]}, {"goto": {"target": "service-X"}}]]}}]}`)
	f.Add(readertest.SharedChainNFT(1000))
	readertest.Fuzz(f, nftables.Parse)
}

// TestSharedPolicyChainsCostLinearMemory: n service-ips elements going to
// one service chain whose numgen map has n endpoints cost in proportion to
// the dump, not n².
func TestSharedPolicyChainsCostLinearMemory(t *testing.T) {
	readertest.LinearMemory(t, readertest.SharedChainNFT, nftables.Parse)
}

func TestParseNFTablesRejectsHostileJSON(t *testing.T) {
	for name, in := range map[string]string{
		"deep":      `{"nftables": ` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `}`,
		"truncated": `{"nftables": [{"table": {"family": "ip", "name": "kube-proxy"`,
		"trailing":  `{"nftables": []} {"nftables": []}`,
		"no array":  `{"other": 1}`,
		"garbage":   `{"nftables": [tru]}`,
	} {
		if _, err := nftables.Parse(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error", name)
		} else if !strings.Contains(err.Error(), "nft") {
			t.Errorf("%s: error does not say what was expected: %v", name, err)
		}
	}
}
