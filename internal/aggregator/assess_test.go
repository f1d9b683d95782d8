package aggregator

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/prometheus/client_golang/prometheus/testutil"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
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
	a := New(Config{}, &view.View{})
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
		obs, how := randomShow(rng, st, past, synth.Rules, synth.VIP(spec.Services+rng.IntN(3)))
		rules := stream.NewPooledState(pool)
		if _, err := rules.Apply(stream.Delta(stream.NewState(), stream.FromModel(obs), 1, true, false)); err != nil {
			t.Fatal(err)
		}
		a.newGeneration(st, h)
		got := a.assessor.assessNode(st, h, n, rules)
		want := audit.Assess(st, h, n.name, rules.Observed())
		if !reflect.DeepEqual(norm(got), norm(want)) {
			t.Fatalf("step %d (node case %d): incremental assessment\n%s\ndiffers from the full one\n%s", step, how, describeAs(got), describeAs(want))
		}
	}
	if inc := testutilValue(a, "incremental"); inc < 100 {
		t.Fatalf("only %v of 300 assessments were incremental", inc)
	}
}

// randomShow is what a node shows in the randomized tests, and which case
// it is: 0 or 5 the current version; 1 an older one; 2 an endpoint
// dropped; 3 a frontend no service has (stale) added; 4 a frontend missing.
func randomShow(rng *rand.Rand, st *audit.State, past []*audit.State, rulesOf func(*audit.State) *audit.Observed, staleVIP netip.Addr) (*audit.Observed, int) {
	shows := st
	how := rng.IntN(6)
	if how == 1 && len(past) > 3 {
		shows = past[len(past)-1-rng.IntN(4)]
	}
	obs := rulesOf(shows)
	switch how {
	case 2:
		f := &obs.Frontends[rng.IntN(len(obs.Frontends))]
		if len(f.Endpoints) > 0 {
			f.Endpoints = f.Endpoints[1:]
		}
	case 3:
		obs.Frontends = append(obs.Frontends, audit.ObservedFrontend{FrontendKey: audit.FrontendKey{IP: staleVIP, Protocol: "TCP", Port: 80},
			Scope: audit.ScopeCluster, Endpoints: []audit.Endpoint{{Addr: netip.MustParseAddrPort("198.18.127.250:8080"), Weight: -1}}})
	case 4:
		i := rng.IntN(len(obs.Frontends))
		obs.Frontends = append(obs.Frontends[:i], obs.Frontends[i+1:]...)
	}
	return obs, how
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

// newGeneration starts a generation whatever the last one was.
func (a *Aggregator) newGeneration(st *audit.State, h *audit.History) {
	a.assessor.shared = nil
	a.assessor.startGeneration(st, h, 0)
}

// TestSharedAssessmentsEqualFull drives eight nodes in two zones through 200
// random steps of a cluster with Local traffic policies (endpoints on the
// nodes, moving between them), zone and node hints, node zones changing,
// and each node showing the current version, an older one or tampered
// rules. All eight are assessed at every step the way Evaluate does, so
// they start from each other's baselines (a new node, or one whose
// expectations differ from its peer's) and share per-service results;
// every assessment must equal a full one for that node.
func TestSharedAssessmentsEqualFull(t *testing.T) {
	spec := synth.Spec{Services: 60, EndpointsPerService: 3}
	svcs, sl := spec.Objects()
	// node-6 and node-7 host no endpoints and no hint names them.
	all := []string{"node-0", "node-1", "node-2", "node-3", "node-4", "node-5", "node-6", "node-7"}
	nodes := all[:6]
	zones := map[string]string{"node-6": "z1", "node-7": "z1"}
	for i, n := range nodes {
		zones[n] = []string{"z1", "z2"}[i%2]
	}
	for i := range svcs {
		switch {
		case i < 10:
			svcs[i].Spec.InternalTrafficPolicy = ptr.To(corev1.ServiceInternalTrafficPolicyLocal)
		case i < 20:
			svcs[i].Spec.Type = corev1.ServiceTypeNodePort
			svcs[i].Spec.Ports[0].NodePort = int32(30000 + i)
			svcs[i].Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
		}
	}
	rng := rand.New(rand.NewPCG(3, 5))
	// place puts endpoint j of slice i on a node, with hints for services
	// 20-29 (zone) and 30-34 (node).
	place := func(i, j int) {
		e := &sl[i].Endpoints[j]
		n := nodes[rng.IntN(len(nodes))]
		e.NodeName = &n
		e.Hints = nil
		switch {
		case i >= 20 && i < 30:
			e.Hints = &discoveryv1.EndpointHints{ForZones: []discoveryv1.ForZone{{Name: zones[nodes[rng.IntN(len(nodes))]]}}}
		case i >= 30 && i < 35:
			e.Hints = &discoveryv1.EndpointHints{ForNodes: []discoveryv1.ForNode{{Name: nodes[rng.IntN(len(nodes))]}}}
		}
	}
	for i := range sl {
		for j := range sl[i].Endpoints {
			place(i, j)
		}
	}
	h := audit.NewHistory(5 * time.Second)
	now := time.Unix(1_800_000_000, 0)
	pool := stream.NewPool()
	a := New(Config{}, &view.View{})
	ns := make([]*node, len(all))
	for i, name := range all {
		ns[i] = &node{name: name}
	}
	var past []*audit.State
	next := 0
	for step := range 200 {
		for range rng.IntN(6) {
			i := rng.IntN(len(sl))
			j := rng.IntN(len(sl[i].Endpoints))
			sl[i] = spec.Replaced(sl[i], j, next)
			next++
			place(i, j)
		}
		if rng.IntN(8) == 0 {
			n := all[rng.IntN(len(all))]
			zones[n] = map[string]string{"z1": "z2", "z2": "z1"}[zones[n]]
		}
		st := audit.FromAPI(svcs, sl, nil)
		st.Nodes = map[string]audit.NodeInfo{}
		for n, z := range zones {
			st.Nodes[n] = audit.NodeInfo{Zone: z}
		}
		now = now.Add(time.Second)
		h.Update(st, now)
		past = append(past, st)
		a.newGeneration(st, h)
		if rng.IntN(10) == 0 {
			a.assessor.donors = nil // as a new leader starts: peers only
			for _, n := range ns {
				n.base = nil
			}
			a.assessor.donors = map[string]*baseline{}
		}
		for _, n := range ns {
			obs, how := randomShow(rng, st, past, func(st *audit.State) *audit.Observed { return synth.RulesFor(st, n.name) },
				synth.VIP(spec.Services+rng.IntN(3)))
			rules := stream.NewPooledState(pool)
			if _, err := rules.Apply(stream.Delta(stream.NewState(), stream.FromModel(obs), 1, true, false)); err != nil {
				t.Fatal(err)
			}
			got := a.assessor.assessNode(st, h, n, rules)
			want := audit.Assess(st, h, n.name, rules.Observed())
			if !reflect.DeepEqual(anyNode(got), anyNode(want)) {
				t.Fatalf("step %d, %s (case %d): assessment\n%s\ndiffers from the full one\n%s", step, n.name, how, describeAs(got), describeAs(want))
			}
		}
	}
	for _, how := range []string{"peer", "incremental", "shared"} {
		if testutilValue(a, how) == 0 {
			t.Errorf("no %s node assessment in the run", how)
		}
	}
	if testutil.ToFloat64(a.cfg.Metrics.ServiceAssessments.WithLabelValues("shared")) == 0 {
		t.Error("no service assessment was shared")
	}
}

// anyNode blanks the node findings name: shared assessments name the node
// they were made for, and the judge names the node it reports on.
func anyNode(as []audit.ServiceAssessment) []audit.ServiceAssessment {
	out := make([]audit.ServiceAssessment, 0, len(as))
	for _, x := range as {
		x.Findings = slices.Clone(x.Findings)
		for i := range x.Findings {
			x.Findings[i].Node = ""
		}
		out = append(out, x)
	}
	return out
}

// A node whose kube-proxy is stuck keeps a deleted service's rules,
// unchanged, until the History forgets the service: from then on the
// frontend is no service's, and its own incremental assessment, and a
// new node's from that node's baseline, must say so as a full one does.
func TestUnchangedRulesBecomeUnowned(t *testing.T) {
	spec := synth.Spec{Services: 20, EndpointsPerService: 3}
	svcs, sl := spec.Objects()
	t0 := time.Unix(1_800_000_000, 0)
	h := audit.NewHistory(5 * time.Second)
	st0 := audit.FromAPI(svcs, sl, nil)
	st1 := audit.FromAPI(slices.Delete(slices.Clone(svcs), 3, 4), slices.Delete(slices.Clone(sl), 3, 4), nil)
	rules := stream.NewPooledState(stream.NewPool())
	if _, err := rules.Apply(stream.Delta(stream.NewState(), stream.FromModel(synth.Rules(st0)), 1, true, false)); err != nil {
		t.Fatal(err)
	}
	a := New(Config{}, &view.View{})
	stuck := &node{name: "stuck"}
	for i, step := range []struct {
		st *audit.State
		at time.Duration
	}{{st0, 0}, {st1, time.Second}, {st1, 20 * time.Second}} {
		h.Update(step.st, t0.Add(step.at))
		a.newGeneration(step.st, h)
		got := a.assessor.assessNode(step.st, h, stuck, rules)
		want := audit.Assess(step.st, h, stuck.name, rules.Observed())
		if !reflect.DeepEqual(norm(got), norm(want)) {
			t.Fatalf("step %d: assessment\n%s\ndiffers from the full one\n%s", i, describeAs(got), describeAs(want))
		}
	}
	last := a.assessor.assessNode(st1, h, &node{name: "new"}, rules) // from the stuck node's baseline
	if len(last) == 0 || last[0].Service != "" || last[0].State != audit.Divergent {
		t.Fatalf("the deleted service's frontend, forgotten by the History, is not reported as no service's: %s", describeAs(last))
	}
	if testutilValue(a, "incremental") < 2 {
		t.Errorf("the stuck node was assessed incrementally %v times, want 2", testutilValue(a, "incremental"))
	}
}
