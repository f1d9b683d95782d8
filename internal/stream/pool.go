package stream

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"weak"
)

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
