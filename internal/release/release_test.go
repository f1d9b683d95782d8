package release

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestRefusals(t *testing.T) {
	root, _ := filepath.Abs("../..")
	cl := filepath.Join(t.TempDir(), "CHANGELOG.md")
	if err := os.WriteFile(cl, []byte("# Changelog\n\n## [Unreleased]\n\n## [0.1.0] - 2026-12-02\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	full := t.TempDir()
	os.WriteFile(filepath.Join(full, "x"), nil, 0o644)
	for _, c := range []struct {
		cfg  Config
		want string
	}{
		{Config{Version: "0.1.0", Changelog: cl}, "not a release version"},
		{Config{Version: "v0.1", Changelog: cl}, "not a release version"},
		{Config{Version: "v01.1.0", Changelog: cl}, "not a release version"},
		{Config{Version: "v0.2.0", Changelog: cl}, "no section for 0.2.0"},
		{Config{Version: "v0.1.0", Changelog: cl, Out: full}, "is not empty"},
	} {
		c.cfg.Root = root
		if c.cfg.Out == "" {
			c.cfg.Out = filepath.Join(t.TempDir(), "dist")
		}
		_, err := Run(context.Background(), c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", c.cfg, err, c.want)
		}
	}
}

// The same files give the same archive, whatever order they came in; the
// archive holds them with fixed owners and the given date.
func TestArchivesAreReproducible(t *testing.T) {
	mod := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	a, err := tarGz(mod, []file{{"b", 0o644, []byte("bee")}, {"a", 0o755, []byte("ay")}})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := tarGz(mod, []file{{"a", 0o755, []byte("ay")}, {"b", 0o644, []byte("bee")}})
	if !bytes.Equal(a, b) {
		t.Fatal("the same files in another order gave other bytes")
	}
	got := untar(t, a)
	if len(got) != 2 || got[0].Name != "a" || got[0].Mode != 0o755 || got[1].Name != "b" || !got[0].ModTime.Equal(mod) || got[0].Uid != 0 || got[0].Uname != "" {
		t.Errorf("entries %+v", got)
	}
}

func TestHelmIgnore(t *testing.T) {
	p := filepath.Join(t.TempDir(), ".helmignore")
	os.WriteFile(p, []byte("# comment\n.git/\n*.swp\nci/*.tmp\n"), 0o644)
	ig, err := helmIgnore(p)
	if err != nil {
		t.Fatal(err)
	}
	for rel, want := range map[string]bool{".git": true, "templates/x.swp": true, "ci/a.tmp": true, "ci/a.yaml": false, "values.yaml": false} {
		if got := ig(rel, rel == ".git"); got != want {
			t.Errorf("%s: ignored %v, want %v", rel, got, want)
		}
	}
	os.WriteFile(p, []byte("!keep.yaml\n"), 0o644)
	if _, err := helmIgnore(p); err == nil {
		t.Error("a negated pattern was taken")
	}
}

type entry struct {
	tar.Header
	data []byte
}

func untar(t testing.TB, b []byte) []entry {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(zr)
	var out []entry
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(tr)
		out = append(out, entry{*h, data})
	}
}
