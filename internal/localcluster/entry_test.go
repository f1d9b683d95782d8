package localcluster

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Up is the one way a test gets a cluster: outside this package no code
// starts a control plane (Start, StartTopology) or boots the VM (BootVM), and none runs
// an API server, etcd, a kubelet, containerd or QEMU itself. The
// exceptions say why.
func TestUpIsTheOneWayIn(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	allowed := map[string]string{
		"cmd/localcluster/main.go":            "make demo's cluster, outside a test: StartTopology, what Up starts",
		"internal/e2e/ipvs_bench_e2e_test.go": "a bare VM to run a benchmark in, no cluster (make bench-ipvs)",
	}
	started := map[string]bool{"kube-apiserver": true, "etcd": true, "kubelet": true, "containerd": true,
		"kube-controller-manager": true, "kube-scheduler": true, "qemu-system-x86_64": true}
	fset := token.NewFileSet()
	var found []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch rel {
			case ".git", ".cache", "deploy", "internal/localcluster", "bin", "demo-out":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || allowed[rel] != "" {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			pkg, _ := sel.X.(*ast.Ident)
			switch {
			case pkg != nil && pkg.Name == "localcluster" && (sel.Sel.Name == "Start" || sel.Sel.Name == "StartTopology" || sel.Sel.Name == "BootVM"):
				found = append(found, fset.Position(call.Pos()).String()+": localcluster."+sel.Sel.Name+" (use localcluster.Up)")
			case pkg != nil && pkg.Name == "exec" && (sel.Sel.Name == "Command" || sel.Sel.Name == "CommandContext"):
				for _, a := range call.Args[:min(len(call.Args), 2)] {
					if lit, ok := a.(*ast.BasicLit); ok && lit.Kind == token.STRING {
						if name, _ := strconv.Unquote(lit.Value); started[filepath.Base(name)] {
							found = append(found, fset.Position(call.Pos()).String()+": runs "+name+" (the local cluster's to start)")
						}
					}
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range found {
		t.Error(f)
	}
	if len(found) == 0 {
		t.Logf("no cluster started outside localcluster.Up (exceptions: %v)", allowed)
	}
}
