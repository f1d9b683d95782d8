package stream

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"math/bits"
	"runtime"
	"slices"
	"strings"
	"sync"
	"weak"

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

// MissingError says what of a report the state's pool does not hold:
// its top (Report.Top: no node's copy was ever that state), named buckets
// (Report.Buckets) no copy holds, or frontends named by hash (Refs). The
// aggregator asks the collector for the next level down (Want) and applies
// the report once it has it.
type MissingError struct {
	Top     bool
	Buckets []int
	Sums    []string
}

func (e *MissingError) Error() string {
	switch {
	case e.Top:
		return "the state the report names is not known"
	case len(e.Buckets) > 0:
		return fmt.Sprintf("%d named buckets not known", len(e.Buckets))
	}
	return fmt.Sprintf("%d referenced frontends not known", len(e.Sums))
}

// Apply validates a report and applies it to s. It returns whether the
// root matches afterwards; false means the two ends disagree and the
// collector must resync. On a validation error s is unchanged, and a
// *MissingError when the report names a state, buckets or frontends the
// pool does not hold.
func (s *State) Apply(r *Report) (bool, error) {
	if len(r.Frontends)+len(r.Refs) > MaxFrontends || len(r.Removed) > MaxFrontends {
		return false, fmt.Errorf("report claims %d frontends: more than the %d a node can have", len(r.Frontends)+len(r.Refs)+len(r.Removed), MaxFrontends)
	}
	eps := 0
	for _, f := range r.Frontends {
		eps += len(f.Endpoints)
		if _, err := f.ToObserved(); err != nil {
			return false, err
		}
	}
	if eps > MaxEndpoints {
		return false, fmt.Errorf("report claims %d endpoints: more than %d", eps, MaxEndpoints)
	}
	for _, k := range r.Removed {
		if _, err := ParseKey(k); err != nil {
			return false, err
		}
	}
	top, named, err := s.lookup(r)
	if err != nil {
		return false, err
	}
	resolved, err := s.pool.resolve(r.Refs)
	if err != nil {
		return false, err
	}
	next := *s
	if r.Full {
		next = State{pool: s.pool}
	}
	next.Mode, next.NoRules, next.Families = r.Mode, r.NoRules, slices.Clone(r.Families)
	if top != nil {
		next.buckets = *top
		next.n = 0
		for _, b := range top {
			if b != nil {
				next.n += len(b.entries)
			}
		}
	}
	for _, nb := range named {
		if old := next.buckets[nb.i]; old != nil {
			next.n -= len(old.entries)
		}
		if nb.b != nil {
			next.n += len(nb.b.entries)
		}
		next.buckets[nb.i] = nb.b
	}
	if r.Full && next.pool == nil && len(resolved) == 0 {
		next.fill(r.Frontends)
	} else if largest := next.replace(r.Removed, r.Frontends, resolved); largest > maxBucket {
		return false, fmt.Errorf("a bucket of the node's state grew to %d frontends, more than %d: keys chosen to fall together (a change would cost the whole bucket)", largest, maxBucket)
	}
	if next.n > MaxFrontends {
		return false, fmt.Errorf("node state grew to %d frontends: more than %d", next.n, MaxFrontends)
	}
	if r.Buckets != "" {
		if want, _ := parseSum(r.Top); next.top() != want {
			// Short names resolved to other buckets (a collision, or
			// content planted under them): the named buckets not patched
			// yet are asked for frontend by frontend, by full hashes. If
			// that does not add up either, nothing is applied and a full
			// snapshot is asked for.
			var again []int
			for _, nb := range named { // named, not patched
				again = append(again, nb.i)
			}
			if again != nil {
				return false, &MissingError{Buckets: again}
			}
			return false, nil
		}
	}
	*s = next
	if r.Full || top != nil || len(named)+len(r.Frontends)+len(resolved)+len(r.Removed) > 0 {
		// Not for a steady report (most of a fleet's): its state is known.
		s.pool.addTop(s)
	}
	return s.Root() == r.Root, nil
}

// namedBucket is bucket i as a report names it (nil: empty).
type namedBucket struct {
	i int
	b *bucket
}

