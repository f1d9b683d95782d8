package stream

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// collector plays one node's collector naming its states by top: it keeps
// what each report moved the other end from and to, and answers wants.
type collector struct {
	sent   *State
	seq    uint64
	recent []Sent
}

// full names next as a full snapshot by its top, as a collector does on
// a new stream.
func (c *collector) full(next *State) *Report {
	c.seq++
	c.sent = NewState()
	r := Delta(c.sent, next, c.seq, true, true)
	c.recent = append(c.recent, Sent{Seq: c.seq, Next: *c.sent})
	return r.ByTop(c.sent)
}

func (c *collector) report(next *State) *Report {
	c.seq++
	before := *c.sent
	r := Delta(c.sent, next, c.seq, false, true)
	c.recent = append(c.recent, Sent{Seq: c.seq, Prev: before, Next: *c.sent})
	return r.ByTop(c.sent)
}

// settle applies r to the aggregator's copy, answering each want from the
// collector as the aggregator's stream does, and returns the wants it took.
func settle(t testing.TB, copy *State, c *collector, r *Report) []string {
	levels, _ := settleBytes(t, copy, c, r)
	return levels
}

// settleBytes is settle that also counts the bytes the collector sent:
// the report and its answers, as JSON.
func settleBytes(t testing.TB, copy *State, c *collector, r *Report) ([]string, int) {
	t.Helper()
	var levels []string
	size := func(v any) int {
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return len(b)
	}
	sent := size(&Message{Type: TypeReport, Report: r})
	for range 8 {
		ok, err := copy.Apply(r)
		var me *MissingError
		if !errors.As(err, &me) {
			if err != nil || !ok {
				t.Fatalf("after wants %v: ok %v, %v", levels, ok, err)
			}
			return levels, sent
		}
		w := &Want{Seq: r.Seq}
		switch {
		case me.Top:
			w.Buckets, levels = true, append(levels, "buckets")
		case len(me.Buckets) > 0:
			w.Delta, levels = me.Buckets, append(levels, "delta")
		default:
			w.Sums, levels = me.Sums, append(levels, "sums")
		}
		ct := Reply(w, c.recent)
		sent += size(&Message{Type: TypeContent, Content: ct})
		cp := *r
		switch {
		case w.Buckets:
			cp.Buckets = ct.Buckets
		case len(w.Delta) > 0:
			cp.Refs = append(slices.Clone(cp.Refs), ct.Refs...)
			cp.Removed = append(slices.Clone(cp.Removed), ct.Removed...)
			cp.Patched = append(slices.Clone(cp.Patched), w.Delta...)
		default:
			byHash := map[string]Frontend{}
			for _, f := range ct.Frontends {
				byHash[f.Sum()] = f
			}
			var refs []Ref
			for _, ref := range cp.Refs {
				if f, ok := byHash[ref.Sum]; ok {
					cp.Frontends = append(cp.Frontends, f)
				} else {
					refs = append(refs, ref)
				}
			}
			cp.Refs = refs
		}
		r = &cp
	}
	t.Fatalf("still missing after wants %v", levels)
	return nil, 0
}

