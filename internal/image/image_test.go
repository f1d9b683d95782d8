package image

import (
	"archive/tar"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"io"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"
)

// A layer depends on its content only: not on the files' times, owners or
// the order the directory lists them in.
func TestLayerIsContentOnly(t *testing.T) {
	mk := func(stamp time.Time) string {
		root := t.TempDir()
		for _, d := range []string{"usr/sbin", "etc"} {
			if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(root, "usr/sbin/xtables-nft-multi"), []byte("binary"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("xtables-nft-multi", filepath.Join(root, "usr/sbin/iptables-nft")); err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{"usr/sbin/xtables-nft-multi", "usr/sbin", "etc"} {
			if err := os.Chtimes(filepath.Join(root, p), stamp, stamp); err != nil {
				t.Fatal(err)
			}
		}
		return root
	}
	files := []File{{Path: "/usr/local/bin/tool", Data: []byte("#!/bin/sh\n"), Mode: 0o755}, {Path: "/usr/sbin/iptables", Link: "iptables-nft"}}
	var digests []string
	var names []string
	for _, stamp := range []time.Time{time.Unix(1, 0), time.Now()} {
		l, err := layerOf(mk(stamp), files, types.DockerLayer)
		if err != nil {
			t.Fatal(err)
		}
		d, err := l.Digest()
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, d.String())
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		names = names[:0]
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(Epoch) {
				t.Errorf("%s: %d:%d at %s", h.Name, h.Uid, h.Gid, h.ModTime)
			}
			names = append(names, h.Name)
		}
		rc.Close()
	}
	if digests[0] != digests[1] {
		t.Errorf("same content, two digests: %v", digests)
	}
	want := []string{"etc/", "usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/tool", "usr/sbin/", "usr/sbin/iptables", "usr/sbin/iptables-nft", "usr/sbin/xtables-nft-multi"}
	if !slices.Equal(names, want) {
		t.Errorf("entries %v, want %v (sorted, parents made for added files)", names, want)
	}
}

// apt-get writes an epoch's colon as %3a in the file name.
func TestFindDebByVersion(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"ipvsadm_1%3a1.31-1+b1_amd64.deb", "iptables_1.8.9-2_amd64.deb", "libip4tc2_1.8.9-2_amd64.deb", "libip4tc2_1.8.9-2_arm64.deb", "netbase_6.4_all.deb"} {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for pkg, ver := range map[string]string{"ipvsadm": "1:1.31-1+b1", "iptables": "1.8.9-2"} {
		if got, err := findDeb(dir, pkg, ver, "amd64"); err != nil || filepath.Dir(got) != dir {
			t.Errorf("%s=%s: %q, %v", pkg, ver, got, err)
		}
	}
	if got, _ := findDeb(dir, "iptables", "1.8.10-1", "amd64"); got != "" {
		t.Errorf("another version found: %s", got)
	}
	// Each architecture its own .deb; an Architecture: all one for both.
	for arch, want := range map[string]string{"amd64": "libip4tc2_1.8.9-2_amd64.deb", "arm64": "libip4tc2_1.8.9-2_arm64.deb"} {
		if got, _ := findDeb(dir, "libip4tc2", "1.8.9-2", arch); filepath.Base(got) != want {
			t.Errorf("libip4tc2 for %s: %q, want %s", arch, got, want)
		}
		if got, _ := findDeb(dir, "netbase", "6.4", arch); filepath.Base(got) != "netbase_6.4_all.deb" {
			t.Errorf("netbase for %s: %q", arch, got)
		}
	}
	if got, _ := findDeb(dir, "iptables", "1.8.9-2", "arm64"); got != "" {
		t.Errorf("amd64's .deb taken for arm64: %s", got)
	}
}
