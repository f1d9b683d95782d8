// Package release writes a version's artifacts to a directory (make
// release): the CLI's archives for every platform (the CLI is also the
// kubectl plugin), the servers' binaries, the chart package, the krew
// plugin manifest and checksums over all of them. Two runs of one commit
// write byte-identical files: every build is stamped with the commit's own
// date, and archives carry that date, fixed owners and a sorted order.
package release

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
)

// Platform is a GOOS/GOARCH pair.
type Platform struct{ OS, Arch string }

func (p Platform) String() string { return p.OS + "/" + p.Arch }

// ParsePlatforms reads "linux/amd64,darwin/arm64".
func ParsePlatforms(s string) ([]Platform, error) {
	var out []Platform
	for _, f := range strings.Split(s, ",") {
		os, arch, ok := strings.Cut(strings.TrimSpace(f), "/")
		if !ok || os == "" || arch == "" {
			return nil, fmt.Errorf("platform %q: want OS/ARCH, e.g. linux/amd64", f)
		}
		out = append(out, Platform{os, arch})
	}
	return out, nil
}

var (
	// CLIPlatforms: where SREs run the CLI (and kubectl).
	CLIPlatforms = []Platform{{"linux", "amd64"}, {"linux", "arm64"}, {"darwin", "amd64"}, {"darwin", "arm64"}}
	// ServerPlatforms: the nodes the collector and aggregator run on.
	ServerPlatforms = []Platform{{"linux", "amd64"}, {"linux", "arm64"}}
)

// Config says what to release and where.
type Config struct {
	// Root is the repository (its go.mod, CHANGELOG.md, charts/, LICENSE).
	Root string
	// Version is the release's, vMAJOR.MINOR.PATCH[-PRE].
	Version string
	// Out is the directory written: it must not exist or be empty.
	Out string
	// CLI and Servers are the platforms built (nil: CLIPlatforms,
	// ServerPlatforms).
	CLI, Servers []Platform
	// URLBase is where the archives will be downloaded from (the krew
	// manifest's uris): the version's release page by default.
	URLBase string
	// Image also builds the project's image for every server platform,
	// written as an OCI index to Out/image (an OCI layout); the packaged
	// chart then pins the index's digest. DebCache keeps the Debian
	// packages it takes (default: $PROXYAUDIT_CACHE/debs or Root/.cache/debs).
	Image    bool
	DebCache string
	// Registry is where the image and chart live, e.g. ghcr.io/proxyaudit
	// (the default: the chart's image repository's): the image is
	// REGISTRY/proxyaudit, the packaged chart's default, and the chart
	// REGISTRY/charts/proxyaudit. Push sends both there.
	Registry string
	Push     bool
	// CAFile, when set, is the CA bundle that verifies the registry; Helm
	// is the helm binary pushing the chart, HelmEnv its environment
	// beside ours.
	CAFile  string
	Helm    string
	HelmEnv []string
	// Cosign, with Push, signs the pushed image index and chart and
	// attests each platform's image with its SBOM: with the key at
	// SignKey (its password in COSIGN_PASSWORD), or keyless (sigstore's
	// OIDC flow, as in the release workflow) when SignKey is empty.
	// CosignEnv is its environment beside ours.
	Cosign    string
	SignKey   string
	CosignEnv []string
	// SBOMTool is cyclonedx-gomod: each binary's SBOM is written beside
	// it (name.cdx.json); empty writes none.
	SBOMTool string
	// Changelog is the changelog that must have the version's section
	// (default: Root's CHANGELOG.md).
	Changelog string
	// Go is the go command ("go").
	Go string
	// Log, when set, gets a line per step.
	Log io.Writer
}

// Artifact is one file written to Out.
type Artifact struct {
	Name   string // relative to Out, with forward slashes
	SHA256 string
	Size   int64
}

var semver = regexp.MustCompile(`^v(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`)

// ChartVersion is the chart's version for a release's: without the v.
func ChartVersion(version string) string { return strings.TrimPrefix(version, "v") }

