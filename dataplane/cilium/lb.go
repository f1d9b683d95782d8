// Package cilium is Cilium's dataplane where it replaces kube-proxy: its LB
// maps read from a BPF filesystem (Read, Linux only, read-only) or from a
// dump of them (ParseMaps), decoded by Cilium's own layouts (Decode) and
// reduced to the audit's model (LB.Observed).
package cilium

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Cilium's load-balancing maps (issue #42, first part: reading them). With
// kube-proxy replaced, Cilium's agent programs services as entries of
// pinned BPF hash maps under the BPF filesystem's tc/globals/:
//
//   - cilium_lb4_services_v2 / cilium_lb6_services_v2: per frontend
//     (address, port, protocol, scope) a master entry (slot 0: the counts,
//     flags and reverse-NAT index) and one entry per backend slot (1..n,
//     the backend's ID);
//   - cilium_lb4_backends_v3 / cilium_lb6_backends_v3: backend ID → address,
//     port, protocol, state (active, terminating, quarantined,
//     maintenance), cluster ID and zone;
//   - cilium_lb4_reverse_nat / cilium_lb6_reverse_nat: reverse-NAT index →
//     the frontend's address and port.
//
// The layouts are Cilium's own (pkg/loadbalancer/maps/types.go, bpf/lib/lb.h
// of v1.18–v1.20), known by map name and key and value sizes: a map of
// another size is an error naming it, never guessed at. Addresses and
// ports are in network byte order, the rest in the host's.

// MapDump is one pinned map's raw entries, as the collector reads
// them (Packed) and as dumps and fixtures captured from the genuine agent
// hold them (Entries, in hex).
type MapDump struct {
	Name      string  `json:"name"`
	KeySize   int     `json:"keySize"`
	ValueSize int     `json:"valueSize"`
	Entries   []Entry `json:"entries"`
	// Packed, when not nil, holds the entries instead of Entries: each
	// key and its value back to back, KeySize+ValueSize bytes an entry.
	Packed []byte `json:"-"`
}

// WithEntries returns d with its packed entries (if any) as Entries, for
// JSON.
func (d MapDump) WithEntries() MapDump {
	if d.Packed == nil {
		return d
	}
	size := d.KeySize + d.ValueSize
	d.Entries = make([]Entry, 0, len(d.Packed)/max(size, 1))
	for i := 0; size > 0 && i+size <= len(d.Packed); i += size {
		d.Entries = append(d.Entries, Entry{Key: hex.EncodeToString(d.Packed[i : i+d.KeySize]), Value: hex.EncodeToString(d.Packed[i+d.KeySize : i+size])})
	}
	d.Packed = nil
	return d
}

// count is how many entries d holds.
func (d *MapDump) count() int {
	if d.Packed != nil {
		return len(d.Packed) / (d.KeySize + d.ValueSize)
	}
	return len(d.Entries)
}

// Entry is one key and value, in hex.
type Entry struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Cilium's LB map names.
const (
	Services4 = "cilium_lb4_services_v2"
	Services6 = "cilium_lb6_services_v2"
	Backends4 = "cilium_lb4_backends_v3"
	Backends6 = "cilium_lb6_backends_v3"
	RevNat4   = "cilium_lb4_reverse_nat"
	RevNat6   = "cilium_lb6_reverse_nat"
)

// layouts are the key and value sizes each map has in the Cilium
// releases whose layouts are known.
var layouts = map[string][2]int{
	Services4: {12, 12}, Services6: {24, 12},
	Backends4: {4, 12}, Backends6: {4, 24},
	RevNat4: {2, 6}, RevNat6: {2, 18},
}

// MapNames are the maps the reader opens, IPv4's first.
var MapNames = []string{Services4, Backends4, RevNat4, Services6, Backends6, RevNat6}

// Service flags (struct lb4_service's flags and flags2, bpf/lib/lb.h).
const (
	FlagExternalIP    = 1 << 0
	FlagNodePort      = 1 << 1
	FlagExtLocalScope = 1 << 2
	FlagHostPort      = 1 << 3
	FlagAffinity      = 1 << 4
	FlagLoadBalancer  = 1 << 5
	FlagRoutable      = 1 << 6
	FlagSourceRange   = 1 << 7

	Flag2LocalRedirect = 1 << 0
	Flag2NAT46x64      = 1 << 1
	Flag2L7LB          = 1 << 2
	Flag2Loopback      = 1 << 3 // HostPort: loopback host IP; else delegate if local
	Flag2IntLocalScope = 1 << 4
	Flag2TwoScopes     = 1 << 5
	Flag2Quarantined   = 1 << 6 // on a backend slot; on a master: source range deny
	Flag2DSR           = 1 << 7
)

