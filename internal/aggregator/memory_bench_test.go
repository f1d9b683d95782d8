package aggregator

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// BenchmarkNodeMemory is the heap the leader holds for each node at the
// anchors (10k services, 100k endpoints), beyond what all nodes share (the
// cluster state, its history, the pooled frontends, the memo of shared
// assessments): each node's copy of its rules, its assessment baseline
// and its judge record, built on the code paths Evaluate runs (assessNode,
// Judge.Observe). in-sync: every node shows the cluster as it is. lagging:
// 10 s into 100 endpoint changes a second, every node shows the cluster of
// 2 s ago (200 services behind, 1,000 changes to account for). Measured
// by dropping all nodes but one and reading the live heap before and
// after, so nothing else runs in between. docs/benchmarks.md (issue #19).
func BenchmarkNodeMemory(b *testing.B) {
	spec := synth.Spec{Services: 10000, EndpointsPerService: 10}
	svcs, sl := spec.Objects()
	states := []*audit.State{audit.FromAPI(svcs, sl, nil)}
	for s := 1; s <= 10; s++ {
		for i := 100 * (s - 1); i < 100*s; i++ {
			sl[i] = spec.Replaced(sl[i], 0, i+1)
		}
		states = append(states, audit.FromAPI(svcs, sl, nil))
	}
	full := func(st *audit.State) *stream.Report {
		return stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(st)), 1, true, false)
	}
	inSync, behind := full(states[0]), full(states[len(states)-3])
	const nodes = 16
	for _, lagging := range []bool{false, true} {
		b.Run(map[bool]string{false: "in-sync", true: "lagging"}[lagging], func(b *testing.B) {
			for b.Loop() {
				t0 := time.Now()
				h := audit.NewHistory(time.Minute)
				h.Update(states[0], t0)
				pool := stream.NewPool()
				a := New(Config{Policy: audit.DefaultPolicy()}, &view.View{})
				observe := func(st *audit.State, n *node, at time.Time) {
					as := a.assessor.assessNode(st, h, n, n.state)
					n.assessments = as
					a.fleet.judge.Observe(n.name, at, at, servicesProgrammed(st), false, as, h)
				}
				show := func(n *node, r *stream.Report) {
					n.state = stream.NewPooledState(pool)
					if _, err := n.state.Apply(CloneReport(r)); err != nil {
						b.Fatal(err)
					}
				}
				a.newGeneration(states[0], h)
				ns := make([]*node, nodes)
				for i := range ns {
					ns[i] = &node{name: fmt.Sprintf("node-%d", i)}
					show(ns[i], inSync)
					observe(states[0], ns[i], t0)
				}
				if lagging {
					for s := 1; s < len(states); s++ {
						h.Update(states[s], t0.Add(time.Duration(s)*time.Second))
					}
					cur := states[len(states)-1]
					a.newGeneration(cur, h)
					for _, n := range ns {
						show(n, behind)
						observe(cur, n, t0.Add(10*time.Second))
					}
					if len(ns[1].assessments) != 200 {
						b.Fatalf("a lagging node has %d assessments, want 200", len(ns[1].assessments))
					}
				}
				all := MemAfterGC().HeapAlloc
				for _, n := range ns[1:] {
					a.fleet.judge.Forget(n.name)
				}
				clear(ns[1:]) // the backing array must not keep them
				ns = ns[:1]
				one := MemAfterGC().HeapAlloc
				b.ReportMetric(float64(int64(all)-int64(one))/(nodes-1)/1e3, "KB/node")
				runtime.KeepAlive(ns)
				runtime.KeepAlive(h)
				runtime.KeepAlive(pool)
				runtime.KeepAlive(a)
			}
		})
	}
}

// MemAfterGC is the memory statistics after two collections (also for
// the package's external benchmarks).
func MemAfterGC() runtime.MemStats {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m
}

// CloneReport copies a report's strings, as decoding each node's own
// report makes them (also for the package's external benchmarks).
func CloneReport(r *stream.Report) *stream.Report {
	cp := *r
	cp.Frontends = make([]stream.Frontend, len(r.Frontends))
	for i, f := range r.Frontends {
		f.Key = string([]byte(f.Key))
		eps := make([]string, len(f.Endpoints))
		for j, e := range f.Endpoints {
			eps[j] = string([]byte(e))
		}
		f.Endpoints = eps
		cp.Frontends[i] = f
	}
	return &cp
}