// Run writes the release and returns its artifacts, sorted by name.
func Run(ctx context.Context, cfg Config) ([]Artifact, error) {
	if !semver.MatchString(cfg.Version) {
		return nil, fmt.Errorf("VERSION %q is not a release version: want vMAJOR.MINOR.PATCH (e.g. v0.1.0)", cfg.Version)
	}
	v := ChartVersion(cfg.Version)
	if cfg.Changelog == "" {
		cfg.Changelog = filepath.Join(cfg.Root, "CHANGELOG.md")
	}
	if err := changelogHas(cfg.Changelog, v); err != nil {
		return nil, err
	}
	if cfg.Go == "" {
		cfg.Go = "go"
	}
	if cfg.CLI == nil {
		cfg.CLI = CLIPlatforms
	}
	if cfg.Servers == nil {
		cfg.Servers = ServerPlatforms
	}
	if cfg.URLBase == "" {
		cfg.URLBase = "https://github.com/proxyaudit/proxyaudit/releases/download/" + cfg.Version
	}
	if ents, err := os.ReadDir(cfg.Out); err == nil && len(ents) > 0 {
		return nil, fmt.Errorf("%s is not empty: remove it first (make release does)", cfg.Out)
	}
	commit, date, err := commitOf(ctx, cfg.Root)
	if err != nil {
		return nil, err
	}
	logf := func(format string, a ...any) {
		if cfg.Log != nil {
			fmt.Fprintf(cfg.Log, format+"\n", a...)
		}
	}
	logf("release %s of %s (%s)", cfg.Version, commit, date.Format(time.RFC3339))
	if err := os.MkdirAll(cfg.Out, 0o755); err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp("", "proxyaudit-release-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	ldflags := strings.Join(append([]string{"-s", "-w"}, buildinfo.LDFlags(cfg.Version, commit, date.UTC().Format(time.RFC3339))...), " ")
	build := func(p Platform, pkg, out string) error {
		logf("  go build %s for %s", pkg, p)
		cmd := exec.CommandContext(ctx, cfg.Go, "build", "-trimpath", "-buildvcs=false", "-ldflags", ldflags, "-o", out, pkg)
		cmd.Dir = cfg.Root
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Arch)
		if b, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s for %s: %v\n%s", pkg, p, err, b)
		}
		return nil
	}
	license, err := os.ReadFile(filepath.Join(cfg.Root, "LICENSE"))
	if err != nil {
		return nil, err
	}
	readme, err := os.ReadFile(filepath.Join(cfg.Root, "README.md"))
	if err != nil {
		return nil, err
	}
	var krew []krewPlatform
	for _, p := range cfg.CLI {
		bin := filepath.Join(work, "cli-"+p.OS+"-"+p.Arch)
		if err := build(p, "./cmd/proxyaudit", bin); err != nil {
			return nil, err
		}
		exe, err := os.ReadFile(bin)
		if err != nil {
			return nil, err
		}
		name := fmt.Sprintf("proxyaudit_%s_%s_%s.tar.gz", v, p.OS, p.Arch)
		data, err := tarGz(date, []file{{"LICENSE", 0o644, license}, {"README.md", 0o644, readme}, {"proxyaudit", 0o755, exe}})
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(cfg.Out, name), data, 0o644); err != nil {
			return nil, err
		}
		krew = append(krew, krewPlatform{p, cfg.URLBase + "/" + name, sum(data)})
		if err := binarySBOM(ctx, cfg, bin, cfg.Version, filepath.Join(cfg.Out, strings.TrimSuffix(name, ".tar.gz")+".cdx.json")); err != nil {
			return nil, err
		}
	}
	for _, p := range cfg.Servers {
		for _, cmd := range []string{"proxyaudit-collector", "proxyaudit-aggregator"} {
			out := filepath.Join(cfg.Out, fmt.Sprintf("%s_%s_%s_%s", cmd, v, p.OS, p.Arch))
			if err := build(p, "./cmd/"+cmd, out); err != nil {
				return nil, err
			}
			if err := binarySBOM(ctx, cfg, out, cfg.Version, out+".cdx.json"); err != nil {
				return nil, err
			}
		}
	}
	if cfg.Push && !cfg.Image {
		return nil, fmt.Errorf("pushing a release needs its image (Config.Image)")
	}
	repo, err := chartRepository(cfg.Root)
	if err != nil {
		return nil, err
	}
	if cfg.Registry == "" {
		cfg.Registry = path.Dir(repo)
	}
	cfg.Registry = strings.TrimSuffix(strings.TrimPrefix(cfg.Registry, "oci://"), "/")
	digest := ""
	if cfg.Image {
		idx, err := releaseImage(ctx, cfg, v, work, build)
		if err != nil {
			return nil, err
		}
		digest = idx.Digest
		logf("  image %s@%s", idx.Ref, idx.Digest)
	}
	logf("  chart %s", v)
	chart, err := packageChart(filepath.Join(cfg.Root, "charts", "proxyaudit"), v, cfg.Registry+"/proxyaudit", digest, date)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(cfg.Out, "proxyaudit-"+v+".tgz"), chart, 0o644); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(cfg.Out, "krew"), 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(cfg.Out, "krew", "proxyaudit.yaml"), krewManifest(cfg.Version, krew), 0o644); err != nil {
		return nil, err
	}
	arts, err := checksums(cfg.Out)
	if err != nil {
		return nil, err
	}
	logf("  %d files and checksums.txt in %s", len(arts)-1, cfg.Out)
	if cfg.Push {
		p, err := push(ctx, cfg, v, digest)
		if err != nil {
			return nil, err
		}
		logf("  pushed %s and %s:%s (%s)", p.Image, p.Chart, v, p.ChartDigest)
	}
	return arts, nil
}

