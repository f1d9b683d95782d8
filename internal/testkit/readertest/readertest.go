// Package readertest holds what the tests of every dataplane reader share: a
// captured cluster read back, findings compared with the golden file
// beside the capture (rewritten when the test binary's -update is set), and
// the fuzz target's check that a hostile dump costs what its size allows.
package readertest

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Cluster reads dir/cluster.json, a capture's `kubectl get -o json` list of
// Services, EndpointSlices and Nodes.
func Cluster(t testing.TB, dir string) *audit.State {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "cluster.json"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(data)
	if err != nil {
		t.Fatalf("%s: %v", dir, err)
	}
	return st
}

// Match compares fs, as indented JSON, with the file at path; with update
// it writes them there instead. A nil list is written as [].
func Match(t testing.TB, path string, fs []audit.Finding, update bool) {
	t.Helper()
	if fs == nil {
		fs = []audit.Finding{}
	}
	got, _ := json.MarshalIndent(fs, "", "  ")
	got = append(got, '\n')
	if update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run the test with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("findings differ from %s (review, then run the test with -update):\n got: %s", path, got)
	}
}

// Reading and diffing a dump may allocate at most AllocPerByte per input
// byte plus AllocBase, and take at most TimePerByte per byte plus TimeBase:
// what a hostile dump costs follows its size (the captures allocate 10-40
// bytes per byte). The time bound is loose: fuzzing machines are shared, it
// catches blowups, not slowness.
const (
	AllocPerByte = 200
	AllocBase    = 4 << 20
	TimePerByte  = 20 * time.Microsecond
	TimeBase     = 2 * time.Second
)

// Fuzz checks one reader: no panic, an error or a model whose frontends
// are sorted and unique, a diff that does not panic either, and both within
// their allocation and time bounds.
func Fuzz(f *testing.F, parse func(io.Reader) (*audit.Observed, error)) {
	st := &audit.State{Nodes: map[string]audit.NodeInfo{}}
	f.Fuzz(func(t *testing.T, data []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		start := time.Now()
		defer func() {
			took := time.Since(start)
			runtime.ReadMemStats(&after)
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > AllocBase+AllocPerByte*uint64(len(data)) {
				t.Errorf("%d input bytes allocated %d bytes (%d per byte; the bound is %d per byte)", len(data), alloc, alloc/uint64(max(len(data), 1)), AllocPerByte)
			}
			if took > TimeBase+TimePerByte*time.Duration(len(data)) {
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
			if obs.Frontends[i-1].FrontendKey.Compare(obs.Frontends[i].FrontendKey) >= 0 {
				t.Fatalf("frontends not sorted and unique at %d", i)
			}
		}
		_ = audit.Diff(audit.ExpectedFor(st, "n"), obs)
	})
}

// Seeds adds the files matching glob to f's corpus, whole and cut down to
// their first lines (small inputs keep the fuzzer fast), and extra.
func Seeds(f *testing.F, glob string, extra ...string) {
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
