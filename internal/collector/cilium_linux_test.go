package collector

import (
	"context"
	"encoding/hex"
	"errors"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
)

// The reader's mechanics on real kernel maps: the genuine agent's
// captured entries (audit/testdata/cilium) loaded into BPF hash maps of
// the same sizes, pinned in a BPF filesystem of the test's own as the
// agent pins them, read back entry for entry. (That the entries mean
// what proxyaudit says is proved against cilium-dbg in audit's tests.)
func TestReadCiliumMapsFromABPFFilesystem(t *testing.T) {
	root := t.TempDir()
	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		t.Skipf("cannot mount a BPF filesystem here (%v): the reader's test needs root", err)
	}
	t.Cleanup(func() { unix.Unmount(root, 0) })

	if _, err := ReadCiliumMaps(root); err == nil || !strings.Contains(err.Error(), "--bpf-root") {
		t.Errorf("no maps pinned: %v, want an error saying where it looked and what to check", err)
	}

	b, err := os.ReadFile("../../audit/testdata/cilium/scenario/maps.json")
	if err != nil {
		t.Fatal(err)
	}
	var want []audit.CiliumMapDump
	if err := json.Unmarshal(b, &want); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "tc", "globals")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, d := range want {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: d.Name[:min(len(d.Name), 15)], Type: ebpf.Hash, KeySize: uint32(d.KeySize), ValueSize: uint32(d.ValueSize), MaxEntries: 1024})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range d.Entries {
			k, _ := hex.DecodeString(e.Key)
			v, _ := hex.DecodeString(e.Value)
			if err := m.Put(k, v); err != nil {
				t.Fatal(err)
			}
		}
		if err := m.Pin(filepath.Join(dir, d.Name)); err != nil {
			t.Fatal(err)
		}
		m.Close()
	}
	// Another of Cilium's maps beside them is not read.
	other, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 2, ValueSize: 4, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	other.Pin(filepath.Join(dir, "cilium_lb4_maglev"))
	other.Close()

	got, err := ReadCiliumMaps(root)
	if err != nil {
		t.Fatal(err)
	}
	sorted := func(ds []audit.CiliumMapDump) []audit.CiliumMapDump {
		out := slices.Clone(ds)
		for i := range out {
			out[i].Entries = slices.Clone(out[i].Entries)
			slices.SortFunc(out[i].Entries, func(a, b audit.CiliumEntry) int { return strings.Compare(a.Key, b.Key) })
		}
		slices.SortFunc(out, func(a, b audit.CiliumMapDump) int { return strings.Compare(a.Name, b.Name) })
		return out
	}
	g, w := sorted(got), sorted(want)
	gj, _ := json.Marshal(g)
	wj, _ := json.Marshal(w)
	if string(gj) != string(wj) {
		t.Errorf("read back:\n%s\npinned:\n%s", gj, wj)
	}

	// A node without kube-proxy's rules and with these maps is detected
	// as Cilium's, and read into the model the audit judges: in sync with
	// the API the agent programmed them from.
	h := &Host{HasInterface: func(string) bool { return false }, BPFFS: root, ReadCilium: ReadCiliumMaps}
	src, err := h.Detect(context.Background())
	if err != nil || src.Mode != audit.ModeCilium {
		t.Fatalf("detected %v, %v; want cilium", src, err)
	}
	obs, err := h.Reader(src).Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	cluster, err := os.ReadFile("../../audit/testdata/cilium/scenario/cluster.json")
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(cluster)
	if err != nil {
		t.Fatal(err)
	}
	if fs := audit.Diff(audit.ExpectedFor(st, "cilx"), obs); len(fs) > 0 || obs.Mode != audit.ModeCilium || len(obs.Frontends) < 10 {
		t.Errorf("read %d frontends in mode %s; findings %+v", len(obs.Frontends), obs.Mode, fs)
	}
	// The same host without the maps finds nothing, and says where
	// Cilium's would be looked for.
	h.BPFFS = t.TempDir()
	if _, err := h.Detect(context.Background()); !errors.Is(err, ErrNoKubeProxy) || !strings.Contains(err.Error(), "collector.cilium.enabled") {
		t.Errorf("no maps: %v", err)
	}
}