// changelogHas refuses a version CHANGELOG.md has no section for.
func changelogHas(path, v string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "## ["+v+"]") {
			return nil
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	return fmt.Errorf("%s has no section for %s: cut it from [Unreleased] first (## [%s] - YYYY-MM-DD)", path, v, v)
}

// commitOf is the checkout's commit ("-dirty" when it has changes) and the
// commit's date: every build and archive of the release is dated by it.
func commitOf(ctx context.Context, root string) (string, time.Time, error) {
	git := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, "git", append([]string{"-C", root}, args...)...)
		b, err := cmd.Output()
		if err != nil {
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				return "", fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, ee.Stderr)
			}
			return "", fmt.Errorf("git %s: %v", strings.Join(args, " "), err)
		}
		return strings.TrimSpace(string(b)), nil
	}
	commit, err := git("rev-parse", "HEAD")
	if err != nil {
		return "", time.Time{}, fmt.Errorf("a release is made from a git checkout: %w", err)
	}
	unix, err := git("log", "-1", "--format=%ct", "HEAD")
	if err != nil {
		return "", time.Time{}, err
	}
	var secs int64
	if _, err := fmt.Sscan(unix, &secs); err != nil {
		return "", time.Time{}, fmt.Errorf("commit time %q: %v", unix, err)
	}
	if st, err := git("status", "--porcelain", "--untracked-files=no"); err != nil {
		return "", time.Time{}, err
	} else if st != "" {
		commit += "-dirty"
	}
	return commit, time.Unix(secs, 0).UTC(), nil
}

type file struct {
	name string
	mode int64
	data []byte
}

// tarGz writes files (sorted by name) as a gzipped tar with fixed owners
// and the given time: the same files give the same bytes.
func tarGz(mod time.Time, files []file) ([]byte, error) {
	slices.SortFunc(files, func(a, b file) int { return strings.Compare(a.name, b.name) })
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	zw.ModTime = time.Time{} // no time in gzip's header: the tar's is enough
	tw := tar.NewWriter(zw)
	for _, f := range files {
		h := &tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: f.mode, Size: int64(len(f.data)), ModTime: mod, Format: tar.FormatPAX}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

var (
	chartVersionLine    = regexp.MustCompile(`(?m)^version: .*$`)
	chartAppVersionLine = regexp.MustCompile(`(?m)^appVersion: .*$`)
	imageDigestLine     = regexp.MustCompile(`(?m)^  digest: ""$`)
)

// packageChart writes the chart as `helm package` would (every file under
// proxyaudit/ but what .helmignore names), its version and appVersion the
// release's: the image tag defaults to the appVersion.
func packageChart(dir, v, repository, digest string, mod time.Time) ([]byte, error) {
	ignore, err := helmIgnore(filepath.Join(dir, ".helmignore"))
	if err != nil {
		return nil, err
	}
	var files []file
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		rel = filepath.ToSlash(rel)
		if ignore(rel, d.IsDir()) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		if d.IsDir() {
			return nil
		}
		if !d.Type().IsRegular() {
			return fmt.Errorf("chart file %s is not a regular file", rel)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if rel == "Chart.yaml" {
			if !chartVersionLine.Match(data) || !chartAppVersionLine.Match(data) {
				return fmt.Errorf("%s: no version: or appVersion: line to set", p)
			}
			data = chartVersionLine.ReplaceAll(data, []byte("version: "+v))
			data = chartAppVersionLine.ReplaceAll(data, []byte(`appVersion: "`+v+`"`))
		}
		if rel == "values.yaml" {
			data = repositoryLine.ReplaceAll(data, []byte("  repository: "+repository))
		}
		if rel == "values.yaml" && digest != "" {
			if !imageDigestLine.Match(data) {
				return fmt.Errorf("%s: no image digest line to pin", p)
			}
			data = imageDigestLine.ReplaceAll(data, []byte(`  digest: "`+digest+`"`))
		}
		files = append(files, file{path.Join("proxyaudit", rel), 0o644, data})
		return nil
	})
	if err != nil {
		return nil, err
	}
	return tarGz(mod, files)
}

