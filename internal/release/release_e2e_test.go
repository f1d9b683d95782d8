package release

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/image"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
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
	sbomTool := releaseTool(ctx, t, "cyclonedx-gomod")
	make := func() string {
		out := filepath.Join(t.TempDir(), "dist")
		start := time.Now()
		arts, err := Run(ctx, Config{Root: root, Version: "v0.1.0", Out: out, Changelog: cl, CLI: platforms, Servers: platforms, Image: os.Geteuid() == 0, SBOMTool: sbomTool,
			URLBase: "https://example.invalid/v0.1.0"})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("release in %s: %d files", time.Since(start).Round(time.Millisecond), len(arts))
		return out
	}
	a, b := make(), make()
	want := []string{"checksums.txt", "krew/proxyaudit.yaml", "image/index.json", "proxyaudit-0.1.0.tgz", "proxyaudit-aggregator_0.1.0_linux_amd64",
		"proxyaudit-collector_0.1.0_linux_amd64", "proxyaudit_0.1.0_linux_amd64.tar.gz",
		"proxyaudit_0.1.0_linux_amd64.cdx.json", "proxyaudit-collector_0.1.0_linux_amd64.cdx.json", "proxyaudit-aggregator_0.1.0_linux_amd64.cdx.json"}
	if os.Geteuid() == 0 {
		want = append(want, "image.txt", "proxyaudit-image_0.1.0_linux_amd64.cdx.json")
	}
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
	sums := strings.Count(string(mustRead(t, filepath.Join(a, "checksums.txt"))), "\n")
	if out := run(a, nil, "sha256sum", "-c", "checksums.txt"); strings.Count(out, ": OK") != sums || sums < len(want)-1 {
		t.Errorf("sha256sum -c:\n%s", out)
	}
	commit := strings.TrimSpace(run(root, nil, "git", "rev-parse", "HEAD"))
	// The SBOMs name what the binaries were built from: client-go at
	// go.mod's version in the CLI's, Debian's iptables in the image's.
	gomod := string(mustRead(t, filepath.Join(root, "go.mod")))
	_, rest, _ := strings.Cut(gomod, "\tk8s.io/client-go ")
	clientGo, _, _ := strings.Cut(rest, "\n")
	sboms := map[string]string{"proxyaudit_0.1.0_linux_amd64.cdx.json": `"purl": "pkg:golang/k8s.io/client-go@` + clientGo}
	if os.Geteuid() == 0 {
		sboms["proxyaudit-image_0.1.0_linux_amd64.cdx.json"] = `"purl": "pkg:deb/debian/iptables@`
		sboms["proxyaudit-image_0.1.0_linux_amd64.cdx.json "] = `"purl": "pkg:golang/k8s.io/client-go@` + clientGo
	}
	for f, want := range sboms {
		if b := mustRead(t, filepath.Join(a, strings.TrimSpace(f))); !strings.Contains(string(b), want) || !strings.Contains(string(b), `"bomFormat": "CycloneDX"`) {
			t.Errorf("%s does not name %s", f, want)
		}
	}
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
	image := "image: ghcr.io/proxyaudit/proxyaudit:0.1.0"
	if os.Geteuid() == 0 {
		// The chart pins the index the release built.
		first, _, _ := strings.Cut(string(mustRead(t, filepath.Join(a, "image.txt"))), "\n")
		_, digest, _ := strings.Cut(first, "@")
		image += "@" + digest
	}
	if out := run("", nil, helm, "template", "proxyaudit", pkg, "--namespace", "proxyaudit"); !strings.Contains(out, image+"\n") {
		t.Errorf("the packaged chart does not run the version's image (%s)", image)
	}

	krew := releaseTool(ctx, t, "krew")
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

