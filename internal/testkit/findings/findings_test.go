package findings

import (
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

func TestHasOnlyDescribe(t *testing.T) {
	fs := []audit.TimedFinding{
		{Finding: audit.Finding{Node: "a", Kind: audit.StuckProxy}},
		{Finding: audit.Finding{Node: "b", Kind: audit.StaleEndpoint, Service: "ns/web", Endpoint: "198.18.1.1:80", Detail: "gone"}},
	}
	if !Has(fs, "a", audit.StuckProxy) || Has(fs, "a", audit.StaleEndpoint) || Has(fs, "c", audit.StuckProxy) {
		t.Error("Has")
	}
	if got := Only(fs, "b"); len(got) != 1 || got[0].Kind != audit.StaleEndpoint {
		t.Errorf("Only: %+v", got)
	}
	if d := Describe(fs); !strings.Contains(d, "  b StaleEndpoint ns/web 198.18.1.1:80 (gone)") || strings.Count(d, "\n") != 1 {
		t.Errorf("Describe:\n%s", d)
	}
	if Describe(nil) != "  (none)" {
		t.Errorf("Describe(nil) = %q", Describe(nil))
	}
}
