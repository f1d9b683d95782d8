// Package golden holds what the conformance tests of every room share: a
// captured cluster read back, and findings compared with the golden file
// beside the capture (rewritten when the test binary's -update is set).
package golden

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

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
