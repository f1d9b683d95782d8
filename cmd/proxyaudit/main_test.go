package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/proxyaudit/proxyaudit/audit"
)

const drift = "../../audit/testdata/capture/drift/"

func TestDiffExitCodesAndJSONContract(t *testing.T) {
	var out, errb bytes.Buffer
	code := run([]string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules", "--rules", "nft-b=" + drift + "nft-b.rules", "-o", "json"}, &out, &errb)
	if code != exitFindings {
		t.Fatalf("exit %d, want 1; stderr: %s", code, errb.String())
	}
	var rep map[string]json.RawMessage
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	var fs []map[string]any
	json.Unmarshal(rep["findings"], &fs)
	if len(fs) != 11 {
		t.Fatalf("want the 11 drift findings of nft-b, got %d", len(fs))
	}
	for _, k := range []string{"node", "service", "port", "protocol", "scope", "kind", "endpoint", "detail"} {
		if _, ok := fs[0][k]; !ok {
			t.Errorf("finding lacks JSON field %q (public contract)", k)
		}
	}
	out.Reset()
	if code := run([]string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules"}, &out, &errb); code != exitClean {
		t.Fatalf("healthy node: exit %d, want 0:\n%s", code, out.String())
	}
	if !strings.Contains(out.String(), "ipt-a: in sync") {
		t.Errorf("table output: %s", out.String())
	}
}

func TestDiffBadInput(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := dir + "/" + name
		os.WriteFile(p, []byte(data), 0o644)
		return p
	}
	cases := map[string][]string{
		"no args":         {"diff"},
		"empty rules":     {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("empty", "")},
		"binary rules":    {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("bin", "\x00\x01\x02garbage")},
		"truncated nft":   {"diff", "--cluster", drift + "cluster.json", "--rules", "nft-a=" + write("trunc", `{"nftables": [{"table": {"fam`)},
		"bad iptables":    {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("ipt", "*nat\n-A KUBE-SERVICES -d 1.2.3.4/32 -p tcp --dport notaport -j X\nCOMMIT\n")},
		"not a list":      {"diff", "--cluster", write("c.json", `{"kind":"Pod"}`), "--rules", "ipt-a=" + drift + "ipt-a.rules"},
		"unknown node":    {"diff", "--cluster", drift + "cluster.json", "--rules", "nope=" + drift + "ipt-a.rules"},
		"missing file":    {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=/nonexistent"},
		"bad format flag": {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules", "-o", "xml"},
		"huge line":       {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("long", "*nat\n-A "+strings.Repeat("x", 100<<10)+"\n")},
		"bad snapshot":    {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("snap", `{"type": "report", "report": {"full": true, "frontends": [{"k": "nonsense"}]}}`)},
		"hello snapshot":  {"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + write("hello", `{"type": "hello", "hello": {"node": "x"}}`)},
	}
	for name, args := range cases {
		var out, errb bytes.Buffer
		if code := run(args, &out, &errb); code != exitUsage {
			t.Errorf("%s: exit %d, want 2", name, code)
		}
		if name != "no args" && !strings.Contains(errb.String(), "proxyaudit diff:") {
			t.Errorf("%s: error does not say what failed: %q", name, errb.String())
		}
	}
}

const ipvs = "../../audit/testdata/ipvs/"

// The collector's own snapshot of an IPVS node (captured in the VM with
// --once --snapshot) audits exactly like ipvsadm -Sn of the same table; a
// real server left at weight 0 is listed as draining, not as a finding.
func TestDiffCollectorSnapshotAndDraining(t *testing.T) {
	diff := func(dir, file string, args ...string) (string, int) {
		var out, errb bytes.Buffer
		code := run(append([]string{"diff", "--cluster", ipvs + dir + "/cluster.json", "--rules", "ipvs-a=" + ipvs + dir + "/" + file}, args...), &out, &errb)
		if errb.Len() > 0 {
			t.Errorf("%s/%s: %s", dir, file, errb.String())
		}
		return out.String(), code
	}
	// The same findings; the coverage differs only in the file named.
	findingsOf := func(out string) string {
		var rep Report
		if err := json.Unmarshal([]byte(out), &rep); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(rep.Findings)
		return string(b)
	}
	save, code := diff("drift", "ipvs-a.save", "-o", "json")
	snap, code2 := diff("drift", "ipvs-a.snapshot.json", "-o", "json")
	if code != exitFindings || code2 != exitFindings || findingsOf(save) != findingsOf(snap) {
		t.Fatalf("drift: ipvsadm -Sn (exit %d) and the collector snapshot (exit %d) differ:\n%s\n%s", code, code2, save, snap)
	}
	out, code := diff("weight0", "ipvs-a.snapshot.json")
	if code != exitClean || !strings.Contains(out, "1 IPVS real server(s) at weight 0") || !strings.Contains(out, "ipvs-a  matrix/two-slices:http/TCP  198.18.128.77:8080") {
		t.Errorf("weight0: exit %d\n%s", code, out)
	}
	out, _ = diff("weight0", "ipvs-a.save", "-o", "json")
	if !strings.Contains(out, `"draining": [`) {
		t.Errorf("weight0 JSON lacks the draining list:\n%s", out)
	}
}

// diff --conntrack: a node's conntrack -L beside its rules. A flow DNATed
// to a live endpoint is nothing; one DNATed to an address that is not an
// endpoint of the service is a StaleConntrack finding (exit 1).
func TestDiffConntrack(t *testing.T) {
	data, err := os.ReadFile(drift + "cluster.json")
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(data)
	if err != nil {
		t.Fatal(err)
	}
	var svc, ip, live string
	var port, target uint16
	for _, s := range st.Services {
		for _, p := range s.Ports {
			if p.Protocol != "UDP" || len(s.ClusterIPs) == 0 || s.Skip != "" || s.ITPLocal {
				continue
			}
			for _, sl := range s.Slices {
				for _, sp := range sl.Ports {
					if sp.Name == p.Name && sp.Protocol == "UDP" && len(sl.Endpoints) > 0 && sl.Endpoints[0].Ready && sl.Family == 4 {
						svc, ip, port, target, live = s.Namespace+"/"+s.Name, s.ClusterIPs[0].String(), uint16(p.Port), sp.Port, sl.Endpoints[0].Addr.String()
					}
				}
			}
		}
	}
	if svc == "" {
		t.Fatal("no UDP service with an IPv4 endpoint in the capture")
	}
	line := func(sport int, dest string) string {
		return fmt.Sprintf("ipv4     2 udp      17 29 src=198.18.5.5 dst=%s sport=%d dport=%d src=%s dst=198.18.5.5 sport=%d dport=%d mark=0 use=1\n", ip, sport, port, dest, target, sport)
	}
	table := t.TempDir() + "/ct.txt"
	if err := os.WriteFile(table, []byte(line(40000, live)+line(40001, "198.18.250.250")+line(40002, "198.18.250.250")), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	code := run([]string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules", "--conntrack", "ipt-a=" + table, "-o", "json"}, &out, &errb)
	if code != exitFindings {
		t.Fatalf("exit %d, want 1; stderr: %s\n%s", code, errb.String(), out.String())
	}
	var rep Report
	if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Findings) != 1 || rep.Findings[0].Kind != audit.StaleConntrack || rep.Findings[0].Service != svc || rep.Findings[0].Flows != 2 ||
		rep.Findings[0].Endpoint != fmt.Sprintf("198.18.250.250:%d", target) || !strings.Contains(rep.Findings[0].Detail, "is not an endpoint of the service") {
		t.Fatalf("findings: %+v", rep.Findings)
	}
	if rep.Summary.NodesDrifted != 0 || rep.Summary.ByKind[audit.StaleConntrack] != 1 {
		t.Errorf("a node whose rules are right is not drifted for its stale flows: %+v", rep.Summary)
	}
	// Bad input says what is wrong and what to give.
	for args, says := range map[string]string{
		"--conntrack ipt-b=" + table:                 "give the node's rules too",
		"--conntrack ipt-a=" + drift + "ipt-a.rules": "line 1",
		"--conntrack ipt-a":                          "want NODE=FILE",
	} {
		errb.Reset()
		a := append([]string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules"}, strings.Fields(args)...)
		if code := run(a, &out, &errb); code != exitUsage || !strings.Contains(errb.String(), says) {
			t.Errorf("%s: exit %d, %s", args, code, errb.String())
		}
	}
}

// A cluster dump that lacks a kind would turn into findings that are not
// there (issue #57: without EndpointSlices 32 false findings and exit 1;
// an empty List with an unknown node 19 StaleService): refused, with the
// command that captures a complete one. A dump in YAML (kubectl's -o yaml)
// is judged as its JSON is.
func TestDiffRefusesIncompleteClusters(t *testing.T) {
	dir := t.TempDir()
	full, err := os.ReadFile(drift + "cluster.json")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Kind       string           `json:"kind"`
		APIVersion string           `json:"apiVersion"`
		Items      []map[string]any `json:"items"`
	}
	if err := json.Unmarshal(full, &list); err != nil {
		t.Fatal(err)
	}
	without := func(kind string) string {
		out := list
		out.Items = nil
		for _, it := range list.Items {
			if it["kind"] != kind {
				out.Items = append(out.Items, it)
			}
		}
		b, _ := json.Marshal(out)
		p := filepath.Join(dir, "without-"+kind+".json")
		os.WriteFile(p, b, 0o644)
		return p
	}
	for name, c := range map[string]struct{ cluster, why string }{
		"no EndpointSlices": {without("EndpointSlice"), "no EndpointSlices"},
		"no Services":       {without("Service"), "no Services"},
		"no Nodes":          {without("Node"), "no Nodes"},
		"an empty List":     {filepath.Join(dir, "empty.json"), "no Nodes"},
	} {
		if name == "an empty List" {
			os.WriteFile(c.cluster, []byte(`{"kind":"List","apiVersion":"v1","items":[]}`), 0o644)
		}
		var out, errb bytes.Buffer
		code := run([]string{"diff", "--cluster", c.cluster, "--rules", "ipt-a=" + drift + "ipt-a.rules"}, &out, &errb)
		if code != exitUsage || !strings.Contains(errb.String(), c.why) || !strings.Contains(errb.String(), "kubectl get services,endpointslices,nodes -A -o json") || out.Len() != 0 {
			t.Errorf("%s: exit %d, stdout %q, stderr %q", name, code, out.String(), errb.String())
		}
	}
	// YAML: the same findings as the JSON.
	y, err := yaml.JSONToYAML(full)
	if err != nil {
		t.Fatal(err)
	}
	yp := filepath.Join(dir, "cluster.yaml")
	os.WriteFile(yp, y, 0o644)
	var fromJSON, fromYAML, errb bytes.Buffer
	cj := run([]string{"diff", "--cluster", drift + "cluster.json", "--rules", "ipt-a=" + drift + "ipt-a.rules", "-o", "json"}, &fromJSON, &errb)
	cy := run([]string{"diff", "--cluster", yp, "--rules", "ipt-a=" + drift + "ipt-a.rules", "-o", "json"}, &fromYAML, &errb)
	if cj != cy || fromJSON.String() != fromYAML.String() || fromJSON.Len() == 0 {
		t.Errorf("YAML judged otherwise: exit %d vs %d, %s", cy, cj, errb.String())
	}
}
