package aggregator

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// TestIncrementalAssessmentEqualsFull drives a node's baseline through 300
// random steps of cluster churn (endpoints replaced, services deleted and
// created back, versions pruned) and node states (current, lagging by a
// few steps, an endpoint dropped, a stale frontend added, a frontend
// missing) and checks every incremental assessment against a full one.
func TestIncrementalAssessmentEqualsFull(t *testing.T) {
	spec := synth.Spec{Services: 120, EndpointsPerService: 3}
	svcs, sl := spec.Objects()
	rng := rand.New(rand.NewPCG(7, 11))
	h := audit.NewHistory(5 * time.Second)
	now := time.Unix(1_800_000_000, 0)
	pool := stream.NewPool()
	a := New(Config{}, &View{})
	n := &node{name: "node-1"}
	deleted := map[int]bool{}
	var past []*audit.State
	next := 0
	for step := range 300 {
		// The cluster changes.
		for range rng.IntN(6) {
			i := rng.IntN(len(sl))
			sl[i] = spec.Replaced(sl[i], rng.IntN(len(sl[i].Endpoints)), next)
			next++
		}
		if rng.IntN(10) == 0 {
			deleted[rng.IntN(len(svcs))] = !deleted[rng.IntN(len(svcs))]
		}
		var live = svcs[:0:0]
		var liveSl []discoveryv1.EndpointSlice
		for i := range svcs {
			if !deleted[i] {
				live = append(live, svcs[i])
				liveSl = append(liveSl, sl[i])
			}
		}
		st := audit.FromAPI(live, liveSl, nil)
		now = now.Add(time.Second)
		h.Update(st, now)
		past = append(past, st)

		// The node shows some version, maybe tampered.
		shows := st
		how := rng.IntN(6)
		if how == 1 && len(past) > 3 {
			shows = past[len(past)-1-rng.IntN(4)]
		}
		obs := synth.Rules(shows)
		switch how {
		case 2:
			f := &obs.Frontends[rng.IntN(len(obs.Frontends))]
			if len(f.Endpoints) > 0 {
				f.Endpoints = f.Endpoints[1:]
			}
		case 3:
			obs.Frontends = append(obs.Frontends, audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: synth.VIP(spec.Services + rng.IntN(3)), Protocol: "TCP", Port: 80},
				Scope: audit.ScopeCluster, Endpoints: []audit.Endpoint{{Addr: obs.Frontends[0].Endpoints[0].Addr, Weight: -1}}})
		case 4:
			i := rng.IntN(len(obs.Frontends))
			obs.Frontends = append(obs.Frontends[:i], obs.Frontends[i+1:]...)
		}
		rules := stream.NewPooledState(pool)
		if _, err := rules.Apply(stream.Delta(stream.NewState(), stream.FromModel(obs), 1, true, false)); err != nil {
			t.Fatal(err)
		}
		a.memo, a.classes = map[[2]uint64][]assessed{}, audit.NodeClasses(st)
		got := a.assessNode(st, h, n, rules)
		want := audit.Assess(st, h, n.name, rules.Observed())
		if !reflect.DeepEqual(norm(got), norm(want)) {
			t.Fatalf("step %d (node case %d): incremental assessment\n%s\ndiffers from the full one\n%s", step, how, describeAs(got), describeAs(want))
		}
	}
	if inc := testutilValue(a, "incremental"); inc < 100 {
		t.Fatalf("only %v of 300 assessments were incremental", inc)
	}
}

func norm(as []audit.ServiceAssessment) []audit.ServiceAssessment {
	if len(as) == 0 {
		return nil
	}
	return as
}

func describeAs(as []audit.ServiceAssessment) string {
	s := ""
	for _, x := range as {
		s += fmt.Sprintf("  %s %s since %s: %d findings %d draining\n", x.Service, x.State, x.Since.Format(time.TimeOnly), len(x.Findings), len(x.Draining))
		for _, f := range x.Findings {
			s += fmt.Sprintf("    %s %s %s\n", f.Kind, f.Endpoint, f.Detail)
		}
	}
	return s
}

func testutilValue(a *Aggregator, how string) float64 {
	return testutil.ToFloat64(a.cfg.Metrics.Assessments.WithLabelValues(how))
}