// helmIgnore reads the chart's .helmignore: blank lines and comments
// skipped, "dir/" a directory, other lines shell patterns matched against
// a path's base name or the whole relative path (the forms the chart uses;
// helm's negations are refused rather than misread).
func helmIgnore(p string) (func(rel string, dir bool) bool, error) {
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return func(string, bool) bool { return false }, nil
	}
	if err != nil {
		return nil, err
	}
	var pats []string
	for _, l := range strings.Split(string(b), "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "#") {
			continue
		}
		if strings.HasPrefix(l, "!") {
			return nil, fmt.Errorf("%s: negated pattern %q is not supported by the release's packager", p, l)
		}
		if _, err := path.Match(strings.TrimSuffix(l, "/"), ""); err != nil {
			return nil, fmt.Errorf("%s: pattern %q: %v", p, l, err)
		}
		pats = append(pats, l)
	}
	return func(rel string, dir bool) bool {
		for _, pat := range pats {
			onlyDir := strings.HasSuffix(pat, "/")
			pat = strings.TrimSuffix(pat, "/")
			if onlyDir && !dir {
				continue
			}
			if m, _ := path.Match(pat, path.Base(rel)); m {
				return true
			}
			if m, _ := path.Match(pat, rel); m {
				return true
			}
		}
		return false
	}, nil
}

type krewPlatform struct {
	p      Platform
	uri    string
	sha256 string
}

// krewManifest is the plugin's krew manifest: each platform's archive by
// its sha256; krew links kubectl-proxyaudit to the archive's proxyaudit.
func krewManifest(version string, ps []krewPlatform) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, `apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: proxyaudit
spec:
  version: %s
  homepage: https://github.com/proxyaudit/proxyaudit
  shortDescription: Find nodes whose kube-proxy rules drifted from EndpointSlices
  description: |
    Reports the nodes whose service dataplane (kube-proxy's iptables, nftables
    or IPVS rules, Cilium's eBPF maps) differs from the cluster's Services and
    EndpointSlices, naming the service and endpoint on each node, from the
    proxyaudit aggregator installed in the cluster (report, explain, ui, pause),
    and audits a node's rules against a cluster dump offline (diff).
  platforms:
`, version)
	for _, k := range ps {
		fmt.Fprintf(&b, `  - selector:
      matchLabels:
        os: %s
        arch: %s
    uri: %s
    sha256: %s
    files:
    - from: proxyaudit
      to: .
    - from: LICENSE
      to: .
    bin: proxyaudit
`, k.p.OS, k.p.Arch, k.uri, k.sha256)
	}
	return []byte(b.String())
}

