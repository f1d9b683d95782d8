// Package image builds container images without a container engine: a
// root filesystem from Debian packages unpacked by version (apt-get
// download, dpkg-deb -x) plus binaries built here, packed into an image
// tarball that `ctr images import` takes. The same inputs give the same
// bytes (sorted entries, fixed times and owners), so the digest says
// whether an image changed.
package image

import (
	"archive/tar"
	"bytes"
	"context"
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
	"sort"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// Epoch is the time every file and the image's creation carry.
var Epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// Package is a Debian package in an image, by exact version.
type Package struct {
	Name, Version string
}

func (p Package) String() string { return p.Name + "=" + p.Version }

// File is a file put into the image: a host file (Src) or bytes (Data),
// or a symbolic link (Link) at Path.
type File struct {
	Path string
	Src  string
	Data []byte
	Link string
	Mode fs.FileMode
}

// Spec is one image.
type Spec struct {
	// Ref is the image's name, e.g. ghcr.io/proxyaudit/proxyaudit:0.1.0.
	Ref string
	// Packages are Debian packages unpacked with what they depend on
	// (Depends and Pre-Depends, recursively), except those only their
	// maintainer scripts need (NoDeps names packages taken alone).
	Packages []string
	NoDeps   []string
	Files    []File
	// Entrypoint, Cmd, User, Env are the image's configuration.
	Entrypoint []string
	Cmd        []string
	User       string
	Env        []string
	// OCI makes the image's manifest, config and layer OCI media types
	// (for an OCI index); else Docker's, as `ctr images import` of a
	// docker-archive tarball expects.
	OCI bool
	// Arch is the image's architecture (Debian's and Go's name: amd64,
	// arm64); empty means amd64. Another architecture than the
	// machine's takes its packages as dpkg's foreign architecture.
	Arch string
}

// arch is the spec's architecture.
func (s Spec) arch() string {
	if s.Arch == "" {
		return "amd64"
	}
	return s.Arch
}

// Built is what Build made.
type Built struct {
	Ref      string
	Digest   string
	Packages []Package
	Size     int64
}

// skipDeps are packages only maintainer scripts or init scripts need;
// nothing in these images runs either.
var skipDeps = map[string]bool{
	"lsb-base": true, "sysvinit-utils": true, "debconf": true, "perl-base": true, "dpkg": true,
	"init-system-helpers": true, "adduser": true, "openssl": true, "debianutils": true,
}

// Build builds spec into an image tarball at out. debCache holds
// downloaded packages between builds.
func Build(ctx context.Context, spec Spec, debCache, out string) (*Built, error) {
	ref, err := name.NewTag(spec.Ref)
	if err != nil {
		return nil, fmt.Errorf("image name %q: %w", spec.Ref, err)
	}
	img, pkgs, err := Image(ctx, spec, debCache)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return nil, err
	}
	tmp := out + ".tmp"
	if err := tarball.WriteToFile(tmp, ref, img); err != nil {
		return nil, fmt.Errorf("write %s: %w", out, err)
	}
	if err := os.Rename(tmp, out); err != nil {
		return nil, err
	}
	d, err := img.Digest()
	if err != nil {
		return nil, err
	}
	st, err := os.Stat(out)
	if err != nil {
		return nil, err
	}
	return &Built{Ref: ref.String(), Digest: d.String(), Packages: pkgs, Size: st.Size()}, nil
}

