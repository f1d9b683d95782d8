package aggregator_test

// What the aggregator pays per cluster change and per node report at the
// scalability anchors (10k services, 100k endpoints), measured on the same
// code paths View.rebuild and Aggregator.Evaluate/apply run.
// docs/benchmarks.md records the results and how they scale to a fleet.

import (
	"runtime"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var anchor = synth.Spec{Services: 10000, EndpointsPerService: 10}

type cluster struct {
	svcs   []corev1.Service
	slices []discoveryv1.EndpointSlice
	st     *audit.State
}

func anchorCluster() cluster {
	svcs, sl := anchor.Objects()
	return cluster{svcs: svcs, slices: sl, st: audit.FromAPI(svcs, sl, nil)}
}

// churned returns the cluster with one endpoint replaced in each of the
// first n services' slices.
func (c cluster) churned(n int) cluster {
	sl := make([]discoveryv1.EndpointSlice, len(c.slices))
	copy(sl, c.slices)
	for i := range n {
		sl[i] = anchor.Replaced(sl[i], 0, i)
	}
	return cluster{svcs: c.svcs, slices: sl, st: audit.FromAPI(c.svcs, sl, nil)}
}

// BenchmarkRebuild is View.rebuild after a batch of changes: the State
// from the informer caches from scratch, recorded in the History.
func BenchmarkRebuild(b *testing.B) {
	c := anchorCluster()
	h := audit.NewHistory(time.Minute)
	h.Update(c.st, time.Now())
	c2 := c.churned(100)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		cur := c
		if i%2 == 0 {
			cur = c2
		}
		h.Update(audit.FromAPI(cur.svcs, cur.slices, nil), time.Now())
	}
}

// BenchmarkAssessNode is one node's assessment as Evaluate makes it after
// its report or a cluster change: its stream copy turned into the audit
// model, then Assess. Multiplied by the nodes that reported, it is the cost
// of one evaluation cycle.
func BenchmarkAssessNode(b *testing.B) {
	c := anchorCluster()
	c2 := c.churned(100)
	h := audit.NewHistory(time.Minute)
	now := time.Now()
	h.Update(c.st, now.Add(-2*time.Second))
	h.Update(c2.st, now)
	for _, tc := range []struct {
		name  string
		shows *audit.State
	}{{"in-sync", c2.st}, {"lagging-100-services", c.st}} {
		b.Run(tc.name, func(b *testing.B) {
			copy := stream.FromModel(synth.Rules(tc.shows))
			b.ReportAllocs()
			var as []audit.ServiceAssessment
			for b.Loop() {
				as = audit.Assess(c2.st, h, "node-1", copy.Observed())
			}
			if (tc.shows == c2.st) != (len(as) == 0) {
				b.Fatalf("%s: %d services assessed out of sync", tc.name, len(as))
			}
		})
	}
}

// BenchmarkApplyReport is the aggregator applying one node's report of 100
// changed frontends to its copy of the node's rules.
func BenchmarkApplyReport(b *testing.B) {
	c := anchorCluster()
	from := stream.FromModel(synth.Rules(c.st))
	to := stream.FromModel(synth.Rules(c.churned(100).st))
	cp := *from
	r := stream.Delta(&cp, to, 1, false, false)
	if len(r.Frontends) != 100 {
		b.Fatalf("delta of %d frontends", len(r.Frontends))
	}
	full := stream.Delta(stream.NewState(), from, 1, true, false)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		b.StopTimer()
		copy := stream.NewState()
		if _, err := copy.Apply(full); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		if ok, err := copy.Apply(r); err != nil || !ok {
			b.Fatalf("apply: %v %v", ok, err)
		}
	}
}

// BenchmarkNodeCopyMemory reports the heap one node's copy of its rules
// takes on the aggregator (MB/node), each decoded from its own full
// snapshot: kept apart (every node its own strings, as before the pool)
// and pooled (identical frontends and buckets kept once).
func BenchmarkNodeCopyMemory(b *testing.B) {
	c := anchorCluster()
	full := stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(c.st)), 1, true, false)
	const copies = 8
	for _, pooled := range []bool{false, true} {
		b.Run(map[bool]string{false: "apart", true: "pooled"}[pooled], func(b *testing.B) {
			for b.Loop() {
				pool := stream.NewPool()
				before := aggregator.MemAfterGC().HeapInuse
				held := make([]*stream.State, copies)
				var first uint64
				for i := range held {
					if i == 1 {
						first = aggregator.MemAfterGC().HeapInuse
					}
					held[i] = stream.NewState()
					if pooled {
						held[i] = stream.NewPooledState(pool)
					}
					// Each node's report is decoded on its own.
					if _, err := held[i].Apply(aggregator.CloneReport(full)); err != nil {
						b.Fatal(err)
					}
				}
				after := aggregator.MemAfterGC().HeapInuse
				b.ReportMetric(float64(first-before)/1e6, "MB-first-node")
				b.ReportMetric(float64(after-first)/(copies-1)/1e6, "MB/further-node")
				runtime.KeepAlive(held)
			}
		})
	}
}