// TestTopsNameWholeStates: a node showing the state another node's copy
// holds names it in one hash; a node whose state is new is asked one level
// down at a time, and pays only for the buckets no copy holds.
func TestTopsNameWholeStates(t *testing.T) {
	pool := NewPool()
	v1 := FromModel(observed(t, synth.Spec{Services: 400, EndpointsPerService: 3}))
	v2 := FromModel(observed(t, synth.Spec{Services: 400, EndpointsPerService: 4}))
	v3 := FromModel(observed(t, synth.Spec{Services: 401, EndpointsPerService: 4}))

	nodes := make([]*State, 3)
	cols := make([]*collector, 3)
	for i := range nodes {
		nodes[i] = NewPooledState(pool)
		cols[i] = &collector{sent: NewState(), seq: 1}
		cp := *v1
		if ok, err := nodes[i].Apply(Delta(cols[i].sent, &cp, 1, true, false)); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	// The first node to show v2 is asked for its bucket names, then for
	// the changed frontends of each bucket, then for their content.
	cp := *v2
	r := cols[0].report(&cp)
	if r.Top == "" || len(r.Frontends)+len(r.Refs)+len(r.Removed) != 0 || r.Buckets != "" {
		t.Fatalf("a report by top: %+v", r)
	}
	if got := settle(t, nodes[0], cols[0], r); len(got) != 3 {
		t.Fatalf("first node showing v2: wants %v, want buckets, delta, sums", got)
	}
	if nodes[0].Root() != v2.Root() || nodes[0].Len() != v2.Len() {
		t.Fatal("the first node's copy is not v2")
	}
	// The second names it in one hash and shares every bucket.
	cp = *v2
	r = cols[1].report(&cp)
	if got := settle(t, nodes[1], cols[1], r); len(got) != 0 {
		t.Fatalf("second node showing v2: wants %v, want none", got)
	}
	if !nodes[1].Same(nodes[0]) {
		t.Fatal("the second node does not share the first's buckets")
	}
	// A node one service ahead: only the buckets of that service are new.
	cp = *v3
	r = cols[2].report(&cp)
	var me *MissingError
	before := *nodes[2]
	if _, err := nodes[2].Apply(r); !errors.As(err, &me) || !me.Top || !before.Same(nodes[2]) {
		t.Fatalf("an unknown top: %v", err)
	}
	buckets := Reply(&Want{Seq: r.Seq, Buckets: true}, cols[2].recent)
	named, _ := decodeBuckets(buckets.Buckets)
	withNames := *r
	withNames.Buckets = buckets.Buckets
	if _, err := nodes[2].Apply(&withNames); !errors.As(err, &me) || len(me.Buckets) == 0 || len(me.Buckets) > 2 || len(me.Buckets) == len(named) {
		t.Fatalf("one service ahead of a known state: %v (%d buckets named)", err, len(named))
	}
	settle(t, nodes[2], cols[2], r)
	if nodes[2].Root() != v3.Root() || nodes[2].Len() != v3.Len() {
		t.Fatal("the third node's copy is not v3")
	}
	wire := len(r.Top) + len(buckets.Buckets)
	t.Logf("v1→v2 changed %d buckets; naming them: %d bytes", len(named), wire)

	// A node's new stream (a leader change) starts with a full snapshot,
	// by top too: one hash when a copy holds that state, else the same
	// levels down from nothing.
	for _, tc := range []struct {
		name   string
		show   *State
		levels int
	}{{"a known state", v3, 0}, {"a state no copy holds", FromModel(observed(t, synth.Spec{Services: 402, EndpointsPerService: 4})), 3}} {
		fresh := NewPooledState(pool)
		c := &collector{seq: 7}
		cp := *tc.show
		r := c.full(&cp)
		if !r.Full || r.Top == "" || len(r.Refs)+len(r.Frontends) != 0 {
			t.Fatalf("%s: a full snapshot by top: %+v", tc.name, r)
		}
		if got := settle(t, fresh, c, r); len(got) != tc.levels {
			t.Errorf("%s: a full snapshot by top took wants %v", tc.name, got)
		}
		differ := 0
		ChangedKeys(fresh, tc.show, func(string) { differ++ })
		if differ != 0 || fresh.Len() != tc.show.Len() {
			t.Errorf("%s: the copy differs from the state in %d frontends", tc.name, differ)
		}
	}
	runtime.KeepAlive(nodes) // the copies that hold v3: the pool keeps only weak references
}

// TestTopsRefuseHostileNames: what a report names whole must be what it
// claims, where it claims; nothing a node sends can make its copy hold a
// bucket at the wrong index or patch a bucket it did not name, and the
// aggregator's own field (Patched) cannot come from the wire.
func TestTopsRefuseHostileNames(t *testing.T) {
	pool := NewPool()
	v1 := FromModel(observed(t, synth.Spec{Services: 200, EndpointsPerService: 3}))
	a := NewPooledState(pool)
	cp := *v1
	if ok, err := a.Apply(Delta(NewState(), &cp, 1, true, false)); !ok || err != nil {
		t.Fatal(ok, err)
	}
	// A bucket's real name, placed at another index.
	var from, to int
	for i, b := range v1.buckets {
		if b != nil {
			from, to = i, (i+1)%nBuckets
			break
		}
	}
	moved := make([]byte, nBuckets/8, nBuckets/8+shortLen)
	moved[to/8] |= 1 << (to % 8)
	moved = append(moved, v1.buckets[from].name[:shortLen]...)
	k := v1.buckets[from].entries[0].Key
	for name, r := range map[string]*Report{
		"a top with frontends":           {Seq: 2, Top: v1.Top(), Removed: []string{k}},
		"a malformed top":                {Seq: 2, Top: "zz"},
		"malformed bucket names":         {Seq: 2, Top: v1.Top(), Buckets: "!!!"},
		"bucket names of the wrong size": {Seq: 2, Top: v1.Top(), Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8+3))},
		"too many bucket names":          {Seq: 2, Top: v1.Top(), Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8+(nBuckets+1)*shortLen))},
		"a frontend outside the patch":   {Seq: 2, Top: v1.Top(), Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8)), Removed: []string{k}},
		"a patch of an unnamed bucket":   {Seq: 2, Top: v1.Top(), Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8)), Patched: []int{3}},
		"bucket names without a top":     {Seq: 2, Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8))},
	} {
		before := *a
		if _, err := a.Apply(r); err == nil || errors.As(err, new(*MissingError)) {
			t.Errorf("%s: %v", name, err)
		}
		if !before.Same(a) {
			t.Errorf("%s: the copy changed", name)
		}
	}
	// A known bucket named at the wrong index is not found there.
	var me *MissingError
	if _, err := a.Apply(&Report{Seq: 2, Top: v1.Top(), Buckets: base64.StdEncoding.EncodeToString(moved)}); !errors.As(err, &me) || len(me.Buckets) != 1 || me.Buckets[0] != to {
		t.Errorf("a bucket at the wrong index: %v", err)
	}
	// Short bucket names that resolve to buckets a copy holds but do not
	// add up to the top the report named: not applied; the named buckets
	// are asked for frontend by frontend.
	v2 := FromModel(observed(t, synth.Spec{Services: 200, EndpointsPerService: 4}))
	v3 := FromModel(observed(t, synth.Spec{Services: 201, EndpointsPerService: 4}))
	other := NewPooledState(pool)
	cp = *v2
	if ok, err := other.Apply(Delta(NewState(), &cp, 1, true, false)); !ok || err != nil {
		t.Fatal(ok, err)
	}
	before := *a
	if ok, err := a.Apply(&Report{Seq: 3, Top: v3.Top(), Root: v3.Root(), Buckets: encodeBuckets(v1, v2)}); ok || !errors.As(err, &me) || len(me.Buckets) == 0 || !before.Same(a) {
		t.Errorf("bucket names not adding up to the top: ok %v, %v, copy changed %v", ok, err, !before.Same(a))
	}
	if ok, err := a.Apply(&Report{Seq: 3, Top: v2.Top(), Root: v2.Root(), Mode: v2.Mode, Families: v2.Families, Buckets: encodeBuckets(v1, v2)}); !ok || err != nil || !a.Same(other) {
		t.Errorf("bucket names adding up to the top: ok %v, %v", ok, err)
	}
	// Content planted under the short name of a bucket another node will
	// show (a 64-bit collision, or 2^64 work): the report's top does not
	// add up, and that node's buckets are asked for frontend by frontend
	// by full hashes instead; its copy ends right, not poisoned, not
	// resynced in a loop.
	planted := NewPooledState(pool)
	cp = *v1
	if _, err := planted.Apply(Delta(NewState(), &cp, 1, true, false)); err != nil {
		t.Fatal(err)
	}
	victim := NewPooledState(pool)
	vc := &collector{sent: NewState(), seq: 1}
	cp = *v1
	if _, err := victim.Apply(Delta(vc.sent, &cp, 1, true, false)); err != nil {
		t.Fatal(err)
	}
	v4 := FromModel(observed(t, synth.Spec{Services: 200, EndpointsPerService: 5}))
	var at int
	for i := range nBuckets {
		if v1.buckets[i] != nil && v4.buckets[i] != nil && v1.buckets[i].name != v4.buckets[i].name {
			at = i
			break
		}
	}
	pool.mu.Lock()
	pool.buckets[short(v4.buckets[at].name)] = pool.buckets[short(planted.buckets[at].name)]
	pool.mu.Unlock()
	cp = *v4
	levels := settle(t, victim, vc, vc.report(&cp))
	differ := 0
	ChangedKeys(victim, v4, func(string) { differ++ })
	t.Logf("a planted short name: wants %v", levels)
	if differ != 0 || len(levels) < 4 {
		t.Errorf("a planted short name: wants %v, the copy differs from what the node shows in %d frontends", levels, differ)
	}
	// Patched never comes from the wire.
	m, err := Decode([]byte(`{"type":"report","report":{"seq":2,"Patched":[1,2],"patched":[3]}}`))
	if err != nil || len(m.Report.Patched) != 0 {
		t.Errorf("Patched from the wire: %v %v", m.Report.Patched, err)
	}
	// A top resolves only to a state some copy held, named from its
	// content: v1's does; the empty state's does not (no copy of this
	// pool was ever empty).
	if _, err := NewPooledState(pool).Apply(&Report{Seq: 2, Top: v1.Top(), Mode: v1.Mode}); err != nil {
		t.Errorf("a known top: %v", err)
	}
	if _, err := NewPooledState(pool).Apply(&Report{Seq: 2, Top: (&State{}).Top()}); !errors.As(err, &me) || !me.Top {
		t.Errorf("an empty state's top: %v, want it missing", err)
	}
	// The pool holds buckets weakly: planted is the last copy holding
	// v1's, so it must outlive the "known top" check above (a collection
	// between them made that check fail one run in four).
	runtime.KeepAlive(planted)
}

