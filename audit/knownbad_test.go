package audit_test

import (
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

func TestKnownBadKubeProxy(t *testing.T) {
	for v, bad := range map[string]bool{
		"v1.11.4": false, "v1.11.5": true, "v1.11.6": true, "v1.11.7": false,
		"v1.12.1": false, "v1.12.2": true, "v1.12.3-gke.1": true, "1.12.4+k3s1": true, "v1.12.5": false,
		"v1.13.0": true, "v1.13.1": true, "v1.13.2": false, "v1.36.3": false, "": false, "garbage": false, "v2.12.3": false,
	} {
		if got := audit.KnownBadKubeProxy(v) != ""; got != bad {
			t.Errorf("%q: bad %v, want %v", v, got, bad)
		}
	}
	// WarnKnownBad: testdata/judge/known-bad.txt.
}
