package localcluster

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// EnsureBinaries returns the directory with kube-apiserver, kube-proxy,
// etcd, kubectl and the node components, building them from the pinned tools module (deploy/k8s-tools) when the
// cache does not hold them yet. A cold build takes minutes; later calls reuse
// the cache.
func EnsureBinaries(ctx context.Context, logf func(string, ...any)) (string, error) {
	if dir := os.Getenv("PROXYAUDIT_K8S_BIN"); dir != "" {
		return dir, nil
	}
	if logf != nil {
		logf("ensuring cluster binaries with deploy/k8s-tools/build.sh")
	}
	return ensureTool(ctx, "build.sh")
}

// OldestKubernetes is the oldest release the chart supports (its
// kubeVersion), whose API server and kube-proxy the live suite installs and
// audits on beside the test cluster's own release.
const OldestKubernetes = "v1.33.5"

// ToolAt builds or reuses another release's kube-proxy or kube-apiserver
// (deploy/k8s-tools/tool-at.sh) and returns its path. Its build needs the
// module proxy: `make cluster-binaries` builds OldestKubernetes' before the
// suites run in lanes without a network.
func ToolAt(ctx context.Context, version, tool string) (string, error) {
	return ensureTool(ctx, "tool-at.sh", version, tool)
}

// ensureTool runs a build script in deploy/k8s-tools (which builds or
// reuses a cached binary) and returns the path it prints.
func ensureTool(ctx context.Context, script string, args ...string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	path := filepath.Join(root, "deploy", "k8s-tools", script)
	cmd := exec.CommandContext(ctx, path, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s: %w\n%s", path, err, tail(stderr.String(), 30))
	}
	return strings.TrimSpace(stdout.String()), nil
}

// RepoRoot finds the proxyaudit repository root from the working directory.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/proxyaudit/proxyaudit\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("cannot find the proxyaudit repository root (run from inside the repository)")
		}
		dir = parent
	}
}

func lookPath(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	// Root's sbin directories may be missing from PATH under some runners.
	for _, d := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in PATH", name)
}

func certPool(pem []byte) *x509.CertPool {
	p := x509.NewCertPool()
	p.AppendCertsFromPEM(pem)
	return p
}

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return tail(string(b), n)
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// BuildProxyaudit builds proxyaudit's three binaries (aggregator,
// collector, CLI) from this repository into dir, for end-to-end tests.
func BuildProxyaudit(dir string) error {
	root, err := RepoRoot()
	if err != nil {
		return err
	}
	if out, err := GoBuild(context.Background(), root, dir, "./cmd/proxyaudit-aggregator", "./cmd/proxyaudit-collector", "./cmd/proxyaudit").CombinedOutput(); err != nil {
		return fmt.Errorf("build proxyaudit: %v\n%s", err, out)
	}
	return nil
}

// GoBuildFlags are the flags every build of proxyaudit's binaries uses —
// `make build`, the images, the end-to-end tests' binaries — and the
// k8s tools' build too (deploy/k8s-tools/build.sh): static, with
// module-relative paths. The Go build cache keys a compiled package by its
// flags, so one set of flags compiles each package once and a later build
// only links (a cold `make demo` builds the images in seconds instead of
// compiling proxyaudit a second time).
var GoBuildFlags = []string{"-trimpath", "-buildvcs=false"}

// GoBuild returns `go build` of pkgs (run in dir, the module's root) into
// out with GoBuildFlags, CGO_ENABLED=0 and extra flags before the packages.
func GoBuild(ctx context.Context, dir, out string, pkgs ...string) *exec.Cmd {
	args := append([]string{"build"}, GoBuildFlags...)
	args = append(args, "-o", out)
	args = append(args, pkgs...)
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	return cmd
}