// TestTopsAreBounded: the pool remembers a bounded number of states by
// top (oldest forgotten first).
func TestTopsAreBounded(t *testing.T) {
	pool := NewPool()
	base := FromModel(observed(t, synth.Spec{Services: 20, EndpointsPerService: 2}))
	for i := range maxTops + 10 {
		st := base.With(nil, []Frontend{{Key: "198.19.200.1:80/TCP", Scope: "Cluster", Endpoints: []string{"198.18.0.1:" + strconv.Itoa(i+1)}}})
		pool.addTop(st)
	}
	pool.mu.Lock()
	n, o := len(pool.tops), len(pool.order)
	pool.mu.Unlock()
	if n != maxTops || o != maxTops {
		t.Fatalf("%d states by top (%d in order), bound %d", n, o, maxTops)
	}
}

// TestTopsRenewedAfterTheirBucketsWereDropped: every copy leaves a state,
// the collector drops its buckets, then a copy comes back to that state
// with buckets built anew: the state is found by its top again (a node
// rejoining after a leader change names it so), not missing until it
// falls out of the pool's bound.
func TestTopsRenewedAfterTheirBucketsWereDropped(t *testing.T) {
	pool := NewPool()
	v1 := FromModel(observed(t, synth.Spec{Services: 100, EndpointsPerService: 3}))
	v2 := FromModel(observed(t, synth.Spec{Services: 100, EndpointsPerService: 4}))
	apply := func(s *State, v *State) {
		t.Helper()
		cp := *v
		if ok, err := s.Apply(Delta(NewState(), &cp, 1, true, false)); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	a := NewPooledState(pool)
	apply(a, v1)
	apply(a, v2) // no copy holds v1's buckets now
	runtime.GC()
	runtime.GC()
	if pool.top(v1.top()) != nil {
		t.Fatal("v1's buckets are still held: this test would not test a renewal")
	}
	b := NewPooledState(pool)
	apply(b, v1)
	c := NewPooledState(pool)
	if _, err := c.Apply(&Report{Seq: 2, Top: v1.Top(), Root: v1.Root(), Mode: v1.Mode, Families: v1.Families}); err != nil || !c.Same(b) {
		t.Errorf("the top once its state is held again: %v", err)
	}
	pool.mu.Lock()
	n, o := len(pool.tops), len(pool.order)
	pool.mu.Unlock()
	if n != 2 || o != 2 {
		t.Errorf("%d states by top, %d in order; want 2 and 2 (renewed in place)", n, o)
	}
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
}

// BenchmarkNaming compares, in one run, what a node sends per interval at
// the anchors (10k services, 10 endpoints each) after 1,000 endpoint
// changes (10 s of 100 changes a second), naming its changes four ways:
// content (collectors before refs), each changed frontend by hash (refs),
// its whole state by top when another node's copy held that state, and by
// top when the nearest state a copy held is k changes behind (the
// aggregator asks for bucket names, then the changed frontends of the
// buckets no copy holds, then their content).
func BenchmarkNaming(b *testing.B) {
	o, err := synth.Spec{Services: 10000, EndpointsPerService: 10}.Observed()
	if err != nil {
		b.Fatal(err)
	}
	base := FromModel(o)
	var keys []string
	base.Keys(func(k string) { keys = append(keys, k) })
	rng := rand.New(rand.NewPCG(1, 2))
	// states[j] is base after j changes: one endpoint of a random
	// frontend replaced.
	const changes = 1000
	states := []*State{base}
	for j := 1; j <= changes; j++ {
		f, _ := states[j-1].Get(keys[rng.IntN(len(keys))])
		f.Endpoints = append(slices.Clone(f.Endpoints[:len(f.Endpoints)-1]), fmt.Sprintf("198.19.%d.%d:8080", j/250, j%250+1))
		states = append(states, states[j-1].With(nil, []Frontend{f}))
	}
	last := states[changes]
	measure := func(name string, bytes func() int) {
		b.Run(name, func(b *testing.B) {
			var n int
			for b.Loop() {
				n = bytes()
			}
			b.ReportMetric(float64(n), "bytes/interval")
		})
	}
	size := func(r *Report) int {
		buf, err := json.Marshal(&Message{Type: TypeReport, Report: r})
		if err != nil {
			b.Fatal(err)
		}
		return len(buf)
	}
	measure("content", func() int { cp := *base; return size(Delta(&cp, last, 2, false, false)) })
	measure("refs", func() int { cp := *base; return size(Delta(&cp, last, 2, false, true)) })
	// known and behind=k: the node's own copy holds base; another node's
	// copy holds the state k changes before the node's.
	for _, k := range []int{0, 1, 10, 100} {
		name := "top-known"
		if k > 0 {
			name = fmt.Sprintf("top-behind=%d", k)
		}
		measure(name, func() int {
			pool := NewPool()
			other, mine := NewPooledState(pool), NewPooledState(pool)
			for _, st := range []struct {
				copy *State
				to   *State
			}{{other, states[changes-k]}, {mine, base}} {
				cp := *st.to
				if _, err := st.copy.Apply(Delta(NewState(), &cp, 1, true, false)); err != nil {
					b.Fatal(err)
				}
			}
			c := &collector{sent: new(*base), seq: 1}
			cp := *last
			_, n := settleBytes(b, mine, c, c.report(&cp))
			return n
		})
	}
}
