package aggregator

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
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
			a := New(Config{}, &view.View{})
			b.ReportAllocs()
			for b.Loop() {
				a.newGeneration(cur, h)
				for n := range nodes {
					name := fmt.Sprintf("node-%d", n)
					rules := shows[n%len(shows)]
					if shared {
						a.assessor.assessNode(cur, h, &node{name: name}, rules)
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
	a := New(Config{}, &view.View{})
	a.newGeneration(states[0], h)
	n := &node{name: "node-1"}
	a.assessor.assessNode(states[0], h, n, rules[0])
	base := *n.base
	h.Update(states[1], now)
	a.newGeneration(states[1], h)
	b.Run("incremental", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			b.StopTimer()
			a.newGeneration(states[1], h) // nothing shared from the last iteration
			cp := base
			n.base = &cp
			b.StartTimer()
			if as := a.assessor.assessNode(states[1], h, n, rules[1]); len(as) != 0 {
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

// BenchmarkTakeoverCycle is the assessment work of a new leader's first
// cycles at the anchors (10k services, 100k endpoints) under 100 changes
// a second, for 40 nodes whose kube-proxies each show the cluster at a
// moment of their own over the last 10 s (no two alike, as real ones
// sync at their own times). "first" assesses them with no baselines (a
// takeover: every stream is new); "next" is the cycle after, 1,000
// changes later, every node having followed. Each side by side: every
// node on its own (isolated, the code before) and with peers' baselines
// and per-service results shared. ns/op is per cycle.
func BenchmarkTakeoverCycle(b *testing.B) {
	const nodes, changes = 40, 1000
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	svcs, sl := spec.Objects()
	base := audit.FromAPI(svcs, sl, nil)
	t0 := time.Now()
	h := audit.NewHistory(time.Minute)
	h.Update(base, t0)
	// The cluster after each change k of 2×changes: service k·7919 mod
	// 10k replaces an endpoint, 10 ms apart.
	byKey := map[string]int{}
	for i := range base.Services {
		byKey[base.Services[i].Name] = i
	}
	cur := &audit.State{Services: slices.Clone(base.Services), Nodes: base.Nodes}
	type change struct {
		i   int
		old audit.Service
	}
	var log []change
	at := func(k int) time.Time { return t0.Add(time.Duration(k) * 10 * time.Millisecond) }
	advance := func(from, to int) {
		for k := from; k < to; k++ {
			i := (k * 7919) % len(sl)
			sl[i] = spec.Replaced(sl[i], k%spec.EndpointsPerService, k)
			one := audit.FromAPI(svcs[i:i+1], sl[i:i+1], nil).Services[0]
			log = append(log, change{i: byKey[one.Name], old: cur.Services[byKey[one.Name]]})
			cur.Services[byKey[one.Name]] = one
			h.Passed(&cur.Services[byKey[one.Name]], at(k))
		}
		cp := *cur
		cp.Services = slices.Clone(cur.Services)
		cur = &cp
		h.Update(cur, at(to))
	}
	// shows is the cluster as it was back changes ago.
	shows := func(back int) *audit.State {
		st := &audit.State{Services: slices.Clone(cur.Services), Nodes: cur.Nodes}
		for k := len(log) - 1; k >= len(log)-back; k-- {
			st.Services[log[k].i] = log[k].old
		}
		return st
	}
	pool := stream.NewPool()
	rulesOf := func(st *audit.State) *stream.State {
		r := stream.NewPooledState(pool)
		if _, err := r.Apply(stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(st)), 1, true, false)); err != nil {
			b.Fatal(err)
		}
		return r
	}
	advance(0, changes)
	first := make([]*stream.State, nodes)
	for i := range first {
		first[i] = rulesOf(shows(i * changes / nodes))
	}
	firstState := cur
	advance(changes, 2*changes)
	next := make([]*stream.State, nodes)
	for i := range next {
		next[i] = rulesOf(shows(i * changes / nodes))
	}
	nextState := cur
	for _, isolated := range []bool{true, false} {
		name := map[bool]string{true: "isolated", false: "shared"}[isolated]
		var ns []*node
		var a *Aggregator
		fresh := func() {
			a = New(Config{}, &view.View{})
			a.assessor.isolated = isolated
			ns = make([]*node, nodes)
			for i := range ns {
				ns[i] = &node{name: fmt.Sprintf("node-%d", i)}
			}
		}
		cycle := func(st *audit.State, rules []*stream.State) {
			a.newGeneration(st, h)
			for i, n := range ns {
				a.assessor.assessNode(st, h, n, rules[i])
			}
		}
		b.Run("first/"+name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				fresh()
				cycle(firstState, first)
			}
		})
		b.Run("next/"+name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				b.StopTimer()
				fresh()
				cycle(firstState, first)
				b.StartTimer()
				cycle(nextState, next)
			}
		})
	}
}