// Image builds the spec's image (its Ref is not used) and says which
// Debian packages it holds.
func Image(ctx context.Context, spec Spec, debCache string) (v1.Image, []Package, error) {
	root, err := os.MkdirTemp("", "proxyaudit-image-")
	if err != nil {
		return nil, nil, err
	}
	defer os.RemoveAll(root)
	arch := spec.arch()
	var pkgs []Package
	if len(spec.Packages)+len(spec.NoDeps) > 0 {
		apt, err := aptFor(arch, debCache)
		if err != nil {
			return nil, nil, err
		}
		names, err := apt.closure(ctx, spec.Packages)
		if err != nil {
			// No package lists yet (a fresh or cleaned machine, a foreign
			// architecture's first use): fetch them once and ask again.
			if uerr := apt.update(ctx); uerr != nil {
				return nil, nil, fmt.Errorf("%w; %v", err, uerr)
			}
			if names, err = apt.closure(ctx, spec.Packages); err != nil {
				return nil, nil, err
			}
		}
		names = append(names, spec.NoDeps...)
		slices.Sort(names)
		names = slices.Compact(names)
		if pkgs, err = apt.unpack(ctx, names, debCache, root); err != nil {
			return nil, nil, err
		}
	}
	files, err := maintainerFiles(root, pkgs)
	if err != nil {
		return nil, nil, err
	}
	layerType := types.DockerLayer
	if spec.OCI {
		layerType = types.OCILayer
	}
	layer, err := layerOf(root, append(files, spec.Files...), layerType)
	if err != nil {
		return nil, nil, err
	}
	base := empty.Image
	if spec.OCI {
		base = mutate.ConfigMediaType(mutate.MediaType(base, types.OCIManifestSchema1), types.OCIConfigJSON)
	}
	img, err := mutate.AppendLayers(base, layer)
	if err != nil {
		return nil, nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS = arch, "linux"
	cf.Created = v1.Time{Time: Epoch}
	cf.Config.Entrypoint = spec.Entrypoint
	cf.Config.Cmd = spec.Cmd
	cf.Config.User = spec.User
	cf.Config.Env = append([]string{"PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin"}, spec.Env...)
	labels := map[string]string{}
	if len(pkgs) > 0 {
		var s []string
		for _, p := range pkgs {
			s = append(s, p.String())
		}
		labels["io.proxyaudit.debian-packages"] = strings.Join(s, " ")
	}
	cf.Config.Labels = labels
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, nil, err
	}
	if img, err = mutate.CreatedAt(img, v1.Time{Time: Epoch}); err != nil {
		return nil, nil, err
	}
	return img, pkgs, nil
}

// nativeArch is the machine's own Debian architecture: the machine's apt
// serves it.
const nativeArch = "amd64"

// aptConfig runs apt for one architecture: the machine's own apt for its
// architecture; for another, apt with that architecture alone and
// package lists, cache and an empty dpkg status of its own under the deb
// cache, so that neither the machine's dpkg (no foreign architecture is
// added) nor its package lists change, and the machine's sources serve
// both.
type aptConfig struct {
	arch string
	opts []string
}

func aptFor(arch, debCache string) (*aptConfig, error) {
	a := &aptConfig{arch: arch}
	if arch == nativeArch {
		return a, nil
	}
	dir, err := filepath.Abs(filepath.Join(debCache, "apt-"+arch))
	if err != nil {
		return nil, err
	}
	for _, d := range []string{"lists/partial", "cache/archives/partial"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	status := filepath.Join(dir, "status")
	if _, err := os.Stat(status); err != nil {
		if err := os.WriteFile(status, nil, 0o644); err != nil {
			return nil, err
		}
	}
	a.opts = []string{"-o", "APT::Architecture=" + arch, "-o", "APT::Architectures=" + arch,
		"-o", "Dir::State::Lists=" + filepath.Join(dir, "lists"), "-o", "Dir::State::status=" + status,
		"-o", "Dir::Cache=" + filepath.Join(dir, "cache")}
	return a, nil
}

func (a *aptConfig) command(ctx context.Context, tool string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, tool, append(slices.Clone(a.opts), args...)...)
}

// update fetches the package lists (the machine's as root may, or the
// architecture's own).
func (a *aptConfig) update(ctx context.Context) error {
	if out, err := a.command(ctx, "apt-get", "update", "-qq").CombinedOutput(); err != nil {
		return fmt.Errorf("apt-get update (%s): %v\n%s", a.arch, err, out)
	}
	return nil
}

