package chart_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The modules the chart's end-to-end tests read CRDs from are the ones
// make cluster-binaries downloads before the lanes, which have no network:
// a module the Makefile does not list passed only where the module cache
// already held it (a fresh machine's first run failed on it).
func TestCRDModulesFetchedBeforeTheLanes(t *testing.T) {
	mk, err := os.ReadFile(filepath.Join(root(t), "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^CHART_CRD_MODULES = (.+)$`).FindSubmatch(mk)
	if m == nil {
		t.Fatal("the Makefile has no CHART_CRD_MODULES line")
	}
	listed := strings.Fields(string(m[1]))
	for _, mod := range []string{prometheusOperator, reportsAPI} {
		found := false
		for _, l := range listed {
			found = found || l == mod
		}
		if !found {
			t.Errorf("the chart's tests read %s, which the Makefile's CHART_CRD_MODULES (%s) does not download", mod, m[1])
		}
	}
}
