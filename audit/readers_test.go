package audit

import (
	"strings"
	"testing"
)

func TestParseNFTablesRejectsHostileJSON(t *testing.T) {
	for name, in := range map[string]string{
		"deep":      `{"nftables": ` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `}`,
		"truncated": `{"nftables": [{"table": {"family": "ip", "name": "kube-proxy"`,
		"trailing":  `{"nftables": []} {"nftables": []}`,
		"no array":  `{"other": 1}`,
		"garbage":   `{"nftables": [tru]}`,
	} {
		if _, err := ParseNFTables(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error", name)
		} else if !strings.Contains(err.Error(), "nft") {
			t.Errorf("%s: error does not say what was expected: %v", name, err)
		}
	}
}
