// Command release writes a version's artifacts to dist/ (make release
// VERSION=vX.Y.Z): the CLI's archives (linux and darwin, amd64 and arm64;
// the CLI is also the kubectl plugin), the collector's and aggregator's
// binaries (linux amd64 and arm64), the chart package, the krew plugin
// manifest and checksums.txt. Two runs of one commit write the same bytes.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/proxyaudit/proxyaudit/internal/release"
)

func main() {
	cfg := release.Config{Root: ".", Log: os.Stderr}
	flag.StringVar(&cfg.Version, "version", "", "the release's version, vMAJOR.MINOR.PATCH; CHANGELOG.md must have its section")
	flag.StringVar(&cfg.Out, "out", "dist", "directory to write (must not exist or be empty)")
	flag.StringVar(&cfg.URLBase, "url-base", "", "where the archives will be downloaded from, for the krew manifest (default: the version's GitHub release)")
	flag.BoolVar(&cfg.Image, "image", true, "also build the image for the server platforms as an OCI index in OUT/image (root: Debian's packages by architecture) and pin its digest in the chart")
	flag.StringVar(&cfg.Registry, "registry", "", "where the image and chart live, e.g. ghcr.io/proxyaudit: the chart's image repository becomes REGISTRY/proxyaudit (default: the chart's own)")
	flag.BoolVar(&cfg.Push, "push", false, "push the image index to REGISTRY/proxyaudit:X.Y.Z and the chart to oci://REGISTRY/charts (docker's and helm's registry logins)")
	flag.StringVar(&cfg.CAFile, "ca-file", "", "CA bundle that verifies the registry")
	flag.StringVar(&cfg.Helm, "helm", "helm", "the helm binary that pushes the chart")
	flag.StringVar(&cfg.SBOMTool, "sbom-tool", "", "cyclonedx-gomod, to write each binary's CycloneDX SBOM beside it (make release builds it)")
	flag.StringVar(&cfg.Cosign, "cosign", "", "with -push: cosign, to sign the index and the chart and attest each image's SBOM")
	flag.StringVar(&cfg.SignKey, "sign-key", "", "with -cosign: the cosign key (password in COSIGN_PASSWORD); empty signs keyless (sigstore's OIDC flow, no key kept)")
	cli := flag.String("cli-platforms", "", "the CLI's platforms, OS/ARCH comma-separated (default: linux and darwin, amd64 and arm64)")
	servers := flag.String("server-platforms", "", "the servers' platforms (default: linux/amd64,linux/arm64)")
	flag.Parse()
	var err error
	if *cli != "" {
		if cfg.CLI, err = release.ParsePlatforms(*cli); err != nil {
			fail(err)
		}
	}
	if *servers != "" {
		if cfg.Servers, err = release.ParsePlatforms(*servers); err != nil {
			fail(err)
		}
	}
	arts, err := release.Run(context.Background(), cfg)
	if err != nil {
		fail(err)
	}
	for _, a := range arts {
		fmt.Printf("%-60s %10d  %s\n", a.Name, a.Size, a.SHA256[:16])
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "make release:", strings.TrimSpace(err.Error()))
	os.Exit(2)
}