// closure lists pkgs and what they depend on, recursively, as apt
// resolves it on this machine, less skipDeps.
func (a *aptConfig) closure(ctx context.Context, pkgs []string) ([]string, error) {
	if len(pkgs) == 0 {
		return nil, nil
	}
	args := append([]string{"depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
		"--no-breaks", "--no-replaces", "--no-enhances"}, pkgs...)
	out, err := a.command(ctx, "apt-cache", args...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache depends %s: %w (run apt-get update)", strings.Join(pkgs, " "), exitText(err))
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		// A machine with foreign architectures names their variants too
		// (libc6:i386): only the image's own architecture is taken.
		if line == "" || line[0] == ' ' || line[0] == '<' || skipDeps[line] || strings.Contains(line, ":") {
			continue
		}
		names = append(names, line)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}

var debName = regexp.MustCompile(`^([a-z0-9][a-z0-9+.-]*)_([^_]+)_([a-z0-9]+)\.deb$`)

// unpack downloads each package (the version apt would install today,
// kept in debCache by file name) and extracts it into root. apt is asked
// once for all the versions and once for all the downloads: each apt-cache
// or apt-get run loads the package lists (half a second here), and one run
// per package was half of a cold `make demo`'s node images.
func (a *aptConfig) unpack(ctx context.Context, names []string, debCache, root string) ([]Package, error) {
	if err := os.MkdirAll(debCache, 0o755); err != nil {
		return nil, err
	}
	vers, err := a.candidates(ctx, names)
	if err != nil {
		// A machine whose package lists were never fetched (or were
		// cleaned) knows no candidate: fetch them once, as root may.
		if uerr := a.update(ctx); uerr != nil {
			return nil, fmt.Errorf("%w; %v", err, uerr)
		}
		if vers, err = a.candidates(ctx, names); err != nil {
			return nil, err
		}
	}
	var fetch []string
	for _, n := range names {
		deb, err := findDeb(debCache, n, vers[n], a.arch)
		if err != nil {
			return nil, err
		}
		if deb == "" {
			fetch = append(fetch, n+"="+vers[n])
		}
	}
	if len(fetch) > 0 {
		cmd := a.command(ctx, "apt-get", append([]string{"download"}, fetch...)...)
		cmd.Dir = debCache
		if out, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("apt-get download %s: %w\n%s", strings.Join(fetch, " "), err, out)
		}
	}
	var pkgs []Package
	for _, n := range names {
		deb, err := findDeb(debCache, n, vers[n], a.arch)
		if err != nil {
			return nil, err
		}
		if deb == "" {
			return nil, fmt.Errorf("apt-get download %s=%s (%s) left no .deb in %s", n, vers[n], a.arch, debCache)
		}
		if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", deb, root).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("dpkg-deb -x %s: %w\n%s", deb, err, out)
		}
		pkgs = append(pkgs, Package{Name: n, Version: vers[n]})
	}
	return pkgs, nil
}

// candidates is the version apt would install of each package, from one
// `apt-cache policy`; a package it does not know is an error.
func (a *aptConfig) candidates(ctx context.Context, pkgs []string) (map[string]string, error) {
	vers := map[string]string{}
	if len(pkgs) == 0 {
		return vers, nil
	}
	out, err := a.command(ctx, "apt-cache", append([]string{"policy"}, pkgs...)...).Output()
	if err != nil {
		return nil, fmt.Errorf("apt-cache policy %s: %w", strings.Join(pkgs, " "), exitText(err))
	}
	pkg := ""
	for _, line := range strings.Split(string(out), "\n") {
		if name, ok := strings.CutSuffix(line, ":"); ok && line != "" && line[0] != ' ' {
			pkg = strings.TrimSuffix(name, ":"+a.arch)
			continue
		}
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "Candidate: "); ok && pkg != "" && v != "(none)" {
			vers[pkg] = v
		}
	}
	for _, n := range pkgs {
		if vers[n] == "" {
			return nil, fmt.Errorf("no installable version of Debian package %s for %s (run apt-get update)", n, a.arch)
		}
	}
	return vers, nil
}

// findDeb finds pkg's .deb of version ver in dir (apt-get writes an epoch's
// colon as %3a).
func findDeb(dir, pkg, ver, arch string) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	want := strings.ReplaceAll(ver, ":", "%3a")
	for _, e := range ents {
		m := debName.FindStringSubmatch(e.Name())
		if m != nil && m[1] == pkg && m[2] == want && (m[3] == arch || m[3] == "all" || arch == "all") {
			return filepath.Join(dir, e.Name()), nil
		}
	}
	return "", nil
}

func exitText(err error) error {
	var ee *exec.ExitError
	if errors.As(err, &ee) && len(ee.Stderr) > 0 {
		return fmt.Errorf("%w: %s", err, strings.TrimSpace(string(ee.Stderr)))
	}
	return err
}

// entry is one file of the layer.
type entry struct {
	hdr  tar.Header
	src  string // host file to copy, for regular files
	data []byte
}

