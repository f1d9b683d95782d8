package release

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
)

// Pushed is where a release went.
type Pushed struct {
	// Image is repository:version@digest, Chart the chart's OCI reference
	// (oci://…/charts/proxyaudit) and ChartDigest its manifest's.
	Image, Chart, ChartDigest string
}

// push sends the release in cfg.Out to cfg.Registry: the image index from
// the OCI layout (by tag, the index's digest unchanged) and the chart
// package with `helm push` to REGISTRY/charts. Credentials are the usual
// ones (docker's config, `helm registry login`).
func push(ctx context.Context, cfg Config, v, digest string) (*Pushed, error) {
	if cfg.Helm == "" {
		return nil, fmt.Errorf("pushing the chart needs helm (Config.Helm)")
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.CAFile != "" {
		pool, err := tlsfile.LoadCA(cfg.CAFile)
		if err != nil {
			return nil, err
		}
		tr.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	lp, err := layout.FromPath(filepath.Join(cfg.Out, "image"))
	if err != nil {
		return nil, fmt.Errorf("the release's image: %w", err)
	}
	top, err := lp.ImageIndex()
	if err != nil {
		return nil, err
	}
	tm, err := top.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(tm.Manifests) != 1 || tm.Manifests[0].Digest.String() != digest {
		return nil, fmt.Errorf("%s/image holds %d indexes, not the release's %s", cfg.Out, len(tm.Manifests), digest)
	}
	idx, err := top.ImageIndex(tm.Manifests[0].Digest)
	if err != nil {
		return nil, err
	}
	ref, err := name.NewTag(cfg.Registry + "/proxyaudit:" + v)
	if err != nil {
		return nil, fmt.Errorf("PUSH %q: %w", cfg.Registry, err)
	}
	if err := remote.WriteIndex(ref, idx, remote.WithContext(ctx), remote.WithTransport(tr), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return nil, fmt.Errorf("push the image to %s: %w", ref, err)
	}
	chart := "oci://" + cfg.Registry + "/charts"
	args := []string{"push", filepath.Join(cfg.Out, "proxyaudit-"+v+".tgz"), chart}
	if cfg.CAFile != "" {
		args = append(args, "--ca-file", cfg.CAFile)
	}
	cmd := exec.CommandContext(ctx, cfg.Helm, args...)
	cmd.Env = append(os.Environ(), cfg.HelmEnv...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("helm push: %v\n%s", err, out)
	}
	p := &Pushed{Image: ref.String() + "@" + digest, Chart: chart + "/proxyaudit"}
	for _, l := range strings.Split(string(out), "\n") {
		if d, ok := strings.CutPrefix(l, "Digest: "); ok {
			p.ChartDigest = strings.TrimSpace(d)
		}
	}
	if cfg.Cosign == "" {
		return p, nil
	}
	if p.ChartDigest == "" {
		return nil, fmt.Errorf("helm push named no digest to sign:\n%s", out)
	}
	// The index and the chart by digest, never by tag.
	chartRef := strings.TrimPrefix(p.Chart, "oci://") + "@" + p.ChartDigest
	for _, r := range []string{p.Image, chartRef} {
		if err := cosign(ctx, cfg, "sign", r); err != nil {
			return nil, err
		}
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	for _, m := range im.Manifests {
		sbom := filepath.Join(cfg.Out, fmt.Sprintf("proxyaudit-image_%s_%s_%s.cdx.json", v, m.Platform.OS, m.Platform.Architecture))
		if err := cosign(ctx, cfg, "attest", ref.Context().String()+"@"+m.Digest.String(), "--type", "cyclonedx", "--predicate", sbom); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// cosign signs (or attests) ref with the release's key, or keyless.
func cosign(ctx context.Context, cfg Config, verb, ref string, args ...string) error {
	a := []string{verb, "--yes"}
	if cfg.SignKey != "" {
		// A key of the release's own: no transparency log (offline).
		a = append(a, "--key", cfg.SignKey, "--use-signing-config=false", "--tlog-upload=false")
	}
	a = append(append(a, args...), ref)
	cmd := exec.CommandContext(ctx, cfg.Cosign, a...)
	cmd.Env = append(os.Environ(), cfg.CosignEnv...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("cosign %s %s: %v\n%s", verb, ref, err, out)
	}
	return nil
}
