package collector

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ReadCiliumMaps reads Cilium's LB maps pinned under the BPF filesystem
// root bpffs (tc/globals/…), read-only: the maps are opened with
// BPF_F_RDONLY and only iterated. A family whose maps are absent (IPv6
// off) is left out; no services map at all is an error saying where it
// looked.
func ReadCiliumMaps(bpffs string) ([]audit.CiliumMapDump, error) {
	dir := filepath.Join(bpffs, ciliumGlobals)
	var out []audit.CiliumMapDump
	services := false
	for _, name := range audit.CiliumMapNames {
		m, err := ebpf.LoadPinnedMap(filepath.Join(dir, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("opening Cilium's map %s read-only: %w (the collector needs CAP_BPF or root and the node's BPF filesystem mounted)", filepath.Join(dir, name), err)
		}
		d, err := dumpMap(m, name)
		m.Close()
		if err != nil {
			return nil, err
		}
		services = services || name == audit.CiliumServices4 || name == audit.CiliumServices6
		out = append(out, d)
	}
	if !services {
		return nil, fmt.Errorf("no Cilium service map (%s or %s) in %s: is Cilium's kube-proxy replacement running on this node, and is %s the BPF filesystem it pins to (cilium-agent --bpf-root)?",
			audit.CiliumServices4, audit.CiliumServices6, dir, bpffs)
	}
	return out, nil
}

func dumpMap(m *ebpf.Map, name string) (audit.CiliumMapDump, error) {
	d := audit.CiliumMapDump{Name: name, KeySize: int(m.KeySize()), ValueSize: int(m.ValueSize())}
	var k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		d.Entries = append(d.Entries, audit.CiliumEntry{Key: hex.EncodeToString(k), Value: hex.EncodeToString(v)})
	}
	if err := it.Err(); err != nil {
		return d, fmt.Errorf("reading Cilium's map %s: %w", name, err)
	}
	return d, nil
}
