package audit

import (
	corev1 "k8s.io/api/core/v1"
	"testing"
	"time"
)

// Nodes of a class showing the same rules share one assessment, made for
// the first of them: each node's findings still name that node, and a
// draining real server keeps its age whichever node the shared copy was
// made for.
func TestSharedAssessmentsNameTheirNode(t *testing.T) {
	p := DefaultPolicy()
	p.Grace, p.WeightZeroLimit = time.Second, time.Minute
	j := NewJudge(p)
	h := NewHistory(time.Minute)
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	h.Update(&State{}, t0)
	made := func(node string) []ServiceAssessment {
		return []ServiceAssessment{{Service: "ns/a", State: Divergent, Findings: []Finding{{Node: node, Kind: StaleEndpoint, Service: "ns/a", Endpoint: "198.18.5.5:80"}}},
			{Service: "ns/b", State: InSync, Draining: []Finding{{Node: node, Kind: StaleEndpoint, Service: "ns/b", Endpoint: "198.18.6.6:80"}}}}
	}
	shared := made("n1")
	for i, at := range []time.Time{t0, t0.Add(30 * time.Second), t0.Add(90 * time.Second)} {
		as := shared
		if i == 1 {
			as = made("n3") // the next cycle's memo was made for another node
		}
		for _, n := range []string{"n1", "n2"} {
			j.Heard(n, Heartbeat{At: at, Interval: time.Second})
			j.Observe(n, at, at, 2, false, as, h)
		}
	}
	v := j.Evaluate(t0.Add(90*time.Second), []string{"n1", "n2"})
	got := map[string]int{}
	for _, f := range v.Findings {
		got[f.Node+" "+f.Endpoint]++
	}
	for _, n := range []string{"n1", "n2"} {
		if got[n+" 198.18.5.5:80"] != 1 {
			t.Errorf("%s: its divergent finding is not reported under its name: %v", n, got)
		}
		if got[n+" 198.18.6.6:80"] != 1 {
			t.Errorf("%s: the real server draining for 90 s (limit 1m) is not reported under its name: %v", n, got)
		}
	}
}

// A node judged long after its rules last changed (a new leader, a slow
// cycle) programmed the changes those rules show when it first showed
// them, not when it was judged: its latency samples end at shown.
func TestLagSamplesEndWhenTheRulesWereShown(t *testing.T) {
	j := NewJudge(DefaultPolicy())
	h := NewHistory(time.Minute)
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	svc := func(port int32) *State {
		return &State{Services: []Service{{Namespace: "ns", Name: "a", Ports: []corev1.ServicePort{{Name: "http", Port: port}}}}}
	}
	h.Update(svc(80), t0)
	j.Heard("n1", Heartbeat{At: t0, Interval: time.Second})
	j.Observe("n1", t0, t0, 1, false, nil, h)
	h.Update(svc(81), t0.Add(time.Second)) // the change, shown 2 s later, judged 40 s later
	got := j.Observe("n1", t0.Add(41*time.Second), t0.Add(3*time.Second), 1, false, nil, h)
	if len(got) != 1 || got[0] != 2*time.Second {
		t.Fatalf("latency samples %v, want [2s]: the rules showed the change 2 s after it", got)
	}
}

// A node that shows no rules has been broken since it first showed none,
// whenever the report is judged: an aggregator whose view covered the
// report only a second later must not date the flush a second late.
func TestNoRulesDatedWhenFirstShown(t *testing.T) {
	p := DefaultPolicy()
	j := NewJudge(p)
	h := NewHistory(time.Minute)
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	h.Update(&State{Services: []Service{{Namespace: "ns", Name: "a", Ports: []corev1.ServicePort{{Name: "http", Port: 80}}}}}, t0)
	j.Heard("n1", Heartbeat{At: t0, Interval: time.Second})
	j.Observe("n1", t0, t0, 1, false, nil, h)
	flushed := t0.Add(10 * time.Second)
	for at := flushed.Add(900 * time.Millisecond); !at.After(flushed.Add(p.Grace + 2*time.Second)); at = at.Add(time.Second) {
		j.Heard("n1", Heartbeat{At: at, Interval: time.Second})
		j.Observe("n1", at, flushed, 1, true, nil, h)
	}
	v := Conclude(p, j.JudgeNodes(flushed.Add(p.Grace+2*time.Second), []string{"n1"}))
	for _, f := range v.Findings {
		if f.Kind == NoRules && f.Since.Equal(flushed) {
			return
		}
	}
	t.Fatalf("want NoRules since the rules were first shown gone (%s): %+v", flushed, v.Findings)
}
