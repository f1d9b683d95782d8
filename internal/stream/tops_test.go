package stream

import (
	"encoding/base64"
	"errors"
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

func (c *collector) report(next *State) *Report {
	c.seq++
	before := *c.sent
	r := Delta(c.sent, next, c.seq, false, true)
	c.recent = append(c.recent, Sent{Seq: c.seq, Prev: before, Next: *c.sent})
	return r.ByTop(c.sent)
}

// settle applies r to the aggregator's copy, answering each want from the
// collector as the aggregator's stream does, and returns the wants it took.
func settle(t *testing.T, copy *State, c *collector, r *Report) []string {
	t.Helper()
	var levels []string
	for range 4 {
		ok, err := copy.Apply(r)
		var me *MissingError
		if !errors.As(err, &me) {
			if err != nil || !ok {
				t.Fatalf("after wants %v: ok %v, %v", levels, ok, err)
			}
			return levels
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
		cp := *r
		switch {
		case w.Buckets:
			cp.Buckets = ct.Buckets
		case len(w.Delta) > 0:
			cp.Refs, cp.Removed, cp.Patched = ct.Refs, ct.Removed, w.Delta
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
	return nil
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
	moved := make([]byte, nBuckets/8, nBuckets/8+sumLen)
	moved[to/8] |= 1 << (to % 8)
	moved = append(moved, v1.buckets[from].name[:]...)
	k := v1.buckets[from].entries[0].Key
	for name, r := range map[string]*Report{
		"a full snapshot naming a top":   {Seq: 2, Full: true, Top: v1.Top()},
		"a top with frontends":           {Seq: 2, Top: v1.Top(), Removed: []string{k}},
		"a malformed top":                {Seq: 2, Top: "zz"},
		"malformed bucket names":         {Seq: 2, Buckets: "!!!"},
		"bucket names of the wrong size": {Seq: 2, Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8+3))},
		"too many bucket names":          {Seq: 2, Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8+(nBuckets+1)*sumLen))},
		"a frontend outside the patch":   {Seq: 2, Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8)), Removed: []string{k}},
		"a patch of an unnamed bucket":   {Seq: 2, Buckets: base64.StdEncoding.EncodeToString(make([]byte, nBuckets/8)), Patched: []int{3}},
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
	if _, err := a.Apply(&Report{Seq: 2, Buckets: base64.StdEncoding.EncodeToString(moved)}); !errors.As(err, &me) || len(me.Buckets) != 1 || me.Buckets[0] != to {
		t.Errorf("a bucket at the wrong index: %v", err)
	}
	// Patched never comes from the wire.
	m, err := Decode([]byte(`{"type":"report","report":{"seq":2,"Patched":[1,2],"patched":[3]}}`))
	if err != nil || len(m.Report.Patched) != 0 {
		t.Errorf("Patched from the wire: %v %v", m.Report.Patched, err)
	}
	// A top names only states some copy held, computed from the content.
	if _, err := NewPooledState(pool).Apply(&Report{Seq: 2, Top: v1.Top(), Mode: v1.Mode}); err != nil {
		// NewPooledState has no full snapshot: the aggregator refuses
		// deltas before one; here the state simply takes v1's buckets.
		t.Errorf("a known top: %v", err)
	}
	if _, err := NewPooledState(pool).Apply(&Report{Seq: 2, Top: (&State{}).Top()}); err == nil {
		// The empty state's top: no copy of this pool was ever empty.
		t.Error("an empty state's top resolved")
	}
}

// TestTopsAreBounded: the pool remembers a bounded number of states by
// top, and forgets one whose buckets nobody holds.
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
