package testkit_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// repoRoot is the module's root (where go.mod is).
func repoRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		up := filepath.Dir(dir)
		if up == dir {
			t.Fatal("no go.mod above the test's directory")
		}
		dir = up
	}
}

// sources parses the non-test Go files below dirs (relative to the root).
func sources(t *testing.T, root string, dirs ...string) (*token.FileSet, map[string]*ast.File) {
	t.Helper()
	fset := token.NewFileSet()
	files := map[string]*ast.File{}
	for _, d := range dirs {
		err := filepath.WalkDir(filepath.Join(root, d), func(p string, e os.DirEntry, err error) error {
			if err != nil || e.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			f, err := parser.ParseFile(fset, p, nil, 0)
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			files[rel] = f
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(files) == 0 {
		t.Fatalf("no Go files below %v", dirs)
	}
	return fset, files
}

// The rooms a newcomer must own stay small enough to read: in the
// dataplane packages, the collector and the aggregator, no file over 500
// lines and no function over 100 (issue #59).
func TestRoomsStaySmall(t *testing.T) {
	root := repoRoot(t)
	fset, files := sources(t, root, "dataplane", "internal/collector", "internal/aggregator")
	for name, f := range files {
		if n := fset.Position(f.End()).Line; n > 500 {
			t.Errorf("%s has %d lines: more than 500; split it by what its parts do", name, n)
		}
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil {
				continue
			}
			if n := fset.Position(fd.End()).Line - fset.Position(fd.Pos()).Line + 1; n > 100 {
				t.Errorf("%s: %s has %d lines: more than 100", name, fd.Name.Name, n)
			}
		}
	}
}

// Each mode's knowledge is in its dataplane package: the collector (the
// node agent: which reader, when to read, the budget, the stream) talks to
// no kernel interface itself, neither netlink nor raw system calls.
func TestTheCollectorReadsThroughTheDataplane(t *testing.T) {
	root := repoRoot(t)
	_, files := sources(t, root, "internal/collector")
	banned := map[string]string{
		"golang.org/x/sys/unix":           "system calls and netlink constants",
		"github.com/mdlayher/netlink":     "netlink sockets",
		"github.com/vishvananda/netlink":  "netlink sockets",
		"github.com/moby/ipvs":            "IPVS over generic netlink",
		"github.com/cilium/ebpf":          "BPF maps",
		"github.com/ti-mo/conntrack":      "conntrack over netlink",
		"github.com/google/nftables":      "nf_tables",
		"github.com/florianl/go-nflog/v2": "netfilter logging",
	}
	for name, f := range files {
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if why, ok := banned[path]; ok {
				t.Errorf("%s imports %s (%s): a mode's kernel reader belongs in its dataplane package", name, path, why)
			}
		}
	}
}

// The aggregator's unit tests wait on nobody's real time: a test steps
// its clock and waits until the goroutines it woke wait again
// (synctest.Wait), so a time.Sleep may only be the bubble's time (inside
// the function a synctest.Test runs: a collector waiting its retry-after,
// 12 s without a leader), or realTime, the harness's settle for the few
// tests that cannot run in a bubble (each says why). End-to-end files
// (*_e2e_test.go) talk to genuine processes and are left out (issue #59).
func TestAggregatorTestsSleepOnlyInBubbles(t *testing.T) {
	root := repoRoot(t)
	fset := token.NewFileSet()
	dir := filepath.Join(root, "internal/aggregator")
	err := filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() || !strings.HasSuffix(p, "_test.go") || strings.HasSuffix(p, "_e2e_test.go") {
			return err
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		for _, d := range f.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil || fd.Name.Name == "realTime" {
				continue
			}
			var bubbles []ast.Node // the functions synctest.Test runs
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				if c, ok := n.(*ast.CallExpr); ok && isCall(c, "synctest", "Test") && len(c.Args) == 2 {
					bubbles = append(bubbles, c.Args[1])
				}
				return true
			})
			ast.Inspect(fd.Body, func(n ast.Node) bool {
				c, ok := n.(*ast.CallExpr)
				if !ok || !isCall(c, "time", "Sleep") {
					return true
				}
				for _, b := range bubbles {
					if c.Pos() >= b.Pos() && c.End() <= b.End() {
						return true
					}
				}
				t.Errorf("%s:%d: %s sleeps outside a synctest bubble: wait with synctest.Wait in one (or, if it cannot run in one, use the harness's realTime and say why)",
					rel, fset.Position(c.Pos()).Line, fd.Name.Name)
				return true
			})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// isCall says whether c calls pkg.name.
func isCall(c *ast.CallExpr, pkg, name string) bool {
	s, ok := c.Fun.(*ast.SelectorExpr)
	if !ok || s.Sel.Name != name {
		return false
	}
	id, ok := s.X.(*ast.Ident)
	return ok && id.Name == pkg
}
