package aggregator

import (
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
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
	synctest.Test(t, func(t *testing.T) {
		const grace, debounce = 2 * time.Second, 2 * time.Second
		h := startView(t, grace, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: debounce})
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
				synctest.Wait()
				continue
			}
			h.clk.Step(step - time.Millisecond)
			synctest.Wait()
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
				n := h.agg.fleet.nodes["n1"]
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
	})
}

// A healthy node under churn while the leader's State is held for ten
// times grace (an evaluation cycle that long, as a new leader's was at
// 2,000 nodes) and after: no finding, ever. The node's kube-proxy shows
// the cluster as it was a second ago, as a live one does; the versions
// the held-back rebuild folds must keep their own times, or the node
// looks as far behind as the rebuild was late (StuckProxy), or its
// version is pruned as too old (Divergent).
func TestHeldBackStateRaisesNoFalseFinding(t *testing.T) {
	const grace, hold, delay = 4 * time.Second, 40 * time.Second, time.Second
	h := startView(t, grace, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: time.Second})
	h.settle = realTime // the view's State held: see realTime
	// The cluster's history: which services have dropped their last
	// endpoint, from when; the node reads it delay late.
	type change struct {
		at    time.Time
		drops []int
	}
	var mu sync.Mutex
	history := []change{{at: h.clk.Now()}}
	shown := func() *audit.Observed {
		mu.Lock()
		defer mu.Unlock()
		i := len(history) - 1
		for i > 0 && history[i].at.After(h.clk.Now().Add(-delay)) {
			i--
		}
		return rules(t, history[i].drops...)
	}
	h.collector(h.ctx, "n1", shown)
	h.until(10*time.Second, "n1 in sync", func() bool { return inSync(h, "n1") })

	sl, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).List(h.ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	byService := map[string]*discoveryv1.EndpointSlice{}
	for i := range sl.Items {
		byService[sl.Items[i].Labels[discoveryv1.LabelServiceName]] = &sl.Items[i]
	}
	full := map[string][]discoveryv1.Endpoint{}
	k := 0
	churn := func() { // one service flips between all endpoints and one fewer
		svc := k % spec.Services
		k++
		s := byService[synth.ServiceName(svc)]
		if full[s.Name] == nil {
			full[s.Name] = s.Endpoints
		}
		mu.Lock()
		drops := slices.Clone(history[len(history)-1].drops)
		mu.Unlock()
		if i := slices.Index(drops, svc); i >= 0 {
			drops = slices.Delete(drops, i, i+1)
			s.Endpoints = full[s.Name]
		} else {
			drops = append(drops, svc)
			s.Endpoints = full[s.Name][:len(full[s.Name])-1]
		}
		if _, err := h.client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		history = append(history, change{at: h.clk.Now(), drops: drops})
		mu.Unlock()
	}
	noFinding := func(when string) { // n2 and n3 have no collector
		for _, f := range h.verdict().Findings {
			if f.Node == "n1" || f.Node == "" {
				t.Fatalf("%s: %s %s %s (%s)", when, f.Node, f.Kind, f.Service, f.Detail)
			}
		}
	}
	// Churn with evaluations, then with the State held (no rebuild can
	// publish, no evaluation runs), then with evaluations again.
	every := 500 * time.Millisecond
	ticks := 0
	tick := func() {
		if ticks++; ticks%int(every/step) == 0 {
			churn()
		}
	}
	h.advance(3*grace, func() { tick(); noFinding("under churn") })
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseOnce)
	go h.agg.view.Read(func(*audit.State, *audit.History, uint64) { close(held); <-release })
	<-held
	for end := h.clk.Now().Add(hold); h.clk.Now().Before(end); {
		h.clk.Step(step)
		h.settle()
		tick()
	}
	releaseOnce()
	h.advance(5*grace, func() { tick(); noFinding("after the State was held " + hold.String()) })
	if st := h.verdict().Nodes[0]; st.Node != "n1" || st.State != audit.NodeInSync && st.State != audit.NodeLagging {
		t.Fatalf("n1 after the hold: %+v", st)
	}
}