// lookup resolves what a report names whole: the state its top names
// (every bucket), or the buckets its names name, except those it patches
// with frontends (rebuilt from the copy's bucket instead, or from nothing
// in a full snapshot).
func (s *State) lookup(r *Report) (*[nBuckets]*bucket, []namedBucket, error) {
	if r.Top == "" && r.Buckets == "" && len(r.Patched) == 0 {
		return nil, nil, nil
	}
	if r.Buckets != "" {
		if _, ok := parseSum(r.Top); !ok {
			return nil, nil, fmt.Errorf("bucket names without the state's top (%q)", clip(r.Top))
		}
	}
	if s.pool == nil {
		return nil, nil, errors.New("report names buckets on a stream that holds none")
	}
	if r.Buckets == "" {
		if len(r.Patched) > 0 {
			return nil, nil, errors.New("report patches buckets it does not name")
		}
		if len(r.Frontends)+len(r.Refs)+len(r.Removed) > 0 {
			return nil, nil, errors.New("a report naming its state carries no frontends")
		}
		t, ok := parseSum(r.Top)
		if !ok {
			return nil, nil, fmt.Errorf("malformed state hash %q", clip(r.Top))
		}
		bs := s.pool.top(t)
		if bs == nil {
			return nil, nil, &MissingError{Top: true}
		}
		return bs, nil, nil
	}
	names, err := decodeBuckets(r.Buckets)
	if err != nil {
		return nil, nil, err
	}
	patched := map[int]bool{}
	for _, i := range r.Patched {
		if _, ok := names[i]; !ok {
			return nil, nil, fmt.Errorf("report patches bucket %d it does not name", i)
		}
		patched[i] = true
	}
	outside := func(k string) error {
		if !patched[bucketOf(k)] {
			return fmt.Errorf("frontend %s is outside the buckets the report patches", clip(k))
		}
		return nil
	}
	for _, f := range r.Frontends {
		if err := outside(f.Key); err != nil {
			return nil, nil, err
		}
	}
	for _, f := range r.Refs {
		if err := outside(f.Key); err != nil {
			return nil, nil, err
		}
	}
	for _, k := range r.Removed {
		if err := outside(k); err != nil {
			return nil, nil, err
		}
	}
	var out []namedBucket
	var missing []int
	for i := range nBuckets {
		name, ok := names[i]
		if !ok || patched[i] {
			continue
		}
		if name == ([shortLen]byte{}) {
			out = append(out, namedBucket{i: i})
			continue
		}
		b := s.pool.named(name, i)
		if b == nil {
			missing = append(missing, i)
			continue
		}
		out = append(out, namedBucket{i: i, b: b})
	}
	if missing != nil {
		return nil, nil, &MissingError{Buckets: missing}
	}
	return nil, out, nil
}

// top names the state's buckets as a whole: a hash of their names.
func (s *State) top() [sumLen]byte {
	h := sha256.New()
	for _, b := range s.buckets {
		n := nameOf(b)
		h.Write(n[:])
	}
	var full [sha256.Size]byte
	return [sumLen]byte(h.Sum(full[:0]))
}

// Top is the wire form of the state's top: what a report names when
// another node's copy may already hold the very same rules.
func (s *State) Top() string {
	t := s.top()
	return hex.EncodeToString(t[:])
}

// ByTop returns r naming the state s (what r moves the other end to) by
// its top instead of carrying the changes or, for a full snapshot, every
// frontend: seq, root, node facts, signal, read stats and conntrack
// counts stay. The sender
// keeps what r moved the other end from (nothing, for a full snapshot)
// and to, to answer the wants that follow when the top is not known.
func (r *Report) ByTop(s *State) *Report {
	return &Report{Seq: r.Seq, Full: r.Full, Root: r.Root, Mode: r.Mode, NoRules: r.NoRules, Families: r.Families, Top: s.Top(),
		ReadError: r.ReadError, KubeProxy: r.KubeProxy, Reads: r.Reads, Conntrack: r.Conntrack}
}

// encodeBuckets names the buckets that differ between prev and next:
// a bitmap of their indexes, then each one's short name in order (all
// zeros for a bucket that became empty), in base64.
func encodeBuckets(prev, next *State) string {
	out := make([]byte, nBuckets/8, nBuckets/8+nBuckets*shortLen)
	for i := range nBuckets {
		a, b := nameOf(prev.buckets[i]), nameOf(next.buckets[i])
		if a == b {
			continue
		}
		out[i/8] |= 1 << (i % 8)
		if next.buckets[i] == nil {
			out = append(out, make([]byte, shortLen)...)
		} else {
			out = append(out, b[:shortLen]...)
		}
	}
	return base64.StdEncoding.EncodeToString(out)
}

// decodeBuckets reverses encodeBuckets.
func decodeBuckets(s string) (map[int][shortLen]byte, error) {
	if len(s) > base64.StdEncoding.EncodedLen(nBuckets/8+nBuckets*shortLen) {
		return nil, fmt.Errorf("bucket names of %d bytes: more than %d buckets", len(s), nBuckets)
	}
	raw, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("malformed bucket names: %v", err)
	}
	if len(raw) < nBuckets/8 {
		return nil, fmt.Errorf("malformed bucket names: %d bytes", len(raw))
	}
	n := 0
	for _, b := range raw[:nBuckets/8] {
		n += bits.OnesCount8(b)
	}
	if len(raw) != nBuckets/8+n*shortLen {
		return nil, fmt.Errorf("malformed bucket names: %d bytes for %d buckets", len(raw), n)
	}
	out := make(map[int][shortLen]byte, n)
	at := nBuckets / 8
	for i := range nBuckets {
		if raw[i/8]&(1<<(i%8)) != 0 {
			out[i] = [shortLen]byte(raw[at : at+shortLen])
			at += shortLen
		}
	}
	return out, nil
}

