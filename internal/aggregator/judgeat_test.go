package aggregator

import (
	"strings"
	"testing"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

func TestJudgeAt(t *testing.T) {
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	var zero time.Time
	for _, c := range []struct {
		name                             string
		heard, shownSince, judged, cover time.Time
		want                             time.Time
		ok                               bool
	}{
		{"covered report: its own time", at(10), at(2), at(8), at(11), at(10), true},
		{"report ahead of the view, rules shown before: the covered time", at(10), at(2), at(8), at(9), at(9), true},
		{"nothing new covered since the last judgement", at(10), at(2), at(9), at(9), zero, false},
		{"rules first shown after the covered time wait", at(10), at(10), at(8), at(9), zero, false},
		{"no rules shown yet on this stream", at(10), zero, zero, at(9), zero, false},
		{"a report a judgement already passed", at(10), at(2), at(10), at(11), zero, false},
	} {
		got, ok := judgeAt(c.heard, c.shownSince, c.judged, c.cover)
		if ok != c.ok || !got.Equal(c.want) {
			t.Errorf("%s: judgeAt = %v, %v; want %v, %v", c.name, got, ok, c.want, c.ok)
		}
	}
}

// A node whose reports always arrive after the time the view covers (the
// view trails a churning API by its debounce; here 2 s, reports four a
// second, each just after a rebuild) must still be judged. Its kube-proxy
// missed a change and its rules never move: StuckProxy within grace and
// one debounce. Before judgeAt's second case no report was ever judged
// again after the change and the node stayed "Lagging" for good (the
// fleet simulation's 15-45 s outliers).
func TestReportsOutrunningTheViewAreJudged(t *testing.T) {
	const grace, debounce = 2 * time.Second, 2 * time.Second
	h := startView(t, grace, InsecureNoAuth{}, fakeCluster(), ViewConfig{Debounce: debounce})
	c := h.dial("n1")
	expect(t, c, stream.TypeWelcome, "")
	st := stream.NewState()
	seq := uint64(1)
	if err := stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(st, stream.FromModel(rules(t)), seq, true, false)}); err != nil {
		t.Fatal(err)
	}
	n1 := func() audit.NodeStatus {
		for _, n := range h.verdict().Nodes {
			if n.Node == "n1" {
				return n
			}
		}
		return audit.NodeStatus{}
	}
	h.until(10*time.Second, "n1 in sync", func() bool { return n1().State == audit.NodeInSync })

	// The change n1's kube-proxy misses, then churn on another service
	// that keeps the view dirty (its covered time is its last rebuild).
	// setSlice gives svc's slice its first k endpoints of those it had.
	orig := map[string][]discoveryv1.Endpoint{}
	setSlice := func(svc string, k int) {
		sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).List(h.ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i := range sl.Items {
			s := &sl.Items[i]
			if s.Labels[discoveryv1.LabelServiceName] != svc {
				continue
			}
			if orig[svc] == nil {
				orig[svc] = s.Endpoints
			}
			s.Endpoints = orig[svc][:k]
			if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
				t.Fatal(err)
			}
			return
		}
		t.Fatalf("no slice of %s", svc)
	}
	setSlice(synth.ServiceName(0), spec.EndpointsPerService-1)
	changed := h.clk.Now()
	var rebuilt time.Time
	i := 0
	for h.clk.Since(changed) < grace+3*debounce {
		if i++; i%10 == 0 {
			setSlice(synth.ServiceName(1), spec.EndpointsPerService-i/10%2)
		}
		if i%5 != 0 {
			h.clk.Step(step)
			time.Sleep(yield)
			continue
		}
		h.clk.Step(step - time.Millisecond)
		time.Sleep(yield)
		// Just after any rebuild this step made, n1 reports its unchanged
		// rules (4 a second, as many as a stream may send), and only then
		// is it judged: the report is always newer than the covered time.
		h.clk.Step(time.Millisecond)
		seq++
		same := *st
		if err := stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(st, &same, seq, false, false)}); err != nil {
			t.Fatal(err)
		}
		h.eventually(5*time.Second, "the report applied", func() bool {
			h.agg.mu.Lock()
			defer h.agg.mu.Unlock()
			n := h.agg.nodes["n1"]
			return n != nil && n.lastSeq == seq
		})
		if cov := h.agg.view.Covered(); cov.After(rebuilt) {
			rebuilt = cov
		}
		h.agg.Evaluate()
		if strings.Contains(kindsOf(h.verdict()), "n1:StuckProxy") {
			t.Logf("n1 StuckProxy %s after the change (grace %s, view debounce %s; every report newer than the view's covered time)",
				h.clk.Since(changed).Round(step), grace, debounce)
			return
		}
	}
	stale, why := h.agg.Stale()
	t.Fatalf("n1 not found stuck within %s of the change (grace %s + the view's debounce): %+v; the view covered up to %s after the change; stale %v %s",
		grace+3*debounce, grace, n1(), rebuilt.Sub(changed), stale, why)
}
