package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// ChartImage is the image reference the chart in charts/proxyaudit names
// by default: its values' repository and its appVersion.
func ChartImage() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	values, err := os.ReadFile(filepath.Join(root, "charts/proxyaudit/values.yaml"))
	if err != nil {
		return "", err
	}
	chart, err := os.ReadFile(filepath.Join(root, "charts/proxyaudit/Chart.yaml"))
	if err != nil {
		return "", err
	}
	repo := regexp.MustCompile(`(?m)^image:\n(?:\s+#.*\n)*\s+repository:\s*(\S+)`).FindSubmatch(values)
	ver := regexp.MustCompile(`(?m)^appVersion:\s*"?([^"\s]+)"?`).FindSubmatch(chart)
	if repo == nil || ver == nil {
		return "", fmt.Errorf("cannot read the chart's image repository and appVersion")
	}
	return string(repo[1]) + ":" + string(ver[1]), nil
}

// BuildImages builds the project's image into dir/proxyaudit-image.tar
// (reproducibly: static binaries built with -trimpath, Debian packages by
// version) and, with all, the kube-proxy, pause and CoreDNS images beside
// it.
// built is called for each image. It returns the tarballs' paths, the
// project's first.
func BuildImages(ctx context.Context, dir string, all bool, built func(*image.Built, string)) ([]string, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	ref, err := ChartImage()
	if err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp("", "proxyaudit-image-bin-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	build := GoBuild(ctx, root, tmp+"/", "-ldflags=-s -w",
		"./cmd/proxyaudit", "./cmd/proxyaudit-aggregator", "./cmd/proxyaudit-collector", "./deploy/image/pause")
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build the binaries: %v\n%s", err, out)
	}
	specs := []image.Spec{image.Proxyaudit(ref, tmp)}
	files := []string{"proxyaudit-image.tar"}
	if all {
		bin, err := EnsureBinaries(ctx, nil)
		if err != nil {
			return nil, err
		}
		coredns, err := ensureTool(ctx, "coredns.sh")
		if err != nil {
			return nil, err
		}
		specs = append(specs, image.KubeProxy(filepath.Join(bin, "kube-proxy")), image.Pause(filepath.Join(tmp, "pause")), image.CoreDNS(coredns))
		files = append(files, "kube-proxy-image.tar", "pause-image.tar", "coredns-image.tar")
	}
	cache := cacheDir()
	var paths []string
	for i, s := range specs {
		p := filepath.Join(dir, files[i])
		b, err := image.Build(ctx, s, filepath.Join(cache, "debs"), p)
		if err != nil {
			return nil, fmt.Errorf("image %s: %w", s.Ref, err)
		}
		if built != nil {
			built(b, p)
		}
		paths = append(paths, p)
	}
	return paths, nil
}

// cacheDir is where builds and downloads are kept between runs:
// $PROXYAUDIT_CACHE, or the repository's .cache.
func cacheDir() string {
	if cache := os.Getenv("PROXYAUDIT_CACHE"); cache != "" {
		return cache
	}
	root, err := RepoRoot()
	if err != nil {
		return ".cache"
	}
	return filepath.Join(root, ".cache")
}