func inSync(h *harness, node string) bool {
	for _, n := range h.verdict().Nodes {
		if n.Node == node {
			return n.State == audit.NodeInSync
		}
	}
	return false
}

// A flush is reported at once and kube-proxy's next sync rewrites part of
// the table a moment later: the node shows no rules, then services without
// endpoints, then another change, all before the aggregator next judges.
// The drift is dated by the first of them, not by the report the
// judgement happens to meet (before, the third: a flush seen 0.03 s after
// the command was dated a second late).
//
// "after a change": the node reported a change of its own just before the
// flush, and no judgement reached that report either. Before every
// unjudged report was queued, only the earliest was kept, the flush's
// report was the one dropped, and the flush was dated by the third report
// (seen on a loaded CI machine: a flush under churn dated 1.085 s after
// the command).
func TestDriftDatedByTheFirstReportShowingIt(t *testing.T) {
	for _, name := range []string{"in sync", "after a change"} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { driftDatedByFirstReport(t, name == "after a change") })
		})
	}
}

func driftDatedByFirstReport(t *testing.T, changeBefore bool) {
	const grace = 2 * time.Second
	h := startWith(t, grace, auth.InsecureNoAuth{}, fakeCluster(), nil)
	c := h.dial("n1")
	expect(t, c, stream.TypeWelcome, "")
	st, seq := stream.NewState(), uint64(0)
	send := func(o *audit.Observed) time.Time {
		t.Helper()
		seq++
		next := stream.FromModel(o)
		if err := stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: stream.Delta(st, next, seq, seq == 1, false)}); err != nil {
			t.Fatal(err)
		}
		*st = *next
		h.eventually(5*time.Second, "the report applied", func() bool {
			h.agg.mu.Lock()
			defer h.agg.mu.Unlock()
			n := h.agg.fleet.nodes["n1"]
			return n != nil && n.lastSeq == seq
		})
		return h.clk.Now()
	}
	send(rules(t))
	h.until(10*time.Second, "n1 in sync", func() bool { return inSync(h, "n1") })

	if changeBefore {
		h.clk.Step(step)
		send(rules(t, 1)) // service 1 drifts; the next sync repairs it
	}
	h.clk.Step(step)
	flushed := send(&audit.Observed{Mode: audit.ModeIPTables, NoRules: true, Families: []int{4}})
	h.clk.Step(step)
	send(rules(t, 0, 1))
	h.clk.Step(step)
	send(rules(t, 0))
	last := rules(t, 0)
	for i := 1; !strings.Contains(kindsOf(h.verdict()), "n1:MissingEndpoint"); i++ {
		if h.clk.Since(flushed) > 4*grace {
			t.Fatalf("n1's drift not found within %s: %s", 4*grace, kindsOf(h.verdict()))
		}
		h.clk.Step(step)
		synctest.Wait()
		if i%10 == 0 {
			send(last) // the node keeps reporting
		}
		h.agg.Evaluate()
	}
	for _, f := range h.verdict().Findings {
		if f.Node == "n1" && strings.HasSuffix(f.Service, "/"+synth.ServiceName(1)) {
			t.Errorf("service 1 was repaired by the sync after the flush: %+v", f)
		}
		if f.Node == "n1" && !f.Since.Equal(flushed) {
			t.Errorf("%s %s dated %s after the flush was first reported", f.Kind, f.Service, f.Since.Sub(flushed))
		}
	}
}

// A node's queue of unjudged reports keeps, when full, the earliest (it
// dates a drift) and those without rules (they date everything after).
func TestKeepShownDropsTheIntermediate(t *testing.T) {
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	var q []shown
	for i := range maxShown {
		q = keepShown(q, shown{at: at(i), noRules: i == 1})
	}
	q = keepShown(q, shown{at: at(maxShown)})
	var got []int
	for _, s := range q {
		got = append(got, int(s.at.Sub(t0)/time.Second))
	}
	if want := []int{0, 1, 3, 4}; !slices.Equal(got, want) {
		t.Errorf("kept the reports of seconds %v, want %v", got, want)
	}
}
