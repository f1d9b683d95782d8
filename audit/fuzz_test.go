package audit

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// seeds adds the rule dumps matching glob, whole and cut down to their
// first lines (small inputs keep the fuzzer fast), plus extra.
func seeds(f *testing.F, glob string, extra ...string) {
	paths, _ := filepath.Glob(glob)
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		f.Add(data)
		if len(data) > 2048 {
			cut := data[:2048]
			if i := bytes.LastIndexByte(cut, '\n'); i > 0 {
				cut = cut[:i+1]
			}
			f.Add(cut)
		}
	}
	for _, e := range extra {
		f.Add([]byte(e))
	}
}

// Reading and diffing a dump may allocate at most allocPerByte per input
// byte plus allocBase, and take at most timePerByte per byte plus
// timeBase: what a hostile dump costs follows its size (the captures
// allocate 10-40 bytes per byte; a dump pointing n frontends at one chain
// of n endpoints used to allocate n² of them). The time bound is loose:
// fuzzing machines are shared, it catches blowups, not slowness.
const (
	allocPerByte = 200
	allocBase    = 4 << 20
	timePerByte  = 20 * time.Microsecond
	timeBase     = 2 * time.Second
)

// fuzzReader checks one reader: no panic, an error or a model whose
// invariants hold, a diff that does not panic either, and both within
// their allocation and time bounds.
func fuzzReader(f *testing.F, parse func(io.Reader) (*Observed, error)) {
	st := &State{Nodes: map[string]NodeInfo{}}
	f.Fuzz(func(t *testing.T, data []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		defer func() {
			took := time.Since(start)
			runtime.ReadMemStats(&after)
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > allocBase+allocPerByte*uint64(len(data)) {
				t.Errorf("%d input bytes allocated %d bytes (%d per byte; the bound is %d per byte)", len(data), alloc, alloc/uint64(max(len(data), 1)), allocPerByte)
			}
			if took > timeBase+timePerByte*time.Duration(len(data)) {
				t.Errorf("%d input bytes took %s", len(data), took)
			}
		}()
		obs, err := parse(bytes.NewReader(data))
		if err != nil {
			if obs != nil {
				t.Fatal("a model returned with an error")
			}
			return
		}
		for i := 1; i < len(obs.Frontends); i++ {
			if !obs.Frontends[i-1].FrontendKey.less(obs.Frontends[i].FrontendKey) {
				t.Fatalf("frontends not sorted and unique at %d", i)
			}
		}
		_ = Diff(ExpectedFor(st, "n"), obs)
	})
}

func FuzzParseIPTables(f *testing.F) {
	seeds(f, "testdata/capture/clean/ipt-*.rules",
		"*nat\n-A KUBE-SERVICES -d 1.2.3.4/32 -p tcp --dport 80 -j KUBE-SVC-X\n-A KUBE-SVC-X -j KUBE-SEP-Y\n-A KUBE-SEP-Y -p tcp -j DNAT --to-destination 5.6.7.8:80\nCOMMIT\n",
		"*nat\n:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]\n-A KUBE-SEP-AAAAAAAAAAAAAAAA -j DNAT --to-destination [fd00::1]:80\n")
	f.Add(sharedChainIPTables(600))
	fuzzReader(f, ParseIPTables)
}

func FuzzParseNFTables(f *testing.F) {
	seeds(f, "testdata/capture/clean/nft-*.rules", `{"nftables": []}`, `{"nftables": [{"map": {"family": "ip", "table": "kube-proxy", "name": "service-ips", "elem": [[{"concat": ["1.2.3.4", "tcp", 80]}, {"goto": {"target": "service-X"}}]]}}]}`)
	f.Add(sharedChainNFT(1000))
	fuzzReader(f, ParseNFTables)
}

func FuzzParseIPVS(f *testing.F) {
	seeds(f, "testdata/ipvs/*/ipvs-a.save")
	seeds(f, "testdata/ipvs/*/ipvs-a.list", "-A -t 1.2.3.4:80 -s rr -p 600\n-a -t 1.2.3.4:80 -r 5.6.7.8:80 -m -w 0\n")
	fuzzReader(f, ParseIPVS)
}

// FuzzParseRules: format detection routes every input to a reader without
// panicking.
func FuzzParseRules(f *testing.F) {
	seeds(f, "testdata/capture/clean/*.rules", "*nat\nCOMMIT\n", `{"nftables": []}`, "IP Virtual Server version 1.2.1 (size=4096)\n")
	fuzzReader(f, ParseRules)
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
