package aggregator

import (
	"fmt"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// BenchmarkEvaluateCycle is the assessment part of one evaluation cycle at
// the anchors (10k services, 100k endpoints) for nodes that reported since
// the last one, spread over the three versions of the cluster a churning
// fleet shows at once: each node assessed on its own (before) and through
// the per-class memo (shared). ns/op is per cycle.
func BenchmarkEvaluateCycle(b *testing.B) {
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	svcs, sl := spec.Objects()
	var states []*audit.State
	h := audit.NewHistory(time.Minute)
	now := time.Now()
	for v := range 3 {
		for i := range 50 * v {
			sl[i] = spec.Replaced(sl[i], 0, i)
		}
		st := audit.FromAPI(svcs, sl, nil)
		h.Update(st, now.Add(time.Duration(v-3)*time.Second))
		states = append(states, st)
	}
	cur := states[len(states)-1]
	pool := stream.NewPool()
	var shows []*stream.State
	for _, st := range states {
		s := stream.NewPooledState(pool)
		if _, err := s.Apply(stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(st)), 1, true, false)); err != nil {
			b.Fatal(err)
		}
		shows = append(shows, s)
	}
	const nodes = 12
	for _, shared := range []bool{false, true} {
		b.Run(fmt.Sprintf("%d-nodes/%s", nodes, map[bool]string{false: "each", true: "shared"}[shared]), func(b *testing.B) {
			a := New(Config{}, &View{})
			b.ReportAllocs()
			for b.Loop() {
				a.memo, a.classes = map[[2]uint64][]assessed{}, audit.NodeClasses(cur)
				for n := range nodes {
					name := fmt.Sprintf("node-%d", n)
					rules := shows[n%len(shows)]
					if shared {
						a.assessNode(cur, h, &node{name: name}, rules)
					} else {
						audit.Assess(cur, h, name, rules.Observed())
					}
				}
			}
		})
	}
}

// BenchmarkAssessNodeIncremental is one node's assessment at the anchors
// after 1,000 services changed in the cluster (10 s of 100 changes a
// second) and the node followed: from the
// node's baseline (only those services) and in full, side by side.
func BenchmarkAssessNodeIncremental(b *testing.B) {
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	svcs, sl := spec.Objects()
	h := audit.NewHistory(time.Minute)
	now := time.Now()
	var states []*audit.State
	var rules []*stream.State
	pool := stream.NewPool()
	for v := range 2 {
		for i := range 1000 * v {
			sl[i] = spec.Replaced(sl[i], 0, i)
		}
		st := audit.FromAPI(svcs, sl, nil)
		states = append(states, st)
		r := stream.NewPooledState(pool)
		if _, err := r.Apply(stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(st)), 1, true, false)); err != nil {
			b.Fatal(err)
		}
		rules = append(rules, r)
	}
	h.Update(states[0], now.Add(-time.Second))
	a := New(Config{}, &View{})
	a.memo, a.classes = map[[2]uint64][]assessed{}, audit.NodeClasses(states[0])
	n := &node{name: "node-1"}
	a.assessNode(states[0], h, n, rules[0])
	base := *n.base
	h.Update(states[1], now)
	a.memo, a.classes = map[[2]uint64][]assessed{}, audit.NodeClasses(states[1])
	b.Run("incremental", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			cp := base
			cp.byService = map[string]audit.ServiceAssessment{}
			n.base = &cp
			if as := a.assessNode(states[1], h, n, rules[1]); len(as) != 0 {
				b.Fatalf("%d services out of sync", len(as))
			}
		}
	})
	b.Run("full", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if as := audit.Assess(states[1], h, "node-1", rules[1].Observed()); len(as) != 0 {
				b.Fatalf("%d services out of sync", len(as))
			}
		}
	})
}
