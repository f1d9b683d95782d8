package audit_test

import (
	"bytes"
	"encoding/json"
	"flag"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// The conformance tests: dumps captured from genuine kube-proxy and
// judged end to end, each read as `proxyaudit diff` reads it (the format
// known by its content, dataplane.ParseRules).

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

func loadState(t testing.TB, dir string) *audit.State {
	return readertest.Cluster(t, filepath.Join("testdata", "capture", dir))
}

// readRules reads a rule dump as `proxyaudit diff` does.
func readRules(t testing.TB, path string) *audit.Observed {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	obs, err := dataplane.ParseRules(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return obs
}

func auditFile(t testing.TB, st *audit.State, node, path string) []audit.Finding {
	t.Helper()
	return audit.Diff(audit.ExpectedFor(st, node), readRules(t, path))
}

func checkGolden(t *testing.T, path string, fs []audit.Finding) {
	t.Helper()
	readertest.Match(t, path, fs, *update)
}

// TestCapturedFixtures audits every node of every capture. Healthy nodes
// must yield no finding at all; the drifted nodes (ipt-b, nft-b in drift)
// exactly the golden findings.
func TestCapturedFixtures(t *testing.T) {
	for _, root := range capturedRoots(t) {
		for _, dir := range captures {
			st := readertest.Cluster(t, filepath.Join(root, dir))
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
	strip := func(fs []audit.Finding) []audit.Finding {
		out := make([]audit.Finding, len(fs))
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
		st := readertest.Cluster(t, filepath.Join(root, dir))
		var obs [2]*audit.Observed
		for i, name := range []string{"ipvs-a.save", "ipvs-a.list"} {
			obs[i] = readRules(t, filepath.Join(root, dir, name))
		}
		exp := audit.ExpectedFor(st, "ipvs-a")
		save, list := audit.Diff(exp, obs[0]), audit.Diff(exp, obs[1])
		js, _ := json.Marshal(save)
		jl, _ := json.Marshal(list)
		if !bytes.Equal(js, jl) {
			t.Fatalf("%s: ipvsadm -Sn and -Ln disagree:\n%s\n%s", dir, js, jl)
		}
		switch draining := audit.Draining(exp, obs[0]); dir {
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
		obs, err := dataplane.ParseRules(strings.NewReader(dump))
		if err != nil {
			t.Fatal(name, err)
		}
		fs := audit.Diff(audit.ExpectedFor(st, "ipt-a"), obs)
		if len(fs) != 1 || fs[0].Kind != audit.NoRules {
			t.Fatalf("%s: want one NoRules finding, got %+v", name, fs)
		}
	}
}

// Captures of genuine kube-proxy on a dual-stack cluster (iptables, both
// backends, nftables, and IPVS in the VM; make fixtures): the pinned
// release's in testdata/dualstack, another release's in
// testdata/k8s/vX.Y/dualstack (make fixtures K8S_VERSION=…). In sync in
// both families, IPv6 node ports and cluster IPs read; in the drift
// captures ds-nft's kube-proxy was frozen while an IPv6 endpoint moved and
// a dual-stack service appeared, and ds-ipvs's cut off from the API while
// an IPv6 endpoint left: their findings are golden.
func TestDualStackCaptures(t *testing.T) {
	roots, err := filepath.Glob(filepath.Join("testdata", "k8s", "*", "dualstack"))
	if err != nil {
		t.Fatal(err)
	}
	for _, root := range append([]string{filepath.Join("testdata", "dualstack")}, roots...) {
		dualStackCaptures(t, root)
	}
}

func dualStackCaptures(t *testing.T, root string) {
	for dir, nodes := range map[string][]string{
		"clean": {"ds-ipt", "ds-legacy", "ds-nft"}, "drift": {"ds-ipt", "ds-legacy", "ds-nft"},
		"ipvs-clean": {"ds-ipvs"}, "ipvs-drift": {"ds-ipvs"},
	} {
		st := readertest.Cluster(t, filepath.Join(root, dir))
		for _, node := range nodes {
			t.Run(filepath.Join(root, dir, node), func(t *testing.T) {
				path := filepath.Join(root, dir, node+".rules")
				obs := readRules(t, path)
				v6 := map[bool]int{}
				for _, fe := range obs.Frontends {
					// IPVS serves a node port by a virtual server per node
					// address: the node's own.
					if fe.Family() == 6 {
						v6[fe.NodePort || fe.IP == netip.MustParseAddr("2001:2:0:40::15")]++
					}
				}
				if !slices.Equal(obs.Families, []int{4, 6}) || v6[true] == 0 || v6[false] == 0 {
					t.Fatalf("families %v; IPv6 frontends: %d node ports, %d by address", obs.Families, v6[true], v6[false])
				}
				fs := audit.Diff(audit.ExpectedFor(st, node), obs)
				if strings.HasSuffix(dir, "drift") && (node == "ds-nft" || node == "ds-ipvs") {
					checkGolden(t, strings.TrimSuffix(path, ".rules")+".findings.json", fs)
					return
				}
				if len(fs) > 0 {
					t.Fatalf("false findings on a healthy node: %+v", fs)
				}
			})
		}
	}
}
