// Package ciliummaps reads Cilium's LB maps pinned in a BPF filesystem,
// read-only, for the collector (and the local cluster's waits).
package ciliummaps

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cilium/ebpf"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Read reads Cilium's LB maps pinned under the BPF filesystem
// root bpffs (tc/globals/…), read-only: the maps are opened with
// BPF_F_RDONLY and only iterated. A family whose maps are absent (IPv6
// off) is left out; no services map at all is an error saying where it
// looked.
func Read(bpffs string) ([]audit.CiliumMapDump, error) {
	dir := filepath.Join(bpffs, Globals)
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

// Pin writes dumps as Cilium's agent pins its maps: hash maps of the
// dumps' sizes under bpffs/tc/globals, for tests and for replaying a
// capture into a kernel.
func Pin(bpffs string, dumps []audit.CiliumMapDump) error {
	dir := filepath.Join(bpffs, Globals)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, d := range dumps {
		m, err := ebpf.NewMap(&ebpf.MapSpec{Name: d.Name[:min(len(d.Name), 15)], Type: ebpf.Hash, KeySize: uint32(d.KeySize), ValueSize: uint32(d.ValueSize),
			MaxEntries: uint32(max(len(d.Entries), 1))})
		if err != nil {
			return fmt.Errorf("make map %s: %w", d.Name, err)
		}
		for _, e := range d.Entries {
			k, err1 := hex.DecodeString(e.Key)
			v, err2 := hex.DecodeString(e.Value)
			if err := errors.Join(err1, err2); err != nil {
				m.Close()
				return fmt.Errorf("map %s: %w", d.Name, err)
			}
			if err := m.Put(k, v); err != nil {
				m.Close()
				return fmt.Errorf("map %s: %w", d.Name, err)
			}
		}
		err = m.Pin(filepath.Join(dir, d.Name))
		m.Close()
		if err != nil {
			return err
		}
	}
	return nil
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