func sum(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// checksums writes checksums.txt (`sha256sum -c` format) over every file
// in out and returns them all, sorted.
func checksums(out string) ([]Artifact, error) {
	var arts []Artifact
	err := filepath.WalkDir(out, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(out, p)
		if rel == "checksums.txt" {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		arts = append(arts, Artifact{Name: filepath.ToSlash(rel), SHA256: sum(b), Size: int64(len(b))})
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(arts, func(a, b Artifact) int { return strings.Compare(a.Name, b.Name) })
	var b strings.Builder
	for _, a := range arts {
		fmt.Fprintf(&b, "%s  %s\n", a.SHA256, a.Name)
	}
	data := []byte(b.String())
	if err := os.WriteFile(filepath.Join(out, "checksums.txt"), data, 0o644); err != nil {
		return nil, err
	}
	arts = append(arts, Artifact{Name: "checksums.txt", SHA256: sum(data), Size: int64(len(data))})
	slices.SortFunc(arts, func(a, b Artifact) int { return strings.Compare(a.Name, b.Name) })
	return arts, nil
}

// releaseImage builds the image index from the servers' binaries in
// cfg.Out and the CLI built for each server platform, and says what it
// holds in Out/image.txt.
func releaseImage(ctx context.Context, cfg Config, v, work string, build func(Platform, string, string) error) (*Index, error) {
	repo := cfg.Registry + "/proxyaudit"
	debCache := cfg.DebCache
	if debCache == "" {
		cache := os.Getenv("PROXYAUDIT_CACHE")
		if cache == "" {
			cache = filepath.Join(cfg.Root, ".cache")
		}
		debCache = filepath.Join(cache, "debs")
	}
	bins := map[Platform]string{}
	for _, p := range cfg.Servers {
		dir := filepath.Join(work, "image-"+p.OS+"-"+p.Arch)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		// The CLI's archive for this platform holds the same build.
		if b, err := os.ReadFile(filepath.Join(work, "cli-"+p.OS+"-"+p.Arch)); err == nil {
			if err := os.WriteFile(filepath.Join(dir, "proxyaudit"), b, 0o755); err != nil {
				return nil, err
			}
		} else if err := build(p, "./cmd/proxyaudit", filepath.Join(dir, "proxyaudit")); err != nil {
			return nil, err
		}
		for _, cmd := range []string{"proxyaudit-collector", "proxyaudit-aggregator"} {
			b, err := os.ReadFile(filepath.Join(cfg.Out, fmt.Sprintf("%s_%s_%s_%s", cmd, v, p.OS, p.Arch)))
			if err != nil {
				return nil, err
			}
			if err := os.WriteFile(filepath.Join(dir, cmd), b, 0o755); err != nil {
				return nil, err
			}
		}
		bins[p] = dir
	}
	idx, err := buildIndex(ctx, repo+":"+v, filepath.Join(cfg.Out, "image"), debCache, bins, cfg.Servers)
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%s@%s\n", idx.Ref, idx.Digest)
	for _, im := range idx.Images {
		fmt.Fprintf(&b, "%s %s %d bytes\n", im.Platform, im.Digest, im.Size)
	}
	for _, im := range idx.Images {
		fmt.Fprintf(&b, "Debian packages (%s):\n", im.Platform)
		for _, p := range im.Packages {
			fmt.Fprintf(&b, "  %s\n", p)
		}
	}
	if err := os.WriteFile(filepath.Join(cfg.Out, "image.txt"), []byte(b.String()), 0o644); err != nil {
		return nil, err
	}
	for _, im := range idx.Images {
		sbom, err := imageSBOM(idx.Ref, im, bins[im.Platform])
		if err != nil {
			return nil, err
		}
		name := fmt.Sprintf("proxyaudit-image_%s_%s_%s.cdx.json", v, im.Platform.OS, im.Platform.Arch)
		if err := os.WriteFile(filepath.Join(cfg.Out, name), append(sbom, '\n'), 0o644); err != nil {
			return nil, err
		}
	}
	return idx, nil
}

// binarySBOM writes bin's CycloneDX SBOM (its Go modules, from the build
// information the binary carries, and the standard library) to out,
// without a timestamp or serial number so that two releases agree.
func binarySBOM(ctx context.Context, cfg Config, bin, version, out string) error {
	if cfg.SBOMTool == "" {
		return nil
	}
	cmd := exec.CommandContext(ctx, cfg.SBOMTool, "bin", "-json", "-std", "-noserial", "-notimestamp", "-version", version, "-output", out, bin)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("SBOM of %s: %v\n%s", filepath.Base(bin), err, b)
	}
	return nil
}
