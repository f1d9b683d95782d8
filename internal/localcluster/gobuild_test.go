package localcluster

import (
	"os"
	"os/exec"
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
	if got := strings.Fields(string(line[1])); !sameSet(without(got, "env", "$(GO)", "build"), want) {
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

// The k8s tools and proxyaudit's binaries are built in two modules; a
// package they share (client-go and everything under it) is compiled once
// only when both select the same version of its module and of every module
// below it. This fails when an upgrade on one side left the other behind:
// raise the lower one (`go get MODULE@VERSION` there).
func TestToolsShareModuleVersions(t *testing.T) {
	if testing.Short() {
		t.Skip("lists the k8s tools' packages: needs their modules downloaded")
	}
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	tools := strings.Fields(regexp.MustCompile(`(?m)^tools="([^"]+)"`).FindStringSubmatch(mustRead(t, filepath.Join(root, "deploy/k8s-tools/build.sh")))[1])
	for i, tool := range tools {
		tools[i] = "./" + tool
	}
	mine := compiledModules(t, root, "./cmd/...")
	theirs := compiledModules(t, filepath.Join(root, "deploy/k8s-tools"), tools...)
	shared := 0
	for mod, v := range mine {
		w, ok := theirs[mod]
		if !ok {
			continue
		}
		shared++
		if v != w {
			t.Errorf("%s: proxyaudit builds %s, the k8s tools %s: its packages and every one above them are compiled twice", mod, v, w)
		}
	}
	if shared < 20 {
		t.Errorf("only %d modules in common: the listing is wrong", shared)
	}
}

func mustRead(t *testing.T, path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// compiledModules is module path → version of the packages a static build
// of pkgs compiles.
func compiledModules(t *testing.T, dir string, pkgs ...string) map[string]string {
	cmd := exec.Command("go", append([]string{"list", "-deps", "-f", "{{with .Module}}{{.Path}} {{.Version}}{{end}}"}, pkgs...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOFLAGS=-mod=mod")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list in %s: %v", dir, err)
	}
	mods := map[string]string{}
	for _, l := range strings.Split(string(out), "\n") {
		if path, v, ok := strings.Cut(l, " "); ok && v != "" {
			mods[path] = v
		}
	}
	return mods
}

// The oldest release the live suite installs on is the one the Makefile
// builds before the lanes (which have no network) and the chart's
// kubeVersion names: change one and this names the others.
func TestOldestKubernetesAgrees(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	mk := mustRead(t, filepath.Join(root, "Makefile"))
	if m := regexp.MustCompile(`(?m)^OLDEST_K8S = (\S+)$`).FindStringSubmatch(mk); m == nil || m[1] != OldestKubernetes {
		t.Errorf("Makefile's OLDEST_K8S %q, localcluster.OldestKubernetes %q", m, OldestKubernetes)
	}
	chartYAML := mustRead(t, filepath.Join(root, "charts/proxyaudit/Chart.yaml"))
	minor := strings.Join(strings.Split(strings.TrimPrefix(OldestKubernetes, "v"), ".")[:2], ".")
	if want := `kubeVersion: ">=` + minor + `.0-0"`; !strings.Contains(chartYAML, want) {
		t.Errorf("Chart.yaml should say %s (the oldest release the live suite installs on, %s)", want, OldestKubernetes)
	}
}
