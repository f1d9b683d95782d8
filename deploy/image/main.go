// Command image builds proxyaudit's container image without a container
// engine (make image): the three binaries over Debian's rule tools, as the
// Dockerfile describes it, written as an image tarball `ctr images import`
// takes and tagged with the chart's default image reference. With -all it
// also builds the kube-proxy, sandbox (pause) and CoreDNS images the local cluster's
// real nodes run. It prints each image's packages and digest, and the
// project image's path last.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/proxyaudit/proxyaudit/internal/image"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

func main() {
	out := flag.String("out", "bin", "directory the image tarballs are written to")
	all := flag.Bool("all", false, "also build the kube-proxy, pause and CoreDNS images the local cluster's real nodes run")
	flag.Parse()
	ctx := context.Background()
	paths, err := localcluster.BuildImages(ctx, *out, *all, func(b *image.Built, path string) {
		fmt.Fprintf(os.Stderr, "%s %s (%d MB) -> %s\n", b.Ref, b.Digest, b.Size>>20, path)
		for _, p := range b.Packages {
			fmt.Fprintf(os.Stderr, "  %s\n", p)
		}
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "make image:", err)
		os.Exit(1)
	}
	abs, _ := filepath.Abs(paths[0])
	fmt.Println(abs)
}
