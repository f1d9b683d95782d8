package cilium

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// The reader's mechanics on real kernel maps: the genuine agent's
// captured entries (testdata/) loaded into BPF hash maps of
// the same sizes, pinned in a BPF filesystem of the test's own as the
// agent pins them, read back entry for entry. (That the entries mean
// what proxyaudit says is proved against cilium-dbg in audit's tests.)
func TestReadCiliumMapsFromABPFFilesystem(t *testing.T) {
	root := t.TempDir()
	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		t.Skipf("cannot mount a BPF filesystem here (%v): the reader's test needs root", err)
	}
	t.Cleanup(func() { unix.Unmount(root, 0) })

	if _, err := Read(root); err == nil || !strings.Contains(err.Error(), "--bpf-root") {
		t.Errorf("no maps pinned: %v, want an error saying where it looked and what to check", err)
	}

	b, err := os.ReadFile("testdata/scenario/maps.json")
	if err != nil {
		t.Fatal(err)
	}
	var want []MapDump
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	if err := Pin(root, want); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, Globals)
	// Another of Cilium's maps beside them is not read.
	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 2, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	other.Pin(filepath.Join(dir, "cilium_lb4_maglev"))
	other.Close()

	got, err := Read(root)
	if err != nil {
		t.Fatal(err)
	}
	for i := range got {
		if got[i].Packed == nil && len(got[i].Entries) == 0 && got[i].Name != "" {
			t.Errorf("%s read as nothing", got[i].Name)
		}
		got[i] = got[i].WithEntries()
	}
	sorted := func(ds []MapDump) []MapDump {
		out := slices.Clone(ds)
		for i := range out {
			out[i].Entries = slices.Clone(out[i].Entries)
			slices.SortFunc(out[i].Entries, func(a, b Entry) int { return strings.Compare(a.Key, b.Key) })
		}
		slices.SortFunc(out, func(a, b MapDump) int { return strings.Compare(a.Name, b.Name) })
		return out
	}
	g, w := sorted(got), sorted(want)
	gj, _ := json.Marshal(g)
	wj, _ := json.Marshal(w)
	if string(gj) != string(wj) {
		t.Errorf("read back:\n%s\npinned:\n%s", gj, wj)
	}
}
