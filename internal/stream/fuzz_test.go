package stream

import (
	"bytes"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

// FuzzDecode feeds arbitrary bytes to the aggregator's side of the
// stream: framing, JSON, then validation and apply. It must never panic,
// and a rejected report must leave the state as it was.
func FuzzDecode(f *testing.F) {
	st := NewState()
	o := &audit.Observed{Mode: audit.ModeIPTables, Families: []int{4}}
	full := Delta(st, FromModel(o), 1, true, false)
	var b bytes.Buffer
	Write(&b, &Message{Type: TypeReport, Report: full})
	f.Add(b.Bytes())
	b.Reset()
	Write(&b, &Message{Type: TypeReport, Report: &Report{Seq: 2, Full: true, Frontends: []Frontend{
		{Key: "198.19.0.10:53/UDP", Scope: "cluster", Endpoints: []string{"198.18.128.1:53", "198.18.128.2:53"}, Weights: []int{1, 0}},
		{Key: "nodeport:30080/TCP", Scope: "local", Chain: "KUBE-SVL-X"}}}})
	f.Add(b.Bytes())
	b.Reset()
	Write(&b, &Message{Type: TypeHello, Hello: &Hello{Node: "n1", Token: "t", IntervalSeconds: 10}})
	f.Add(b.Bytes())
	f.Add([]byte("\x00\x00\x00\x02{}"))
	// A pool that knows one state: reports naming it by top, and by
	// bucket names, resolve; mangled ones must not.
	pool := NewPool()
	known := &Report{Seq: 1, Full: true, Mode: "iptables", Frontends: []Frontend{
		{Key: "198.19.0.10:53/UDP", Scope: "cluster", Endpoints: []string{"198.18.128.1:53"}},
		{Key: "198.19.0.11:80/TCP", Scope: "cluster", Endpoints: []string{"198.18.128.2:80", "198.18.128.3:80"}}}}
	holder := NewPooledState(pool)
	if _, err := holder.Apply(known); err != nil {
		f.Fatal(err)
	}
	b.Reset()
	Write(&b, &Message{Type: TypeReport, Report: &Report{Seq: 2, Root: holder.Root(), Mode: "iptables", Top: holder.Top()}})
	Write(&b, &Message{Type: TypeReport, Report: &Report{Seq: 3, Root: holder.Root(), Mode: "iptables", Top: holder.Top(),
		Buckets: encodeBuckets(NewState(), holder)}})
	f.Add(b.Bytes())
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		s := NewPooledState(pool)
		for {
			m, _, err := Read(r, 1<<20)
			if err != nil {
				return
			}
			if m.Report == nil {
				continue
			}
			before := s.Root()
			if _, err := s.Apply(m.Report); err != nil && s.Root() != before {
				t.Fatalf("a rejected report changed the state: %v", err)
			}
			s.Observed()
		}
	})
}
