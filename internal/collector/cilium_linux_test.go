package collector

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/cilium"
)

// A node without kube-proxy's rules whose BPF filesystem holds Cilium's
// service maps (the genuine agent's capture, pinned into real kernel maps
// in a BPF filesystem of the test's own) is detected as Cilium's, and
// read into the model the audit judges: in sync with the API the agent
// programmed them from. Without the maps the error says where Cilium's
// would be looked for.
func TestDetectAndReadCiliumMaps(t *testing.T) {
	root := t.TempDir()
	if err := unix.Mount("bpf", root, "bpf", 0, ""); err != nil {
		t.Skipf("cannot mount a BPF filesystem here (%v): the reader's test needs root", err)
	}
	t.Cleanup(func() { unix.Unmount(root, 0) })
	b, err := os.ReadFile("../../dataplane/cilium/testdata/scenario/maps.json")
	if err != nil {
		t.Fatal(err)
	}
	var dumps []cilium.MapDump
	if err := json.Unmarshal(b, &dumps); err != nil {
		t.Fatal(err)
	}
	if err := cilium.Pin(root, dumps); err != nil {
		t.Fatal(err)
	}
	h := &Host{HasInterface: func(string) bool { return false }, BPFFS: root, ReadCilium: cilium.Read}
	src, err := h.Detect(context.Background())
	if err != nil || src.Mode != audit.ModeCilium {
		t.Fatalf("detected %v, %v; want cilium", src, err)
	}
	obs, err := h.Reader(src).Read(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	cluster, err := os.ReadFile("../../dataplane/cilium/testdata/scenario/cluster.json")
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
	h.BPFFS = t.TempDir()
	if _, err := h.Detect(context.Background()); !errors.Is(err, ErrNoKubeProxy) || !strings.Contains(err.Error(), "cilium.enabled") {
		t.Errorf("no maps: %v", err)
	}
}
