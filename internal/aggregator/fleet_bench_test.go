package aggregator

import (
	"fmt"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// BenchmarkTick is one second's decision over a fleet of 5,000 nodes, 50
// of them lagging and 10 of those stuck: fleet.tick, and beside it the
// same steps called one by one as Evaluate made them before they were the
// fleet's (the before of #59's step function). ns/op is per tick.
func BenchmarkTick(b *testing.B) {
	const nodes, lagging, stuck = 5000, 50, 10
	p := audit.DefaultPolicy()
	p.Grace = 10 * time.Second
	f := newFleet(p, 0)
	pool := stream.NewPool()
	names := make([]string, nodes)
	h := audit.NewHistory(time.Minute)
	now := t0.Add(20 * time.Second)
	for i := range names {
		names[i] = fmt.Sprintf("node-%04d", i)
		n, _ := f.register(names[i], "v1", &conn{}, pool)
		at := now.Add(-time.Second)
		var as []audit.ServiceAssessment
		switch {
		case i < stuck:
			as = []audit.ServiceAssessment{{Service: "default/dns", State: audit.Lagging, Since: t0}}
		case i < lagging:
			as = []audit.ServiceAssessment{{Service: "default/dns", State: audit.Lagging, Since: now.Add(-5 * time.Second)}}
		}
		f.judge.Heard(names[i], audit.Heartbeat{At: at, Interval: 10 * time.Second, Mode: audit.Mode("iptables")})
		f.judge.Observe(names[i], at, at, 100, false, as, h)
		n.heard = at
		n.state.Families = []int{4}
	}
	c := cycle{families: []int{4}}
	b.Run("tick", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			d := f.tick(now, names, c, false)
			if len(d.v.Nodes) != nodes {
				b.Fatalf("%d nodes judged", len(d.v.Nodes))
			}
		}
	})
	b.Run("inline", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			v := f.judge.Evaluate(now, names)
			addConntrack(&v, c.stale, c.ctErrs)
			gone := f.prune(&v)
			audit.WarnKnownBad(&v, c.nodeInfo)
			f.warnUnaudited(&v, c.families)
			asks := f.readNowDue(now, &v, false)
			if len(v.Nodes) != nodes || len(gone) != 0 {
				b.Fatalf("%d nodes judged, %d gone", len(v.Nodes), len(gone))
			}
			_ = asks
		}
	})
}
