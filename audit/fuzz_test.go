package audit

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func seedRules(f *testing.F) {
	paths, _ := filepath.Glob("testdata/capture/clean/*.rules")
	ipvs, _ := filepath.Glob("testdata/ipvs/ipvs-a.*")
	for _, p := range append(paths, ipvs...) {
		if strings.HasSuffix(p, ".findings.json") {
			continue // golden output, not a rule dump
		}
		data, err := os.ReadFile(p)
		if err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte("*nat\n-A KUBE-SERVICES -d 1.2.3.4/32 -p tcp --dport 80 -j KUBE-SVC-X\nCOMMIT\n"))
	f.Add([]byte(`{"nftables": []}`))
	f.Add([]byte("-A -t 1.2.3.4:80 -s rr\n-a -t 1.2.3.4:80 -r 5.6.7.8:80 -m -w 1\n"))
}

// FuzzParseRules: no input makes a reader panic, and whatever parses can be
// diffed.
func FuzzParseRules(f *testing.F) {
	seedRules(f)
	st := &State{Nodes: map[string]NodeInfo{}}
	f.Fuzz(func(t *testing.T, data []byte) {
		obs, err := ParseRules(bytes.NewReader(data))
		if err != nil {
			return
		}
		_ = Diff(ExpectedFor(st, "n"), obs)
	})
}

// FuzzParseClusterList: malformed cluster dumps give errors, never panics.
func FuzzParseClusterList(f *testing.F) {
	if data, err := os.ReadFile("testdata/capture/clean/cluster.json"); err == nil {
		f.Add(data)
	}
	f.Add([]byte(`{"kind":"List","items":[{"kind":"Service"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := ParseClusterList(data)
		if err != nil {
			return
		}
		for n := range st.Nodes {
			_ = ExpectedFor(st, n)
		}
	})
}
