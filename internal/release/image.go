package release

import (
	"context"
	"debug/buildinfo"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// Index is the release's multi-arch image.
type Index struct {
	// Ref is repository:version, Digest the index's.
	Ref, Digest string
	// Images are each platform's manifest digest and its Debian packages.
	Images []PlatformImage
}

// PlatformImage is one architecture's image in the index.
type PlatformImage struct {
	Platform Platform
	Digest   string
	Size     int64 // its layers' and config's compressed bytes
	Packages []image.Package
}

var repositoryLine = regexp.MustCompile(`(?m)^  repository: (\S+)$`)

// chartRepository is the chart's default image repository (values.yaml's
// image.repository).
func chartRepository(root string) (string, error) {
	b, err := os.ReadFile(filepath.Join(root, "charts", "proxyaudit", "values.yaml"))
	if err != nil {
		return "", err
	}
	m := repositoryLine.FindSubmatch(b)
	if m == nil {
		return "", fmt.Errorf("charts/proxyaudit/values.yaml: no image repository")
	}
	return string(m[1]), nil
}

// buildIndex builds the project's image for each platform from the
// binaries in bins[platform] (proxyaudit, proxyaudit-aggregator,
// proxyaudit-collector), each with the same Debian package versions, and
// writes their OCI index to an OCI layout at dir, named by ref.
func buildIndex(ctx context.Context, ref, dir, debCache string, bins map[Platform]string, platforms []Platform) (*Index, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	out := &Index{Ref: ref}
	var first map[string]string
	for _, p := range platforms {
		spec := image.Proxyaudit(ref, bins[p])
		spec.Arch, spec.OCI = p.Arch, true
		img, pkgs, err := image.Image(ctx, spec, debCache)
		if err != nil {
			return nil, fmt.Errorf("image for %s: %w", p, err)
		}
		vers := map[string]string{}
		for _, k := range pkgs {
			vers[k.Name] = k.Version
		}
		if first == nil {
			first = vers
		} else if d := differ(first, vers); d != "" {
			return nil, fmt.Errorf("image for %s: its Debian packages differ from %s's: %s (Debian's mirror moved between the two? run again)", p, platforms[0], d)
		}
		d, err := img.Digest()
		if err != nil {
			return nil, err
		}
		size, err := imageSize(img)
		if err != nil {
			return nil, err
		}
		out.Images = append(out.Images, PlatformImage{Platform: p, Digest: d.String(), Size: size, Packages: pkgs})
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			MediaType: types.OCIManifestSchema1, Platform: &v1.Platform{OS: p.OS, Architecture: p.Arch}}})
	}
	d, err := idx.Digest()
	if err != nil {
		return nil, err
	}
	out.Digest = d.String()
	lp, err := layout.Write(dir, empty.Index)
	if err != nil {
		return nil, err
	}
	tag := ref[strings.LastIndex(ref, ":")+1:]
	if err := lp.AppendIndex(idx, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		return nil, err
	}
	return out, nil
}

// binNMU is Debian's suffix for a rebuild of the same source on one
// architecture (ipvsadm 1:1.31-1+b1 on amd64 is 1:1.31-1 on arm64): the
// versions are the same source's.
var binNMU = regexp.MustCompile(`\+b[0-9]+$`)

// differ says which packages are not the same source version in both
// (a binNMU aside).
func differ(a, b map[string]string) string {
	var d []string
	for n, v := range a {
		if binNMU.ReplaceAllString(b[n], "") != binNMU.ReplaceAllString(v, "") {
			d = append(d, fmt.Sprintf("%s %s vs %q", n, v, b[n]))
		}
	}
	for n, v := range b {
		if _, ok := a[n]; !ok {
			d = append(d, fmt.Sprintf("%s only in the second (%s)", n, v))
		}
	}
	return strings.Join(d, ", ")
}

func imageSize(img v1.Image) (int64, error) {
	m, err := img.Manifest()
	if err != nil {
		return 0, err
	}
	n := m.Config.Size
	for _, l := range m.Layers {
		n += l.Size
	}
	return n, nil
}

// imageSBOM is the image's CycloneDX SBOM for one platform: its Debian
// packages by version and the Go modules its binaries (in dir) were built
// from, as their build information says.
func imageSBOM(ref string, im PlatformImage, dir string) ([]byte, error) {
	type component struct {
		Type    string `json:"type"`
		BOMRef  string `json:"bom-ref"`
		Name    string `json:"name"`
		Version string `json:"version"`
		PURL    string `json:"purl"`
	}
	var comps []component
	for _, p := range im.Packages {
		purl := fmt.Sprintf("pkg:deb/debian/%s@%s?arch=%s&distro=debian-12", p.Name, url.PathEscape(p.Version), im.Platform.Arch)
		comps = append(comps, component{"library", purl, p.Name, p.Version, purl})
	}
	mods := map[string]string{}
	for _, b := range []string{"proxyaudit", "proxyaudit-aggregator", "proxyaudit-collector"} {
		bi, err := buildinfo.ReadFile(filepath.Join(dir, b))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b, err)
		}
		mods["stdlib"] = bi.GoVersion
		for _, d := range bi.Deps {
			if d.Replace != nil {
				d = d.Replace
			}
			mods[d.Path] = d.Version
		}
	}
	var paths []string
	for p := range mods {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		purl := "pkg:golang/" + p + "@" + mods[p]
		comps = append(comps, component{"library", purl, p, mods[p], purl})
	}
	repo, tag, _ := strings.Cut(ref[strings.LastIndex(ref, "/")+1:], ":")
	bom := map[string]any{
		"bomFormat": "CycloneDX", "specVersion": "1.6", "version": 1,
		"metadata": map[string]any{"component": map[string]any{"type": "container", "bom-ref": ref + "@" + im.Digest, "name": repo, "version": tag,
			"properties": []map[string]string{{"name": "platform", "value": im.Platform.String()}, {"name": "digest", "value": im.Digest}}}},
		"components": comps,
	}
	return json.MarshalIndent(bom, "", "  ")
}
