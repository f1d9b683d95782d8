package release

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/chart"
)

// TestReleaseEndToEnd makes one release twice from this checkout (the CLI
// and servers for linux/amd64 only: `make release` builds every platform)
// and checks what a user meets: the same bytes both times, checksums that
// `sha256sum -c` accepts, binaries that say their version and commit, a
// chart package helm reads with the version's image, and the krew manifest
// installed by krew itself into a krew root of the test's own, after which
// `kubectl-proxyaudit version` runs from krew's bin directory.
func TestReleaseEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the release: make test's end-to-end stage runs it")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	root, _ := filepath.Abs("../..")
	cl := filepath.Join(t.TempDir(), "CHANGELOG.md")
	if err := os.WriteFile(cl, []byte("# Changelog\n\n## [Unreleased]\n\n## [0.1.0] - 2026-12-02\n\nFirst release.\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	platforms := []Platform{{"linux", "amd64"}}
	make := func() string {
		out := filepath.Join(t.TempDir(), "dist")
		start := time.Now()
		arts, err := Run(ctx, Config{Root: root, Version: "v0.1.0", Out: out, Changelog: cl, CLI: platforms, Servers: platforms,
			URLBase: "https://example.invalid/v0.1.0"})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("release in %s: %d files", time.Since(start).Round(time.Millisecond), len(arts))
		return out
	}
	a, b := make(), make()
	want := []string{"checksums.txt", "krew/proxyaudit.yaml", "proxyaudit-0.1.0.tgz", "proxyaudit-aggregator_0.1.0_linux_amd64",
		"proxyaudit-collector_0.1.0_linux_amd64", "proxyaudit_0.1.0_linux_amd64.tar.gz"}
	for _, name := range want {
		x, err := os.ReadFile(filepath.Join(a, name))
		if err != nil {
			t.Fatal(err)
		}
		y, err := os.ReadFile(filepath.Join(b, name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(x, y) {
			t.Errorf("%s differs between two releases of one commit", name)
		}
	}
	run := func(dir string, env []string, name string, args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := run(a, nil, "sha256sum", "-c", "checksums.txt"); strings.Count(out, ": OK") != len(want)-1 {
		t.Errorf("sha256sum -c:\n%s", out)
	}
	commit := strings.TrimSpace(run(root, nil, "git", "rev-parse", "HEAD"))
	for _, e := range untar(t, mustRead(t, filepath.Join(a, "proxyaudit_0.1.0_linux_amd64.tar.gz"))) {
		if e.Name == "proxyaudit" {
			p := filepath.Join(t.TempDir(), "proxyaudit")
			os.WriteFile(p, e.data, 0o755)
			if out := run("", nil, p, "version"); !strings.HasPrefix(out, "proxyaudit v0.1.0 (commit "+commit) {
				t.Errorf("the archive's CLI says %q", out)
			}
		}
	}
	if out := run("", nil, filepath.Join(a, "proxyaudit-collector_0.1.0_linux_amd64"), "--version"); !strings.HasPrefix(out, "proxyaudit-collector v0.1.0 (commit "+commit) {
		t.Errorf("the collector says %q", out)
	}
	if out := run("", nil, filepath.Join(a, "proxyaudit-aggregator_0.1.0_linux_amd64"), "--version"); !strings.HasPrefix(out, "proxyaudit-aggregator v0.1.0 (commit "+commit) {
		t.Errorf("the aggregator says %q", out)
	}

	helm, err := chart.Helm(root)
	if err != nil {
		t.Fatal(err)
	}
	pkg := filepath.Join(a, "proxyaudit-0.1.0.tgz")
	if out := run("", nil, helm, "show", "chart", pkg); !strings.Contains(out, "\nversion: 0.1.0\n") || !strings.Contains(out, "appVersion: 0.1.0") {
		t.Errorf("helm show chart:\n%s", out)
	}
	run("", nil, helm, "lint", pkg)
	if out := run("", nil, helm, "template", "proxyaudit", pkg, "--namespace", "proxyaudit"); !strings.Contains(out, "image: ghcr.io/proxyaudit/proxyaudit:0.1.0") {
		t.Errorf("the packaged chart does not run the version's image")
	}

	krew := strings.TrimSpace(run(root, nil, filepath.Join(root, "deploy/k8s-tools/krew.sh")))
	krewRoot := t.TempDir()
	env := []string{"KREW_ROOT=" + krewRoot, "KREW_NO_UPGRADE_CHECK=1", "HOME=" + t.TempDir()}
	run("", env, krew, "install", "--manifest", filepath.Join(a, "krew/proxyaudit.yaml"), "--archive", filepath.Join(a, "proxyaudit_0.1.0_linux_amd64.tar.gz"))
	if out := run("", env, filepath.Join(krewRoot, "bin", "kubectl-proxyaudit"), "version"); !strings.HasPrefix(out, "proxyaudit v0.1.0 ") {
		t.Errorf("kubectl-proxyaudit installed by krew says %q", out)
	}
	// krew refuses an archive that is not the one the manifest names.
	other := filepath.Join(t.TempDir(), "other.tar.gz")
	os.WriteFile(other, mustRead(t, pkg), 0o644)
	cmd := exec.CommandContext(ctx, krew, "install", "--manifest", filepath.Join(a, "krew/proxyaudit.yaml"), "--archive", other)
	cmd.Env = append(os.Environ(), "KREW_ROOT="+t.TempDir(), "KREW_NO_UPGRADE_CHECK=1", "HOME="+t.TempDir())
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "checksum does not match") {
		t.Errorf("krew installed an archive the manifest does not name: %v\n%s", err, out)
	}
}

func mustRead(t testing.TB, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