// TestImageIndex builds the image index for linux/amd64 and linux/arm64
// (Debian's packages by architecture, stand-in binaries: cross-compiling
// the servers is `make release`'s) twice: the same digest both times, an
// OCI layout whose index names both platforms, each image's config in its
// architecture, and the same package versions in both.
func TestImageIndex(t *testing.T) {
	if testing.Short() {
		t.Skip("takes Debian's packages: make test's end-to-end stage runs it")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (apt-get update for a foreign architecture)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, _ := filepath.Abs("../..")
	platforms := []Platform{{"linux", "amd64"}, {"linux", "arm64"}}
	bins := map[Platform]string{}
	for _, p := range platforms {
		dir := t.TempDir()
		for _, b := range []string{"proxyaudit", "proxyaudit-aggregator", "proxyaudit-collector"} {
			os.WriteFile(filepath.Join(dir, b), []byte("#!/bin/sh\necho "+b+" "+p.Arch+"\n"), 0o755)
		}
		bins[p] = dir
	}
	cache := os.Getenv("PROXYAUDIT_CACHE")
	if cache == "" {
		cache = filepath.Join(root, ".cache")
	}
	var digests []string
	var dir string
	for range 2 {
		dir = filepath.Join(t.TempDir(), "image")
		start := time.Now()
		idx, err := buildIndex(ctx, "ghcr.io/proxyaudit/proxyaudit:0.1.0", dir, filepath.Join(cache, "debs"), bins, platforms)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("index %s in %s", idx.Digest, time.Since(start).Round(time.Millisecond))
		for _, im := range idx.Images {
			t.Logf("  %s %s, %d bytes, %d Debian packages", im.Platform, im.Digest, im.Size, len(im.Packages))
		}
		digests = append(digests, idx.Digest)
		if len(idx.Images) != 2 || len(idx.Images[0].Packages) == 0 {
			t.Fatalf("index: %+v", idx)
		}
	}
	if digests[0] != digests[1] {
		t.Errorf("two builds, two digests: %v", digests)
	}
	lp, err := layout.FromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	top, err := lp.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	tm, err := top.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(tm.Manifests) != 1 || tm.Manifests[0].Digest.String() != digests[0] || tm.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "0.1.0" {
		t.Fatalf("the layout's index.json: %+v", tm.Manifests)
	}
	idx, err := top.ImageIndex(tm.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if im.MediaType != types.OCIImageIndex || len(im.Manifests) != 2 {
		t.Fatalf("index %s with %d manifests", im.MediaType, len(im.Manifests))
	}
	for i, d := range im.Manifests {
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		m, _ := img.Manifest()
		if d.Platform == nil || d.Platform.Architecture != platforms[i].Arch || cf.Architecture != platforms[i].Arch || cf.OS != "linux" ||
			m.MediaType != types.OCIManifestSchema1 || m.Layers[0].MediaType != types.OCILayer {
			t.Errorf("manifest %d: platform %+v, config %s/%s, %s, layer %s", i, d.Platform, cf.OS, cf.Architecture, m.MediaType, m.Layers[0].MediaType)
		}
		if cf.Config.User != "65532:65532" || !slices.Equal(cf.Config.Entrypoint, []string{"/usr/local/bin/proxyaudit"}) ||
			!strings.Contains(cf.Config.Labels["io.proxyaudit.debian-packages"], "iptables=") {
			t.Errorf("%s image config: user %q, entrypoint %v, labels %v", platforms[i].Arch, cf.Config.User, cf.Config.Entrypoint, cf.Config.Labels)
		}
		// The image's own files (arm64's libc in the arm64 image), the
		// tools the Dockerfile names, each owned by root and dated Epoch.
		libc := map[string]string{"amd64": "lib/x86_64-linux-gnu/libc.so.6", "arm64": "lib/aarch64-linux-gnu/libc.so.6"}[platforms[i].Arch]
		want := map[string]func(*tar.Header) bool{
			libc:                                  func(h *tar.Header) bool { return true },
			"usr/local/bin/proxyaudit-collector":  func(h *tar.Header) bool { return h.Mode&0o111 != 0 },
			"usr/local/bin/proxyaudit-aggregator": func(h *tar.Header) bool { return h.Mode&0o111 != 0 },
			"usr/local/bin/proxyaudit":            func(h *tar.Header) bool { return h.Mode&0o111 != 0 },
			"usr/sbin/iptables-save":              func(h *tar.Header) bool { return h.Linkname == "iptables-nft-save" },
			"usr/sbin/iptables-legacy-save":       func(h *tar.Header) bool { return h.Typeflag == tar.TypeSymlink },
			"usr/sbin/nft":                        func(h *tar.Header) bool { return h.Typeflag == tar.TypeReg },
			"sbin/ipvsadm":                        func(h *tar.Header) bool { return h.Typeflag == tar.TypeReg },
			"usr/sbin/conntrack":                  func(h *tar.Header) bool { return h.Typeflag == tar.TypeReg },
			"etc/ssl/certs/ca-certificates.crt":   func(h *tar.Header) bool { return h.Size > 100<<10 },
		}
		rc := mutate.Extract(img)
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(image.Epoch) {
				t.Errorf("%s image: %s: owner %d:%d, time %s", platforms[i].Arch, h.Name, h.Uid, h.Gid, h.ModTime)
			}
			name := strings.TrimPrefix(strings.TrimPrefix(h.Name, "./"), "/")
			if check, ok := want[name]; ok {
				if !check(h) {
					t.Errorf("%s image: %s: %+v", platforms[i].Arch, name, h)
				}
				delete(want, name)
			}
		}
		rc.Close()
		for name := range want {
			t.Errorf("the %s image lacks %s", platforms[i].Arch, name)
		}
	}
}

// TestReleasePushedToARegistry pushes a release to a genuine OCI registry
// (distribution, built from its module) serving TLS with a CA of the
// test's own, then reads it back as a user would: the image index by its
// tag has the release's digest and each platform's manifest; `helm pull`
// of the OCI chart gives the package's bytes, whose default image is the
// registry's, pinned by that digest.
func TestReleasePushedToARegistry(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the release and a registry: make test's end-to-end stage runs it")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root (the image's Debian packages)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	root, _ := filepath.Abs("../..")
	reg := startRegistry(ctx, t)
	cl := filepath.Join(t.TempDir(), "CHANGELOG.md")
	os.WriteFile(cl, []byte("## [0.1.0] - 2026-12-02\n"), 0o644)
	helm, err := chart.Helm(root)
	if err != nil {
		t.Fatal(err)
	}
	helmEnv := []string{"HELM_CACHE_HOME=" + t.TempDir(), "HELM_CONFIG_HOME=" + t.TempDir(), "HELM_DATA_HOME=" + t.TempDir()}
	out := filepath.Join(t.TempDir(), "dist")
	platforms := []Platform{{"linux", "amd64"}}
	registry := reg.addr + "/proxyaudit"
	// A signing key of the test's own (offline: no transparency log).
	// cosign's cold build takes minutes of both cores: a plain go test
	// pushes unsigned; make test (PROXYAUDIT_RELEASE_SIGN=1, cosign built
	// beside its suites) signs and verifies.
	sign := os.Getenv("PROXYAUDIT_RELEASE_SIGN") == "1"
	cosignBin := "cosign"
	if sign {
		cosignBin = releaseTool(ctx, t, "cosign")
	} else {
		t.Log("not signing: PROXYAUDIT_RELEASE_SIGN=1 signs, as make test does")
	}
	keys := t.TempDir()
	cosignEnv := []string{"COSIGN_PASSWORD=release-test", "SSL_CERT_FILE=" + reg.ca, "HOME=" + t.TempDir(), "TUF_ROOT=" + t.TempDir()}
	cosign := func(dir string, args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, cosignBin, args...)
		cmd.Dir, cmd.Env = dir, append(os.Environ(), cosignEnv...)
		b, err := cmd.CombinedOutput()
		return string(b), err
	}
	if sign {
		if b, err := cosign(keys, "generate-key-pair"); err != nil {
			t.Fatalf("cosign generate-key-pair: %v\n%s", err, b)
		}
	}
	cfg := Config{Root: root, Version: "v0.1.0", Out: out, Changelog: cl, CLI: platforms, Servers: platforms, Image: true,
		Registry: registry, Push: true, CAFile: reg.ca, Helm: helm, HelmEnv: helmEnv, Log: testWriter{t},
	}
	if sign {
		cfg.Cosign, cfg.SignKey, cfg.CosignEnv = cosignBin, filepath.Join(keys, "cosign.key"), cosignEnv
	}
	if _, err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	first, _, _ := strings.Cut(string(mustRead(t, filepath.Join(out, "image.txt"))), "\n")
	_, digest, _ := strings.Cut(first, "@")

	ref, err := name.ParseReference(registry + "/proxyaudit:0.1.0")
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(ref, remote.WithContext(ctx), remote.WithTransport(reg.transport))
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest.String() != digest || desc.MediaType != types.OCIImageIndex {
		t.Fatalf("the registry serves %s %s for the tag, want the release's index %s", desc.MediaType, desc.Digest, digest)
	}
	idx, err := desc.ImageIndex()
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range im.Manifests {
		img, err := idx.Image(m.Digest)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := img.Layers(); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s/%s %s", m.Platform.OS, m.Platform.Architecture, m.Digest)
	}

	// Verified as a user would before installing: the index and the chart
	// by the release's key, each platform's SBOM attestation; another key
	// verifies nothing.
	chartDigest := ""
	if sign {
		d, err := remote.Head(mustRef(t, registry+"/charts/proxyaudit:0.1.0"), remote.WithContext(ctx), remote.WithTransport(reg.transport))
		if err != nil {
			t.Fatal(err)
		}
		chartDigest = d.Digest.String()
		pub := filepath.Join(keys, "cosign.pub")
		for _, r := range []string{registry + "/proxyaudit@" + digest, registry + "/charts/proxyaudit@" + chartDigest} {
			if b, err := cosign("", "verify", "--key", pub, "--insecure-ignore-tlog=true", r); err != nil {
				t.Errorf("cosign verify %s: %v\n%s", r, err, b)
			}
		}
		for _, m := range im.Manifests {
			r := registry + "/proxyaudit@" + m.Digest.String()
			if b, err := cosign("", "verify-attestation", "--key", pub, "--insecure-ignore-tlog=true", "--type", "cyclonedx", r); err != nil {
				t.Errorf("cosign verify-attestation %s: %v\n%s", r, err, b)
			}
		}
		other := t.TempDir()
		if b, err := cosign(other, "generate-key-pair"); err != nil {
			t.Fatalf("cosign generate-key-pair: %v\n%s", err, b)
		}
		if b, err := cosign("", "verify", "--key", filepath.Join(other, "cosign.pub"), "--insecure-ignore-tlog=true", registry+"/proxyaudit@"+digest); err == nil {
			t.Errorf("another key verified the release's index:\n%s", b)
		}
	}

	pulled := t.TempDir()
	cmd := exec.CommandContext(ctx, helm, "pull", "oci://"+registry+"/charts/proxyaudit", "--version", "0.1.0", "--ca-file", reg.ca, "--destination", pulled)
	cmd.Env = append(os.Environ(), helmEnv...)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("helm pull: %v\n%s", err, b)
	}
	if !bytes.Equal(mustRead(t, filepath.Join(pulled, "proxyaudit-0.1.0.tgz")), mustRead(t, filepath.Join(out, "proxyaudit-0.1.0.tgz"))) {
		t.Error("the chart pulled from the registry is not the release's package")
	}
	cmd = exec.CommandContext(ctx, helm, "template", "proxyaudit", filepath.Join(pulled, "proxyaudit-0.1.0.tgz"))
	cmd.Env = append(os.Environ(), helmEnv...)
	b, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, b)
	}
	if want := "image: " + registry + "/proxyaudit:0.1.0@" + digest + "\n"; !strings.Contains(string(b), want) {
		t.Errorf("the pulled chart does not run %q", want)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

type registry struct {
	addr, ca  string
	transport http.RoundTripper
}

// startRegistry runs distribution's registry on loopback with TLS from a
// CA of its own (localcluster.StartRegistry); it stops with the test.
func startRegistry(ctx context.Context, t *testing.T) *registry {
	t.Helper()
	r, err := localcluster.StartRegistry(ctx, t.TempDir(), "127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.Stop()
		if t.Failed() {
			t.Logf("registry log:\n%s", r.Log())
		}
	})
	return &registry{addr: r.Addr, ca: r.CAFile, transport: r.Transport}
}

func mustRef(t testing.TB, s string) name.Reference {
	t.Helper()
	r, err := name.ParseReference(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// releaseTool builds (or finds) one of the release's pinned tools.
func releaseTool(ctx context.Context, t testing.TB, tool string) string {
	t.Helper()
	bin, err := localcluster.ReleaseTool(ctx, tool)
	if err != nil {
		t.Fatal(err)
	}
	return bin
}
