package localcluster

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// A package is compiled once for every build only while every build passes
// the same flags: `make build`, the images and the end-to-end tests'
// binaries (GoBuild), and the k8s tools (whose client-go the others reuse).
// This fails when one of them drifts from GoBuildFlags.
func TestEveryBuildSharesTheFlags(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	mk, err := os.ReadFile(filepath.Join(root, "Makefile"))
	if err != nil {
		t.Fatal(err)
	}
	line := regexp.MustCompile(`(?m)^GOBUILD :=(.*)$`).FindSubmatch(mk)
	if line == nil {
		t.Fatal("Makefile has no GOBUILD := line")
	}
	want := append([]string{"CGO_ENABLED=0"}, GoBuildFlags...)
	if got := strings.Fields(string(line[1])); !sameSet(without(got, "$(GO)", "build"), want) {
		t.Errorf("Makefile GOBUILD is %q; want the flags %q (localcluster.GoBuildFlags)", got, want)
	}
	sh, err := os.ReadFile(filepath.Join(root, "deploy/k8s-tools/build.sh"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"CGO_ENABLED=0", "-trimpath"} {
		if !strings.Contains(string(sh), f) {
			t.Errorf("deploy/k8s-tools/build.sh does not build with %s: proxyaudit's builds would compile client-go again", f)
		}
	}
	cmd := GoBuild(t.Context(), root, "out", "./cmd/proxyaudit")
	if !strings.Contains(strings.Join(cmd.Env, "\n"), "\nCGO_ENABLED=0") {
		t.Error("GoBuild does not set CGO_ENABLED=0")
	}
}

func without(s []string, drop ...string) []string {
	var out []string
	for _, x := range s {
		keep := true
		for _, d := range drop {
			keep = keep && x != d
		}
		if keep {
			out = append(out, x)
		}
	}
	return out
}

func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	seen := map[string]int{}
	for _, x := range a {
		seen[x]++
	}
	for _, x := range b {
		if seen[x] == 0 {
			return false
		}
		seen[x]--
	}
	return true
}
