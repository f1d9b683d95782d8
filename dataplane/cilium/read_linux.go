package cilium

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// Read reads Cilium's LB maps pinned under the BPF filesystem
// root bpffs (tc/globals/…), read-only: the maps are opened with
// BPF_F_RDONLY and only looked up, in batches. A family whose maps are absent (IPv6
// off) is left out; no services map at all is an error saying where it
// looked.
func Read(bpffs string) ([]MapDump, error) {
	dir := filepath.Join(bpffs, Globals)
	var out []MapDump
	services := false
	for _, name := range MapNames {
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
		services = services || name == Services4 || name == Services6
		out = append(out, d)
	}
	if !services {
		return nil, fmt.Errorf("no Cilium service map (%s or %s) in %s: is Cilium's kube-proxy replacement running on this node, and is %s the BPF filesystem it pins to (cilium-agent --bpf-root)?",
			Services4, Services6, dir, bpffs)
	}
	return out, nil
}

// Pin writes dumps as Cilium's agent pins its maps: hash maps of the
// dumps' sizes under bpffs/tc/globals, for tests and for replaying a
// capture into a kernel.
func Pin(bpffs string, dumps []MapDump) error {
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

func dumpMap(m *ebpf.Map, name string) (MapDump, error) {
	d := MapDump{Name: name, KeySize: int(m.KeySize()), ValueSize: int(m.ValueSize())}
	var err error
	switch [2]int{d.KeySize, d.ValueSize} {
	// The layouts proxyaudit reads (audit's layouts), in batches:
	// two system calls per entry when iterated, one per thousands here.
	case [2]int{12, 12}:
		d.Packed, err = readBatch[[12]byte, [12]byte](m)
	case [2]int{24, 12}:
		d.Packed, err = readBatch[[24]byte, [12]byte](m)
	case [2]int{4, 12}:
		d.Packed, err = readBatch[[4]byte, [12]byte](m)
	case [2]int{4, 24}:
		d.Packed, err = readBatch[[4]byte, [24]byte](m)
	case [2]int{2, 6}:
		d.Packed, err = readBatch[[2]byte, [6]byte](m)
	case [2]int{2, 18}:
		d.Packed, err = readBatch[[2]byte, [18]byte](m)
	default:
		err = ebpf.ErrNotSupported // audit refuses the layout by name
	}
	if errors.Is(err, ebpf.ErrNotSupported) || errors.Is(err, unix.EINVAL) {
		// A kernel before batch lookups (5.6), or another layout: one
		// entry at a time.
		d.Packed, err = iterate(m)
	}
	if err != nil {
		return d, fmt.Errorf("reading Cilium's map %s: %w", name, err)
	}
	return d, nil
}

// batchSize is how many entries one lookup asks for.
const batchSize = 4096

// readBatch reads every entry of a hash map of K-byte keys and V-byte
// values (byte arrays) with BPF_MAP_LOOKUP_BATCH, packed as audit's
// MapDump.Packed holds them. A map the agent writes meanwhile may
// show an entry twice or miss one, as iteration may.
func readBatch[K, V any](m *ebpf.Map) ([]byte, error) {
	keys, vals := make([]K, batchSize), make([]V, batchSize)
	ks, vs := int(unsafe.Sizeof(keys[0])), int(unsafe.Sizeof(vals[0]))
	// Room for a full map (Cilium's default 65536 services entries are
	// 1.5 MB), at most 64 MiB up front.
	out := make([]byte, 0, min(int(m.MaxEntries())*(ks+vs), 64<<20))
	var cursor ebpf.MapBatchCursor
	for {
		n, err := m.BatchLookup(&cursor, keys, vals, nil)
		for i := range n {
			out = append(out, unsafe.Slice((*byte)(unsafe.Pointer(&keys[i])), ks)...)
			out = append(out, unsafe.Slice((*byte)(unsafe.Pointer(&vals[i])), vs)...)
		}
		if errors.Is(err, ebpf.ErrKeyNotExist) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

// iterate reads every entry one at a time (BPF_MAP_GET_NEXT_KEY and a
// lookup each).
func iterate(m *ebpf.Map) ([]byte, error) {
	var out, k, v []byte
	it := m.Iterate()
	for it.Next(&k, &v) {
		out = append(append(out, k...), v...)
	}
	return out, it.Err()
}
