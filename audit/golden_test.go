package audit

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden findings under testdata/")

// captures lists every fixture directory captured from genuine kube-proxy
// 1.36 (internal/e2e, make fixtures) and the nodes in it; capturedRoots
// are where they are, the pinned release's and each other release's
// (make fixtures K8S_VERSION=vX.Y.Z: testdata/k8s/vX.Y/capture).
var captures = []string{"clean", "drift", "large"}
var captureNodes = []string{"ipt-a", "ipt-b", "nft-a", "nft-b"}

func capturedRoots(t testing.TB) []string {
	others, err := filepath.Glob(filepath.Join("testdata", "k8s", "v1.*", "capture"))
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{filepath.Join("testdata", "capture")}, others...)
}

func loadState(t testing.TB, dir string) *State {
	return loadCluster(t, filepath.Join("testdata", "capture", dir))
}

// loadCluster reads dir/cluster.json.
func loadCluster(t testing.TB, dir string) *State {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "cluster.json"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := ParseClusterList(data)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func auditFile(t testing.TB, st *State, node, path string) []Finding {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	obs, err := ParseRules(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return Diff(ExpectedFor(st, node), obs)
}

func checkGolden(t *testing.T, path string, fs []Finding) {
	t.Helper()
	if fs == nil {
		fs = []Finding{}
	}
	got, _ := json.MarshalIndent(fs, "", "  ")
	got = append(got, '\n')
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./audit -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("findings differ from %s (review, then go test ./audit -update):\n got: %s", path, got)
	}
}

// TestCapturedFixtures audits every node of every capture. Healthy nodes
// must yield no finding at all; the drifted nodes (ipt-b, nft-b in drift)
// exactly the golden findings.
func TestCapturedFixtures(t *testing.T) {
	for _, root := range capturedRoots(t) {
		for _, dir := range captures {
			st := loadCluster(t, filepath.Join(root, dir))
			for _, node := range captureNodes {
				t.Run(filepath.Join(root, dir, node), func(t *testing.T) {
					fs := auditFile(t, st, node, filepath.Join(root, dir, node+".rules"))
					drifted := dir == "drift" && (node == "ipt-b" || node == "nft-b")
					if !drifted && len(fs) > 0 {
						t.Fatalf("false findings on a healthy node: %+v", fs)
					}
					if drifted {
						checkGolden(t, filepath.Join(root, dir, node+".findings.json"), fs)
					}
				})
			}
		}
	}
}

// TestDriftSameAcrossModes: the same hung informer gives the same findings
// whether kube-proxy writes iptables (legacy backend) or nftables rules,
// apart from the rule names in the details.
func TestDriftSameAcrossModes(t *testing.T) {
	st := loadState(t, "drift")
	strip := func(fs []Finding) []Finding {
		out := make([]Finding, len(fs))
		for i, f := range fs {
			f.Node, f.Detail = "", ""
			out[i] = f
		}
		return out
	}
	a := strip(auditFile(t, st, "ipt-b", "testdata/capture/drift/ipt-b.rules"))
	b := strip(auditFile(t, st, "nft-b", "testdata/capture/drift/nft-b.rules"))
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	if !bytes.Equal(ja, jb) || len(a) == 0 {
		t.Fatalf("iptables and nftables drift differ:\n%s\n%s", ja, jb)
	}
}

// TestLargeClusterModeHasNoComments proves the large capture exercises
// kube-proxy's large-cluster mode, which the clean audit above survives.
func TestLargeClusterModeHasNoComments(t *testing.T) {
	data, err := os.ReadFile("testdata/capture/large/ipt-a.rules")
	if err != nil {
		t.Fatal(err)
	}
	// kube-proxy drops comments from the chains it writes once past 1,000
	// endpoints; chains it does not rewrite keep theirs.
	bulk := 0
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "-A KUBE-SEP-") && strings.Contains(line, "--to-destination 198.18.13") {
			bulk++
			if strings.Contains(line, "--comment") {
				t.Fatalf("large-cluster-mode SEP rule still has a comment: %s", line)
			}
		}
	}
	if bulk <= 1000 {
		t.Fatalf("large capture has %d bulk endpoints, want > 1000", bulk)
	}
}

// TestIPVSFixtures audits the IPVS tables captured from genuine
// kube-proxy 1.36 (and other releases', audit/testdata/k8s/vX.Y/ipvs) in --proxy-mode ipvs in the VM (internal/e2e
// TestE2EIPVS, make fixtures): ipvsadm -Sn and -Ln of each give the same
// findings; the clean matrix has none, the hung informer's drift the
// golden ones, and the table with a real server left at weight 0 none
// from Diff but that one real server draining.
func TestIPVSFixtures(t *testing.T) {
	others, err := filepath.Glob(filepath.Join("testdata", "k8s", "v1.*", "ipvs"))
	if err != nil {
		t.Fatal(err)
	}
	for _, root := range append([]string{filepath.Join("testdata", "ipvs")}, others...) {
		t.Run(root, func(t *testing.T) { ipvsFixtures(t, root) })
	}
}

// ipvsFixtures judges one capture of TestE2EIPVS (its clean, drift and
// weight0 tables).
func ipvsFixtures(t *testing.T, root string) {
	for _, dir := range []string{"clean", "drift", "weight0"} {
		data, err := os.ReadFile(filepath.Join(root, dir, "cluster.json"))
		if err != nil {
			t.Fatal(err)
		}
		st, err := ParseClusterList(data)
		if err != nil {
			t.Fatal(err)
		}
		var obs [2]*Observed
		for i, name := range []string{"ipvs-a.save", "ipvs-a.list"} {
			f, err := os.Open(filepath.Join(root, dir, name))
			if err != nil {
				t.Fatal(err)
			}
			obs[i], err = ParseRules(f)
			f.Close()
			if err != nil {
				t.Fatalf("%s/%s: %v", dir, name, err)
			}
		}
		exp := ExpectedFor(st, "ipvs-a")
		save, list := Diff(exp, obs[0]), Diff(exp, obs[1])
		js, _ := json.Marshal(save)
		jl, _ := json.Marshal(list)
		if !bytes.Equal(js, jl) {
			t.Fatalf("%s: ipvsadm -Sn and -Ln disagree:\n%s\n%s", dir, js, jl)
		}
		switch draining := Draining(exp, obs[0]); dir {
		case "clean":
			if len(save) != 0 || len(draining) != 0 {
				t.Errorf("clean: %+v, draining %+v", save, draining)
			}
		case "weight0":
			if len(save) != 0 || len(draining) != 1 || draining[0].Endpoint != "198.18.128.77:8080" {
				t.Errorf("weight0: %+v, draining %+v", save, draining)
			}
		case "drift":
			checkGolden(t, filepath.Join(root, dir, "ipvs-a.findings.json"), save)
		}
	}
}

// TestFlushedTable: a dump with the dispatch gone is one NoRules finding.
func TestFlushedTable(t *testing.T) {
	st := loadState(t, "clean")
	for name, dump := range map[string]string{
		"iptables": "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\nCOMMIT\n",
		"nftables": `{"nftables": [{"metainfo": {"json_schema_version": 1}}, {"table": {"family": "ip", "name": "kube-proxy", "handle": 3}}]}`,
	} {
		obs, err := ParseRules(strings.NewReader(dump))
		if err != nil {
			t.Fatal(name, err)
		}
		fs := Diff(ExpectedFor(st, "ipt-a"), obs)
		if len(fs) != 1 || fs[0].Kind != NoRules {
			t.Fatalf("%s: want one NoRules finding, got %+v", name, fs)
		}
	}
}
