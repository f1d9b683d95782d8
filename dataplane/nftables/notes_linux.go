package nftables

import (
	"sync"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// mapNotes learns kube-proxy's new anonymous maps from the notifications
// of the commits that create them, so a read under churn need not dump
// them. In nftables mode every service chain kube-proxy rewrites gets a
// new anonymous map (its numgen DNAT or verdict map), and the kernel finds
// a set by name by walking all the table's sets: dumping 1,000 new maps of
// a 10k-service table, one request each, cost ~1–2 s of system time per
// read under 100 changes a second (the profile in docs/benchmarks.md).
//
// The kernel announces a commit's new sets (NEWSET, with name and handle)
// and their elements (NEWSETELEM, by set name) in commit order and closes
// the commit with NEWGEN. A map's elements are taken only from a commit
// that closed while its notifications were all received: an anonymous set
// bound to a rule never changes after its commit (the kernel refuses
// element changes), so such a map is complete. A lost notification drops
// everything learnt: those maps are dumped. Anything doubtful is dumped.
type mapNotes struct {
	mu sync.Mutex
	// open are the anonymous maps of the commit in progress, by family
	// and name (a name is unique at any instant; handles never repeat).
	open map[noteKey]*notedMap
	// done are complete maps by family and handle, decoded (the raw
	// messages are let go: ~80 bytes an element instead of ~400).
	done  map[handleKey]doneMap
	elems int // elements held (open and done), bounded
}

type doneMap struct {
	m *LookupMap
	n int // elements
}

type noteKey struct {
	family byte
	name   string
}

type handleKey struct {
	family byte
	handle uint64
}

type notedMap struct {
	handle uint64
	elems  []Elem
}

// maxNotedElems bounds what the notes hold between two reads (a few MB);
// past it they are dropped (the maps are dumped instead). One kube-proxy
// sync at 10k services under 100 changes a second makes ~20k.
const maxNotedElems = 200_000

// Note takes one notification. Only kube-proxy's table matters.
func (m *mapNotes) Note(typ, _ uint16, data []byte) {
	if len(data) < 4 {
		return
	}
	if typ>>8 != unix.NFNL_SUBSYS_NFTABLES {
		return
	}
	family := data[0]
	m.mu.Lock()
	defer m.mu.Unlock()
	switch typ & 0xff {
	case unix.NFT_MSG_NEWSET:
		table, name, info, err := DecodeSetNote(data)
		// kube-proxy's tables are ip and ip6: the reader takes no other.
		if err != nil || table != kubeProxyTable || !info.Anonymous || (family != unix.NFPROTO_IPV4 && family != unix.NFPROTO_IPV6) {
			return
		}
		if m.open == nil {
			m.open = map[noteKey]*notedMap{}
		}
		k := noteKey{family, name}
		if old := m.open[k]; old != nil {
			m.elems -= len(old.elems)
		}
		m.open[k] = &notedMap{handle: info.Handle}
	case unix.NFT_MSG_NEWSETELEM:
		table, set := ElemsOf(data)
		nm := m.open[noteKey{family, set}]
		if table != kubeProxyTable || nm == nil {
			return
		}
		// The body is the socket's buffer: keep a copy.
		els, err := DecodeElems(append([]byte(nil), data...), nm.elems)
		if err != nil {
			m.elems -= len(nm.elems)
			delete(m.open, noteKey{family, set}) // never trusted: dumped
			return
		}
		m.elems += len(els) - len(nm.elems)
		nm.elems = els
		if m.elems > maxNotedElems {
			m.clearLocked()
		}
	case unix.NFT_MSG_DELSET:
		table, name, info, err := DecodeSetNote(data)
		if err != nil || table != kubeProxyTable {
			return
		}
		if old := m.open[noteKey{family, name}]; old != nil {
			m.elems -= len(old.elems)
			delete(m.open, noteKey{family, name})
		}
		if d, ok := m.done[handleKey{family, info.Handle}]; ok {
			m.elems -= d.n
			delete(m.done, handleKey{family, info.Handle})
		}
	case unix.NFT_MSG_NEWTABLE, unix.NFT_MSG_DELTABLE:
		// A table made again numbers its sets from 1 again: nothing
		// learnt of the old one may answer for the new.
		if nl.TableName(data) == kubeProxyTable {
			m.clearLocked()
		}
	case unix.NFT_MSG_NEWGEN:
		// The commit is whole: its maps are complete.
		if len(m.open) == 0 {
			return
		}
		if m.done == nil {
			m.done = map[handleKey]doneMap{}
		}
		for k, nm := range m.open {
			hk := handleKey{k.family, nm.handle}
			m.elems -= m.done[hk].n // a handle announced twice: the last counts
			fam := 4
			if k.family == unix.NFPROTO_IPV6 {
				fam = 6
			}
			m.done[hk] = doneMap{m: DecodeLookupMap(fam, nm.elems), n: len(nm.elems)}
		}
		clear(m.open)
	}
}

// Lost drops everything learnt: some notification may be missing.
func (m *mapNotes) Lost() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.clearLocked()
}

func (m *mapNotes) clearLocked() {
	clear(m.open)
	clear(m.done)
	m.elems = 0
}

// take returns the complete map of that family and handle, decoded,
// forgetting it (the reader caches what it uses).
func (m *mapNotes) take(family byte, handle uint64) (*LookupMap, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := handleKey{family, handle}
	d, ok := m.done[k]
	if ok {
		delete(m.done, k)
		m.elems -= d.n
	}
	return d.m, ok
}

// seen forgets the complete maps of family with handles up to last, the
// highest a read's set list held: the read took those it needed, and the
// rest are gone or not looked up. Handles only grow within a table.
func (m *mapNotes) seen(family byte, last uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k, d := range m.done {
		if k.family == family && k.handle <= last {
			delete(m.done, k)
			m.elems -= d.n
		}
	}
}