// Sent is what one report moved the other end from and to, kept by the
// sender to answer the wants that follow it.
type Sent struct {
	Seq        uint64
	Prev, Next State
}

// Reply answers a want from the recent reports' states: the names of the
// buckets a report changed, the frontends it changed in the buckets
// asked (by hash, exactly: chain names included), and frontends by hash.
// What is no longer there is left out; the aggregator then asks for a
// full snapshot.
func Reply(w *Want, recent []Sent) *Content {
	ct := &Content{Frontends: []Frontend{}}
	var sent *Sent
	for i := range recent {
		if recent[i].Seq == w.Seq {
			sent = &recent[i]
		}
	}
	if sent != nil && w.Buckets {
		ct.Buckets = encodeBuckets(&sent.Prev, &sent.Next)
	}
	if sent != nil && len(w.Delta) > 0 {
		for _, i := range w.Delta {
			if i < 0 || i >= nBuckets {
				continue
			}
			merge(sent.Prev.buckets[i], sent.Next.buckets[i], func(p, n *entry) {
				switch {
				case n == nil:
					ct.Removed = append(ct.Removed, p.Key)
				case p == nil || p.sum != n.sum:
					ct.Refs = append(ct.Refs, Ref{Key: n.Key, Sum: hex.EncodeToString(n.sum[:])})
				}
			})
		}
	}
	if len(w.Sums) > 0 {
		states := make([]State, len(recent))
		for i := range recent {
			states[i] = recent[i].Next
		}
		ct.Frontends = findSums(w.Sums, states).Frontends
	}
	return ct
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

// Pool lets the aggregator hold thousands of nodes' rules at the cost of
// little more than one: most nodes of a fleet program the same frontends,
// so identical frontends and identical buckets are kept once. Sharing is
// by content, compared in full (a digest only finds the candidate), so one
// node's report can never change what another node's copy holds. Entries
// nobody holds any more are dropped by the garbage collector.
type Pool struct {
	mu      sync.Mutex
	entries map[[sumLen]byte]weak.Pointer[entry]
	buckets map[[shortLen]byte]weak.Pointer[bucket] // by short name
	// tops are recent whole states by their top: a node showing rules
	// another node's copy held names them in one hash. Bounded (oldest
	// forgotten first); a state whose buckets nobody holds any more is
	// not found.
	tops  map[[sumLen]byte]*topEntry
	order [][sumLen]byte
}

// maxTops bounds the states a pool knows by their top (~2 KB each).
const maxTops = 4096

type topEntry struct {
	buckets [nBuckets]weak.Pointer[bucket]
	present [nBuckets / 64]uint64
}

// held reports whether some copy still holds every bucket of the state.
func (te *topEntry) held() bool {
	for i := range nBuckets {
		if te.present[i/64]&(1<<(i%64)) != 0 && te.buckets[i].Value() == nil {
			return false
		}
	}
	return true
}

// NewPool returns an empty pool.
func NewPool() *Pool {
	return &Pool{entries: map[[sumLen]byte]weak.Pointer[entry]{}, buckets: map[[shortLen]byte]weak.Pointer[bucket]{},
		tops: map[[sumLen]byte]*topEntry{}}
}

// named returns the bucket with the given short name, if some copy holds
// it and its frontends belong at index i.
func (p *Pool) named(name [shortLen]byte, i int) *bucket {
	p.mu.Lock()
	defer p.mu.Unlock()
	b := p.buckets[name].Value()
	if b == nil || len(b.entries) == 0 || bucketOf(b.entries[0].Key) != i {
		return nil
	}
	return b
}

// top returns the buckets of the state with top t, if known and every
// bucket still held.
func (p *Pool) top(t [sumLen]byte) *[nBuckets]*bucket {
	p.mu.Lock()
	defer p.mu.Unlock()
	te := p.tops[t]
	if te == nil {
		return nil
	}
	var out [nBuckets]*bucket
	for i := range nBuckets {
		if te.present[i/64]&(1<<(i%64)) == 0 {
			continue
		}
		if out[i] = te.buckets[i].Value(); out[i] == nil {
			return nil // one of its buckets was dropped; addTop renews it
		}
	}
	return &out
}

// addTop makes the state s holds findable by its top.
func (p *Pool) addTop(s *State) {
	if p == nil {
		return
	}
	t := s.top()
	p.mu.Lock()
	defer p.mu.Unlock()
	te := p.tops[t]
	if te != nil && te.held() {
		return
	}
	// A known top whose buckets were dropped (every copy left that state,
	// then one came back to it with buckets built anew) is renewed in
	// place: same content, same buckets present, same place in order.
	known := te != nil
	if !known {
		te = &topEntry{}
	}
	for i, b := range s.buckets {
		if b != nil {
			te.buckets[i], te.present[i/64] = weak.Make(b), te.present[i/64]|1<<(i%64)
		}
	}
	if known {
		return
	}
	p.tops[t] = te
	p.order = append(p.order, t)
	if len(p.order) > maxTops {
		delete(p.tops, p.order[0])
		p.order = p.order[1:]
	}
}

func (p *Pool) entry(e *entry) *entry {
	if p == nil {
		return e
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if have := p.entries[e.sum].Value(); have != nil {
		if have.equal(e) {
			return have
		}
		return e // a hash collision: kept apart
	}
	p.entries[e.sum] = weak.Make(e)
	runtime.AddCleanup(e, p.forgetEntry, e.sum)
	return e
}

// resolve finds the entries refs name. It fails on a malformed ref or one
// whose hash the pool holds under another key, and with a *MissingError
// naming the hashes it does not hold.
func (p *Pool) resolve(refs []Ref) ([]*entry, error) {
	if len(refs) == 0 {
		return nil, nil
	}
	sums := make([][sumLen]byte, len(refs))
	for i, r := range refs {
		if _, err := ParseKey(r.Key); err != nil {
			return nil, err
		}
		var ok bool
		if sums[i], ok = parseSum(r.Sum); !ok {
			return nil, fmt.Errorf("frontend %s: malformed hash %q", r.Key, clip(r.Sum))
		}
	}
	if p == nil {
		return nil, errors.New("report names frontends by hash on a stream that holds none")
	}
	out := make([]*entry, 0, len(refs))
	var missing []string
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, r := range refs {
		e := p.entries[sums[i]].Value()
		switch {
		case e == nil:
			missing = append(missing, r.Sum)
		case e.Key != r.Key:
			return nil, fmt.Errorf("frontend %s named by the hash of frontend %s", r.Key, e.Key)
		default:
			out = append(out, e)
		}
	}
	if missing != nil {
		return nil, &MissingError{Sums: missing}
	}
	return out, nil
}

func (p *Pool) bucket(b *bucket) *bucket {
	if p == nil {
		return b
	}
	// Entries are pooled first: equal buckets hold the same pointers.
	key := short(b.name)
	p.mu.Lock()
	defer p.mu.Unlock()
	if have := p.buckets[key].Value(); have != nil {
		if slices.Equal(have.entries, b.entries) {
			return have
		}
		return b
	}
	p.buckets[key] = weak.Make(b)
	runtime.AddCleanup(b, p.forgetBucket, key)
	return b
}

func (p *Pool) forgetEntry(sum [sumLen]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if wp, ok := p.entries[sum]; ok && wp.Value() == nil {
		delete(p.entries, sum)
	}
}

func (p *Pool) forgetBucket(k [shortLen]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if wp, ok := p.buckets[k]; ok && wp.Value() == nil {
		delete(p.buckets, k)
	}
}

// Size returns how many distinct frontends and buckets the pool holds.
func (p *Pool) Size() (frontends, buckets int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.entries), len(p.buckets)
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

// Find returns the frontends of the state whose content hashes are among
// sums, by hash, in one walk: the collector answers a Want from what it
// last sent.
func (s *State) Find(sums []string) map[string]Frontend {
	want := make(map[[sumLen]byte]string, len(sums))
	for _, sum := range sums {
		if b, ok := parseSum(sum); ok {
			want[b] = sum
		}
	}
	out := map[string]Frontend{}
	for _, b := range s.buckets {
		if b == nil || len(out) == len(want) {
			continue
		}
		for _, e := range b.entries {
			if sum, ok := want[e.sum]; ok {
				out[sum] = e.Frontend
			}
		}
	}
	return out
}

// findSums finds the frontends with the wanted hashes in the states recent
// reports sent, newest first; one no longer there is left out and the
// aggregator asks for a full snapshot.
func findSums(sums []string, recent []State) *Content {
	ct := &Content{Frontends: []Frontend{}}
	left := slices.Clone(sums)
	for i := len(recent) - 1; i >= 0 && len(left) > 0; i-- {
		found := recent[i].Find(left)
		left = slices.DeleteFunc(left, func(sum string) bool {
			f, ok := found[sum]
			if ok {
				ct.Frontends = append(ct.Frontends, f)
			}
			return ok
		})
	}
	return ct
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
