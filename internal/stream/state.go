package stream

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"slices"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// nBuckets splits a node's frontends by a hash of their key. A bucket is
// immutable once built: a report replaces only the buckets it touches, so
// copying a State copies 256 pointers, and states that hold the same rules
// can hold the same buckets (see Pool).
const nBuckets = 256

// entry is one frontend with its digest (for change detection), its
// content hash (its name in a Ref) and its key parsed once (the aggregator
// looks up every frontend's owner at each assessment).
type entry struct {
	Frontend
	digest uint64
	sum    [sumLen]byte
	key    audit.FrontendKey
	keyOK  bool
}

func newEntry(f Frontend) entry {
	k, err := ParseKey(f.Key)
	return entry{Frontend: f, digest: f.Digest(), sum: f.sum(), key: k, keyOK: err == nil}
}

// bucket holds the entries whose keys hash to it, sorted by key, the sum
// of their digests, and its name: a hash of its entries' content hashes,
// by which a report names a whole bucket (see Report.Buckets).
type bucket struct {
	sum     uint64
	name    [sumLen]byte
	entries []*entry
}

// finish computes a built bucket's digest sum and name.
func (b *bucket) finish() {
	h := sha256.New()
	b.sum = 0
	for _, e := range b.entries {
		b.sum += e.digest
		h.Write(e.sum[:])
	}
	var full [sha256.Size]byte
	b.name = [sumLen]byte(h.Sum(full[:0]))
}

// nameOf is a bucket's name; an empty bucket's is all zeros.
func nameOf(b *bucket) (n [sumLen]byte) {
	if b != nil {
		n = b.name
	}
	return n
}

// shortLen is the bytes of a bucket's name a report's bucket list
// carries (about 250 of 256 buckets change in 10 s of churn at the
// anchors: 4 KB of names at 16 bytes). The report's top, a hash over the
// full names, confirms what the short names resolved to: a copy built
// from them must have that top, else the collector is resynced.
const shortLen = 8

func short(n [sumLen]byte) [shortLen]byte { return [shortLen]byte(n[:shortLen]) }

// maxBucket bounds one bucket: a change rebuilds its bucket, so a node
// that steered all its frontends into one (bucketOf is a plain hash of
// keys it chooses) made each one-frontend change cost 200,000 (116 ms of
// the leader's shared loop instead of 0.5 ms). Real keys spread evenly: at
// the 200,000 frontends a node may have, 781 a bucket on average, and the
// largest of 256 within a few dozen of that.
const maxBucket = 4096

func bucketOf(key string) int {
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % nBuckets)
}

// State is one node's observed rules as both ends of a stream keep them:
// frontends by key with their digests, and the node-wide facts.
type State struct {
	Mode     string
	NoRules  bool
	Families []int

	buckets [nBuckets]*bucket
	n       int
	pool    *Pool
}

// NewState returns an empty state.
func NewState() *State { return &State{} }

// NewPooledState returns an empty state that shares identical frontends
// and buckets with every other state of the pool.
func NewPooledState(p *Pool) *State { return &State{pool: p} }

// Len is the number of frontends.
func (s *State) Len() int { return s.n }

// Get returns the frontend with the given key.
func (s *State) Get(key string) (Frontend, bool) {
	if e := s.entry(key); e != nil {
		return e.Frontend, true
	}
	return Frontend{}, false
}

func (s *State) entry(key string) *entry {
	b := s.buckets[bucketOf(key)]
	if b == nil {
		return nil
	}
	i, ok := slices.BinarySearchFunc(b.entries, key, func(e *entry, k string) int { return strings.Compare(e.Key, k) })
	if !ok {
		return nil
	}
	return b.entries[i]
}

// Shown is what a state holds for a list of keys, in their order: one
// frontend or none per key. It lets the aggregator judge a service once
// for every node showing the same frontends for it.
type Shown struct{ entries []*entry }

// Show returns what s holds for keys.
func (s *State) Show(keys []string) Shown {
	out := Shown{entries: make([]*entry, len(keys))}
	for i, k := range keys {
		out.entries[i] = s.entry(k)
	}
	return out
}

// Hash digests p for a map key; equal Shown values have equal hashes
// (Same decides).
func (p Shown) Hash() uint64 {
	h := uint64(14695981039346656037)
	for _, e := range p.entries {
		d := uint64(0x9e3779b97f4a7c15) // absent
		if e != nil {
			d = e.digest
		}
		h = (h ^ d) * 1099511628211
	}
	return h
}

// Same reports whether p and o hold equal frontends, key by key: the same
// pooled entry, or entries equal in every field.
func (p Shown) Same(o Shown) bool {
	if len(p.entries) != len(o.entries) {
		return false
	}
	for i, e := range p.entries {
		f := o.entries[i]
		if e != f && (e == nil || f == nil || !e.equal(f)) {
			return false
		}
	}
	return true
}

