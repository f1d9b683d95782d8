package dataplane_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/testkit/readertest"
)

// Each dump is read by its mode's reader, known by content alone, and
// read as that mode's own reader reads it.
func TestParseRulesKnowsEachFormat(t *testing.T) {
	for path, mode := range map[string]audit.Mode{
		"../audit/testdata/capture/clean/ipt-a.rules": audit.ModeIPTables,
		"../audit/testdata/capture/clean/nft-a.rules": audit.ModeNFTables,
		"../audit/testdata/ipvs/clean/ipvs-a.save":    audit.ModeIPVS,
		"../audit/testdata/ipvs/clean/ipvs-a.list":    audit.ModeIPVS,
		"cilium/testdata/scenario/maps.json":          audit.ModeCilium,
	} {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		obs, err := dataplane.ParseRules(bytes.NewReader(data))
		if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		if obs.Mode != mode || len(obs.Frontends) == 0 {
			t.Errorf("%s: read as %q with %d frontends, want %q", path, obs.Mode, len(obs.Frontends), mode)
		}
	}
}

// A Cilium node's maps dump is judged like any dump: the frozen agent's
// four findings.
func TestCiliumDumpJudgedThroughParseRules(t *testing.T) {
	st := readertest.Cluster(t, "cilium/testdata/frozen")
	f, err := os.Open("cilium/testdata/frozen/maps.json")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	obs, err := dataplane.ParseRules(f)
	if err != nil {
		t.Fatal(err)
	}
	if fs := audit.Diff(audit.ExpectedFor(st, "cilx"), obs); len(fs) != 4 {
		t.Errorf("frozen dump through ParseRules: %+v", fs)
	}
}

// What is none of the formats is refused saying what each looks like;
// a format's own errors come through (a malformed Cilium dump).
func TestParseRulesRefusesWhatItCannotRead(t *testing.T) {
	for in, says := range map[string]string{
		"":                       "rules input is empty",
		" \n\t\n":                "rules input is empty",
		"hello world\n":          `line 1: "hello world" is not the start of iptables-save output`,
		"Chain KUBE-SERVICES\n":  `not the start of iptables-save output ("*nat"), nft JSON ("{"), ipvsadm output`,
		strings.Repeat("x", 200): "…",
		`[1, 2]`:                 "a JSON list of maps",
		`[{"name": "cilium_lb4_backends_v3", "keySize": 4, "valueSize": 12}]`: "no services map",
	} {
		obs, err := dataplane.ParseRules(strings.NewReader(in))
		if err == nil || !strings.Contains(err.Error(), says) || obs != nil {
			t.Errorf("%.40q: %v (model %v), want an error saying %q", in, err, obs != nil, says)
		}
	}
}

// FuzzParseRules: format detection routes every input to a reader without
// panicking; an error comes without a model, a model can be judged. (Each
// reader's own fuzz target bounds its costs: audit/fuzz_test.go,
// dataplane/cilium.)
func FuzzParseRules(f *testing.F) {
	paths, _ := filepath.Glob("../audit/testdata/capture/clean/*.rules")
	for _, p := range paths {
		if data, err := os.ReadFile(p); err == nil && len(data) < 64<<10 {
			f.Add(data)
		}
	}
	for _, s := range []string{"*nat\nCOMMIT\n", `{"nftables": []}`, "IP Virtual Server version 1.2.1 (size=4096)\n", "-A -t 1.2.3.4:80 -s rr\n", `[]`} {
		f.Add([]byte(s))
	}
	st := &audit.State{Nodes: map[string]audit.NodeInfo{}}
	f.Fuzz(func(t *testing.T, data []byte) {
		obs, err := dataplane.ParseRules(bytes.NewReader(data))
		if err != nil {
			if obs != nil {
				t.Fatal("a model returned with an error")
			}
			return
		}
		_ = audit.Diff(audit.ExpectedFor(st, "n"), obs)
	})
}