// Lookup scopes of a frontend key: with two scopes (traffic policies
// that differ; externalTrafficPolicy Local), the external one holds the
// node's own backends and the internal one ("/i") all of them, as the
// genuine agent's capture shows.
const (
	ScopeExternal = 0
	ScopeInternal = 1
)

// BackendState is a backend's state (enum lb_backend_state).
type BackendState uint8

// Backend states.
const (
	Active BackendState = iota
	Terminating
	Quarantined
	Maintenance
)

func (s BackendState) String() string {
	if int(s) < len(states) {
		return states[s]
	}
	return fmt.Sprintf("state %d", s)
}

var states = []string{"active", "terminating", "quarantined", "maintenance"}

// Frontend is one frontend of the services map: its master entry
// and its backend slots.
type Frontend struct {
	Addr     netip.AddrPort
	Protocol string // TCP, UDP, SCTP; ANY for the per-address entry that drops unknown ports
	Scope    uint8
	// From the master entry: the active backends (Count, slots 1..Count),
	// the quarantined ones after them (QCount, Cilium 1.19 and later), the
	// reverse-NAT index and the flags. Master is the master's backend-ID
	// field, which holds the session-affinity timeout or L7 proxy port.
	Count, QCount int
	RevNat        uint16
	Flags, Flags2 uint8
	Master        uint32
	// Slots are the backend IDs of slots 1..n in order (0: no entry for
	// the slot); SlotFlags2 their flags2 (SVC_FLAG_QUARANTINED).
	Slots      []uint32
	SlotFlags2 []uint8
	// Mastered: the master entry was present (a frontend read while the
	// agent writes it may have slots without one).
	Mastered bool
	// slots as read, sparse, until every entry is (see denseSlots).
	read []slotEntry
}

type slotEntry struct {
	slot   int
	id     uint32
	flags2 uint8
}

// Backend is one entry of the backends map.
type Backend struct {
	ID        uint32
	Addr      netip.AddrPort
	Protocol  string
	State     BackendState
	ClusterID uint16
	Zone      uint8
}

// LB is a node's LB maps decoded.
type LB struct {
	// Warnings are what decoding skipped (a slot no frontend can have).
	Warnings  []string
	Frontends []Frontend // sorted by address, port, protocol, scope
	Backends  map[uint32]Backend
	RevNat    map[uint16]netip.AddrPort
	// Families are those whose services map was read.
	Families []int
}

func protoName(p uint8) string {
	switch p {
	case 0:
		return "ANY"
	case 6:
		return "TCP"
	case 17:
		return "UDP"
	case 132:
		return "SCTP"
	}
	return fmt.Sprintf("proto %d", p)
}