// Frontends returns the frontends p holds, in key order.
func (p Shown) Frontends() []Frontend {
	out := make([]Frontend, 0, len(p.entries))
	for _, e := range p.entries {
		if e != nil {
			out = append(out, e.Frontend)
		}
	}
	return out
}

// Root digests the whole state: the sum of the frontends' digests (so it
// is independent of order and cheap to update) mixed with the node facts.
func (s *State) Root() uint64 {
	var sum uint64
	for _, b := range s.buckets {
		if b != nil {
			sum += b.sum
		}
	}
	h := fnv.New64a()
	fmt.Fprintf(h, "%s|%t|%v|%d", s.Mode, s.NoRules, s.Families, sum)
	return h.Sum64()
}

// Same reports whether s and o hold the very same buckets and node facts:
// true only when their rules are identical (a pooled state shares a
// bucket only after comparing its content).
func (s *State) Same(o *State) bool {
	return s.buckets == o.buckets && s.Mode == o.Mode && s.NoRules == o.NoRules && slices.Equal(s.Families, o.Families)
}

// Delta builds the report that moves prev (what the other end has) to
// next, and makes prev next: the caller hands next over and must not
// change it afterwards. With full, every frontend is sent. With refs, new
// and changed frontends are named by hash (Report.Refs) instead of sent.
func Delta(prev, next *State, seq uint64, full, refs bool) *Report {
	r := &Report{Seq: seq, Full: full, Mode: next.Mode, NoRules: next.NoRules, Families: next.Families}
	add := func(e *entry) {
		if refs {
			r.Refs = append(r.Refs, Ref{Key: e.Key, Sum: hex.EncodeToString(e.sum[:])})
		} else {
			r.Frontends = append(r.Frontends, e.Frontend)
		}
	}
	for i := range nBuckets {
		pb, nb := prev.buckets[i], next.buckets[i]
		if full {
			if nb != nil {
				for _, e := range nb.entries {
					add(e)
				}
			}
			continue
		}
		if pb == nb {
			continue
		}
		merge(pb, nb, func(p, n *entry) {
			switch {
			case n == nil:
				r.Removed = append(r.Removed, p.Key)
			case p == nil || p.digest != n.digest:
				add(n)
			}
		})
	}
	slices.SortFunc(r.Frontends, func(a, b Frontend) int { return strings.Compare(a.Key, b.Key) })
	slices.SortFunc(r.Refs, func(a, b Ref) int { return strings.Compare(a.Key, b.Key) })
	slices.Sort(r.Removed)
	r.Root = next.Root()
	*prev = *next // next is the caller's fresh read: it becomes what was sent
	return r
}

// FromModel builds a state from an observed model.
func FromModel(o *audit.Observed) *State {
	s := NewState()
	s.Mode, s.NoRules, s.Families = string(o.Mode), o.NoRules, slices.Clone(o.Families)
	fs := make([]Frontend, len(o.Frontends))
	for i, of := range o.Frontends {
		fs[i] = FromObserved(of)
	}
	s.fill(fs)
	return s
}

// fill builds an empty, unpooled state from frontends (a later one wins
// over an earlier one with the same key) with a handful of allocations:
// the collector builds one per read, and its memory is what a node pays.
// A pooled state must not use it: one shared entry would keep the whole
// backing array alive.
func (s *State) fill(fs []Frontend) {
	entries := make([]entry, len(fs))
	which := make([]uint8, len(fs))
	var count, start [nBuckets]int
	for i := range fs {
		b := bucketOf(fs[i].Key)
		which[i], count[b] = uint8(b), count[b]+1
		entries[i] = newEntry(fs[i])
	}
	for b, off := 0, 0; b < nBuckets; b++ {
		start[b], off = off, off+count[b]
	}
	ptrs := make([]*entry, len(fs))
	next := start
	for i := range entries {
		ptrs[next[which[i]]] = &entries[i]
		next[which[i]]++
	}
	buckets := make([]bucket, nBuckets)
	s.n = 0
	for b := range nBuckets {
		es := ptrs[start[b] : start[b]+count[b] : start[b]+count[b]]
		// Stable: of two entries with one key, the later stays last.
		slices.SortStableFunc(es, func(x, y *entry) int { return strings.Compare(x.Key, y.Key) })
		out := es[:0]
		for i, e := range es {
			if i+1 < len(es) && es[i+1].Key == e.Key {
				continue
			}
			out = append(out, e)
		}
		if len(out) == 0 {
			s.buckets[b] = nil
			continue
		}
		bk := &buckets[b]
		bk.entries = out
		bk.finish()
		s.buckets[b] = bk
		s.n += len(out)
	}
}