// layerOf packs root plus files (which win over root's) into one layer
// with sorted entries, owners root:root and times at Epoch.
func layerOf(root string, files []File, mediaType types.MediaType) (v1.Layer, error) {
	ents := map[string]*entry{}
	addDirs := func(p string) {
		for d := path.Dir(p); d != "." && d != "/"; d = path.Dir(d) {
			if _, ok := ents[d+"/"]; !ok {
				ents[d+"/"] = &entry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755}}
			}
		}
	}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel := filepath.ToSlash(strings.TrimPrefix(p, root+"/"))
		info, err := d.Info()
		if err != nil {
			return err
		}
		e := &entry{hdr: tar.Header{Name: rel, Mode: int64(info.Mode().Perm() | info.Mode()&(fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky))}}
		switch {
		case info.IsDir():
			e.hdr.Typeflag, e.hdr.Name = tar.TypeDir, rel+"/"
		case info.Mode()&fs.ModeSymlink != 0:
			e.hdr.Typeflag = tar.TypeSymlink
			if e.hdr.Linkname, err = os.Readlink(p); err != nil {
				return err
			}
		case info.Mode().IsRegular():
			e.hdr.Typeflag, e.hdr.Size, e.src = tar.TypeReg, info.Size(), p
		default:
			return fmt.Errorf("%s: unexpected file type %s in a package", rel, info.Mode().Type())
		}
		ents[e.hdr.Name] = e
		return nil
	})
	if err != nil {
		return nil, err
	}
	for _, f := range files {
		p := strings.TrimPrefix(path.Clean(f.Path), "/")
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
		}
		e := &entry{hdr: tar.Header{Name: p, Mode: int64(mode.Perm())}}
		switch {
		case f.Link != "":
			e.hdr.Typeflag, e.hdr.Linkname = tar.TypeSymlink, f.Link
			e.hdr.Mode = 0o777
		case f.Src != "":
			st, err := os.Stat(f.Src)
			if err != nil {
				return nil, fmt.Errorf("image file %s: %w", f.Path, err)
			}
			e.hdr.Typeflag, e.hdr.Size, e.src = tar.TypeReg, st.Size(), f.Src
		default:
			e.hdr.Typeflag, e.hdr.Size, e.data = tar.TypeReg, int64(len(f.Data)), f.Data
		}
		delete(ents, p+"/")
		ents[p] = e
		addDirs(p)
	}
	names := make([]string, 0, len(ents))
	for n := range ents {
		names = append(names, n)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		e := ents[n]
		e.hdr.ModTime, e.hdr.Format = Epoch, tar.FormatPAX
		e.hdr.Uid, e.hdr.Gid = 0, 0
		if err := tw.WriteHeader(&e.hdr); err != nil {
			return nil, err
		}
		switch {
		case e.src != "":
			f, err := os.Open(e.src)
			if err != nil {
				return nil, err
			}
			_, err = io.CopyN(tw, f, e.hdr.Size)
			f.Close()
			if err != nil {
				return nil, fmt.Errorf("%s: %w", e.src, err)
			}
		case e.data != nil:
			if _, err := tw.Write(e.data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil }, tarball.WithMediaType(mediaType))
}

// maintainerFiles makes what the packages' maintainer scripts would have
// made on install (none runs here): iptables' alternatives, set to the
// nf_tables backend as `update-alternatives --set iptables
// /usr/sbin/iptables-nft` does (the collector still finds which backend
// kube-proxy programs), and the CA bundle update-ca-certificates writes.
func maintainerFiles(root string, pkgs []Package) ([]File, error) {
	var files []File
	has := func(n string) bool {
		return slices.ContainsFunc(pkgs, func(p Package) bool { return p.Name == n })
	}
	if has("iptables") {
		for _, fam := range []string{"iptables", "ip6tables"} {
			for _, suffix := range []string{"", "-save", "-restore"} {
				files = append(files, File{Path: "/usr/sbin/" + fam + suffix, Link: fam + "-nft" + suffix})
			}
		}
	}
	if has("ca-certificates") {
		b, err := caBundle(root)
		if err != nil {
			return nil, err
		}
		files = append(files, File{Path: "/etc/ssl/certs/ca-certificates.crt", Data: b})
	}
	return files, nil
}