// Decode decodes the dumps of Cilium's LB maps. Maps of unknown
// names are ignored; a known map of other sizes, or an entry that is not
// hex of the map's sizes, is an error naming the map.
func Decode(dumps []MapDump) (*LB, error) {
	lb := &LB{Backends: map[uint32]Backend{}, RevNat: map[uint16]netip.AddrPort{}}
	type fkey struct {
		addr  netip.AddrPort
		proto uint8
		scope uint8
	}
	fronts := map[fkey]*Frontend{}
	var fams [7]bool
	for _, d := range dumps {
		sizes, known := layouts[d.Name]
		if !known {
			continue
		}
		if d.KeySize != sizes[0] || d.ValueSize != sizes[1] {
			return nil, fmt.Errorf("cilium map %s has %d-byte keys and %d-byte values; proxyaudit knows it with %d and %d (Cilium 1.18 to 1.20): this Cilium's layout is not one proxyaudit can read", d.Name, d.KeySize, d.ValueSize, sizes[0], sizes[1])
		}
		v6 := strings.HasPrefix(d.Name, "cilium_lb6_")
		alen := 4
		if v6 {
			alen = 16
		}
		// The families are those whose services map was read, entries or
		// not: an empty map is a node without services, not one unread.
		switch d.Name {
		case Services4:
			fams[4] = true
		case Services6:
			fams[6] = true
		}
		if (d.Name == Backends4 || d.Name == Backends6) && len(lb.Backends) == 0 {
			lb.Backends = make(map[uint32]Backend, d.count()) // 100k at 10k services
		}
		size := d.KeySize + d.ValueSize
		if d.Packed != nil && len(d.Packed)%size != 0 {
			return nil, fmt.Errorf("cilium map %s: %d bytes read, not whole %d-byte entries", d.Name, len(d.Packed), size)
		}
		for i := range d.count() {
			var k, v []byte
			if d.Packed != nil {
				k, v = d.Packed[i*size:i*size+d.KeySize], d.Packed[i*size+d.KeySize:(i+1)*size]
			} else {
				var err1, err2 error
				k, err1 = hex.DecodeString(d.Entries[i].Key)
				v, err2 = hex.DecodeString(d.Entries[i].Value)
				if err1 != nil || err2 != nil || len(k) != d.KeySize || len(v) != d.ValueSize {
					return nil, fmt.Errorf("cilium map %s, entry %d: not a %d-byte key and %d-byte value in hex", d.Name, i, d.KeySize, d.ValueSize)
				}
			}
			switch d.Name {
			case Services4, Services6:
				addr := addrOf(k[:alen])
				fk := fkey{netip.AddrPortFrom(addr, binary.BigEndian.Uint16(k[alen:])), k[alen+4], k[alen+5]}
				slot := int(binary.NativeEndian.Uint16(k[alen+2:]))
				f := fronts[fk]
				if f == nil {
					f = &Frontend{Addr: fk.addr, Protocol: protoName(fk.proto), Scope: fk.scope}
					fronts[fk] = f
				}
				id := binary.NativeEndian.Uint32(v[0:])
				if slot == 0 {
					f.Mastered = true
					f.Master, f.Count, f.RevNat = id, int(binary.NativeEndian.Uint16(v[4:])), binary.BigEndian.Uint16(v[6:])
					f.Flags, f.Flags2, f.QCount = v[8], v[9], int(binary.NativeEndian.Uint16(v[10:]))
					continue
				}
				// Sparse until every entry is read: a slot number sized the
				// frontend, so 16 KB of entries took 700 MB (trust review 4,
				// item 6).
				f.read = append(f.read, slotEntry{slot, id, v[9]})
			case Backends4, Backends6:
				id := binary.NativeEndian.Uint32(k)
				lb.Backends[id] = Backend{ID: id, Addr: netip.AddrPortFrom(addrOf(v[:alen]), binary.BigEndian.Uint16(v[alen:])),
					Protocol: protoName(v[alen+2]), State: BackendState(v[alen+3]), ClusterID: binary.NativeEndian.Uint16(v[alen+4:]), Zone: v[alen+6]}
			case RevNat4, RevNat6:
				lb.RevNat[binary.BigEndian.Uint16(k)] = netip.AddrPortFrom(addrOf(v[:alen]), binary.BigEndian.Uint16(v[alen:]))
			}
		}
	}
	lb.Frontends = make([]Frontend, 0, len(fronts))
	for _, f := range fronts {
		lb.Warnings = append(lb.Warnings, f.denseSlots()...)
		lb.Frontends = append(lb.Frontends, *f)
	}
	slices.SortFunc(lb.Frontends, func(a, b Frontend) int {
		if c := a.Addr.Compare(b.Addr); c != 0 {
			return c
		}
		if c := strings.Compare(a.Protocol, b.Protocol); c != 0 {
			return c
		}
		return int(a.Scope) - int(b.Scope)
	})
	lb.Families = audit.FamilyList(fams)
	return lb, nil
}

// denseSlots lays the slots read out as Slots: the genuine agent numbers
// a frontend's slots 1..n without gaps (its active backends, then the
// terminating and quarantined ones), so no slot may lie beyond both the
// master's counts and the number of slots read; one that does (a hostile
// or torn map) is skipped and said.
func (f *Frontend) denseSlots() []string {
	if len(f.read) == 0 {
		return nil
	}
	limit := max(len(f.read), f.Count+f.QCount)
	highest := 0
	var warnings []string
	for _, e := range f.read {
		if e.slot > limit {
			if len(warnings) == 0 {
				warnings = append(warnings, fmt.Sprintf("cilium: %s/%s has a slot %d beyond its %d slots read and its master's counts: skipped", f.Addr, f.Protocol, e.slot, len(f.read)))
			}
			continue
		}
		highest = max(highest, e.slot)
	}
	f.Slots, f.SlotFlags2 = make([]uint32, highest), make([]uint8, highest)
	for _, e := range f.read {
		if e.slot <= limit {
			f.Slots[e.slot-1], f.SlotFlags2[e.slot-1] = e.id, e.flags2
		}
	}
	f.read = nil
	return warnings
}

func addrOf(b []byte) netip.Addr {
	a, _ := netip.AddrFromSlice(b)
	return a.Unmap()
}