// replace removes keys and puts frontends and resolved entries (which win
// over a removal of the same key), rebuilding only the buckets they touch,
// and returns the size of the largest it built.
func (s *State) replace(removed []string, fs []Frontend, resolved []*entry) (largest int) {
	touched := map[int]map[string]*entry{}
	at := func(key string) map[string]*entry {
		i := bucketOf(key)
		m := touched[i]
		if m == nil {
			m = map[string]*entry{}
			touched[i] = m
		}
		return m
	}
	for _, k := range removed {
		at(k)[k] = nil
	}
	for _, f := range fs {
		e := newEntry(f)
		at(f.Key)[f.Key] = &e
	}
	for _, e := range resolved {
		at(e.Key)[e.Key] = e
	}
	for i, m := range touched {
		old := s.buckets[i]
		var es []*entry
		if old != nil {
			es = make([]*entry, 0, len(old.entries)+len(m))
			for _, e := range old.entries {
				if _, ok := m[e.Key]; !ok {
					es = append(es, e)
				}
			}
			s.n -= len(old.entries)
		}
		for _, e := range m {
			if e != nil {
				es = append(es, s.pool.entry(e))
			}
		}
		s.n += len(es)
		largest = max(largest, len(es))
		if len(es) == 0 {
			s.buckets[i] = nil
			continue
		}
		slices.SortFunc(es, func(a, b *entry) int { return strings.Compare(a.Key, b.Key) })
		b := &bucket{entries: es}
		b.finish()
		s.buckets[i] = s.pool.bucket(b)
	}
	return largest
}

// Observed converts the state to the audit's model.
func (s *State) Observed() *audit.Observed {
	o := &audit.Observed{Mode: audit.Mode(s.Mode), NoRules: s.NoRules, Families: slices.Clone(s.Families)}
	o.Frontends = make([]audit.ObservedFrontend, 0, s.n)
	for _, b := range s.buckets {
		if b == nil {
			continue
		}
		for _, e := range b.entries {
			if of, err := e.ToObserved(); err == nil {
				o.Frontends = append(o.Frontends, of)
			}
		}
	}
	slices.SortFunc(o.Frontends, func(a, b audit.ObservedFrontend) int {
		return strings.Compare(KeyString(a.FrontendKey), KeyString(b.FrontendKey))
	})
	if len(o.Families) == 0 {
		o.Families = []int{4}
	}
	return o
}

func (e *entry) equal(o *entry) bool {
	return e.digest == o.digest && e.sum == o.sum && e.Key == o.Key && e.Scope == o.Scope && e.Chain == o.Chain && e.Name == o.Name &&
		slices.Equal(e.Endpoints, o.Endpoints) && slices.Equal(e.Weights, o.Weights)
}

// With returns a copy of s without the removed keys and with the given
// frontends put (they win over a removal of the same key). Buckets nothing
// touched are shared with s, which is unchanged.
func (s *State) With(removed []string, fs []Frontend) *State {
	next := *s
	next.replace(removed, fs, nil)
	return &next
}

// ChangedKeys calls f with the key of every frontend that differs between
// a and b in any field (added, removed or changed), walking only the
// buckets the two do not share.
func ChangedKeys(a, b *State, f func(key string)) {
	for i := range nBuckets {
		if a.buckets[i] == b.buckets[i] {
			continue
		}
		merge(a.buckets[i], b.buckets[i], func(p, n *entry) {
			switch {
			case n == nil:
				f(p.Key)
			case p == nil || (p != n && !p.equal(n)):
				f(n.Key)
			}
		})
	}
}

// merge walks two buckets' entries (sorted by key) together, calling f
// with the entry of each key on either side (nil where absent).
func merge(a, b *bucket, f func(p, n *entry)) {
	var ae, be []*entry
	if a != nil {
		ae = a.entries
	}
	if b != nil {
		be = b.entries
	}
	for len(ae) > 0 || len(be) > 0 {
		switch {
		case len(be) == 0 || (len(ae) > 0 && ae[0].Key < be[0].Key):
			f(ae[0], nil)
			ae = ae[1:]
		case len(ae) == 0 || be[0].Key < ae[0].Key:
			f(nil, be[0])
			be = be[1:]
		default:
			f(ae[0], be[0])
			ae, be = ae[1:], be[1:]
		}
	}
}

// ParsedKeys calls f with every frontend's key, parsed (those that do not
// parse are left out).
func (s *State) ParsedKeys(f func(key string, k audit.FrontendKey)) {
	for _, b := range s.buckets {
		if b == nil {
			continue
		}
		for _, e := range b.entries {
			if e.keyOK {
				f(e.Key, e.key)
			}
		}
	}
}

// Keys calls f with every frontend key of the state.
func (s *State) Keys(f func(key string)) {
	for _, b := range s.buckets {
		if b == nil {
			continue
		}
		for _, e := range b.entries {
			f(e.Key)
		}
	}
}