// caBundle concatenates the certificates the ca-certificates package
// ships, in name order.
func caBundle(root string) ([]byte, error) {
	var certs []string
	err := filepath.WalkDir(filepath.Join(root, "usr/share/ca-certificates"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".crt") {
			certs = append(certs, p)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	sort.Strings(certs)
	var b bytes.Buffer
	for _, c := range certs {
		data, err := os.ReadFile(c)
		if err != nil {
			return nil, err
		}
		b.Write(bytes.TrimSpace(data))
		b.WriteByte('\n')
	}
	return b.Bytes(), nil
}

// Image references the local cluster and the chart use.
const (
	// KubeProxyRef is the tag kubeadm's kube-proxy DaemonSet names.
	KubeProxyRef = "registry.k8s.io/kube-proxy:v1.37.2"
	// PauseRef is the sandbox image the nodes' containerd is told to use.
	PauseRef = "registry.k8s.io/pause:3.10"
	// CoreDNSRef is the cluster DNS image (deploy/k8s-tools/coredns.sh's version).
	CoreDNSRef = "registry.k8s.io/coredns/coredns:v1.14.7"
	// CiliumRef is Cilium's agent image (deploy/k8s-tools/cilium.sh's version).
	CiliumRef = "quay.io/cilium/cilium:v1.20.2"
)

// debianTools are the packages the collector's readers and an operator's
// debugging need beside kube-proxy's rules (the Dockerfile installs the
// same).
var debianTools = []string{"iptables", "nftables", "ipvsadm", "conntrack"}

// Proxyaudit is the project's image: the three binaries (in binDir) over
// Debian's rule tools, as the Dockerfile describes it.
func Proxyaudit(ref, binDir string) Spec {
	s := Spec{Ref: ref, Packages: debianTools, NoDeps: []string{"ca-certificates"},
		Entrypoint: []string{"/usr/local/bin/proxyaudit"}, User: "65532:65532"}
	for _, b := range []string{"proxyaudit", "proxyaudit-aggregator", "proxyaudit-collector"} {
		s.Files = append(s.Files, File{Path: "/usr/local/bin/" + b, Src: filepath.Join(binDir, b), Mode: 0o755})
	}
	return s
}

// KubeProxy is the genuine kube-proxy binary over the tools it runs
// (iptables, ipset for IPVS mode, conntrack), as kube-proxy's own image
// carries them.
func KubeProxy(kubeProxy string) Spec {
	return Spec{Ref: KubeProxyRef, Packages: []string{"iptables", "ipset", "conntrack", "nftables"},
		Files:      []File{{Path: "/usr/local/bin/kube-proxy", Src: kubeProxy, Mode: 0o755}},
		Entrypoint: []string{"/usr/local/bin/kube-proxy"}}
}

// Pause is the sandbox image: one static binary that sleeps.
func Pause(pause string) Spec {
	return Spec{Ref: PauseRef, Files: []File{{Path: "/pause", Src: pause, Mode: 0o755}},
		Entrypoint: []string{"/pause"}, User: "65535:65535"}
}

// CoreDNS is the cluster DNS image: CoreDNS's static binary alone.
func CoreDNS(coredns string) Spec {
	return Spec{Ref: CoreDNSRef, Files: []File{{Path: "/coredns", Src: coredns, Mode: 0o755}},
		Entrypoint: []string{"/coredns"}, User: "65532:65532"}
}

// Cilium is Cilium's agent image as its release image lays it out: the
// agent and cilium-dbg in /usr/bin, the datapath's C sources in
// /var/lib/cilium/bpf (the agent compiles them at start), and the tools it
// runs: clang and llc (Debian's 19, as "clang" and "llc"), iproute2,
// iptables and ipset. dir is deploy/k8s-tools/cilium.sh's build.
func Cilium(dir string) (Spec, error) {
	s := Spec{Ref: CiliumRef, Packages: []string{"clang-19", "llvm-19", "iproute2", "iptables", "ipset"},
		Entrypoint: []string{"/usr/bin/cilium-agent"},
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
		Files: []File{
			{Path: "/usr/bin/cilium-agent", Src: filepath.Join(dir, "bin", "cilium-agent"), Mode: 0o755},
			{Path: "/usr/bin/cilium-dbg", Src: filepath.Join(dir, "bin", "cilium-dbg"), Mode: 0o755},
			{Path: "/usr/local/bin/clang", Link: "/usr/bin/clang-19"},
			{Path: "/usr/local/bin/llc", Link: "/usr/bin/llc-19"},
		}}
	bpf := filepath.Join(dir, "lib", "bpf")
	err := filepath.WalkDir(bpf, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(bpf, p)
		s.Files = append(s.Files, File{Path: path.Join("/var/lib/cilium/bpf", filepath.ToSlash(rel)), Src: p, Mode: 0o644})
		return nil
	})
	return s, err
}
