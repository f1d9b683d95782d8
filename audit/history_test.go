package audit_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

type cluster struct {
	svcs   []corev1.Service
	slices []discoveryv1.EndpointSlice
}

func (c cluster) state() *audit.State { return audit.FromAPI(c.svcs, c.slices, nil) }

func synthCluster(spec synth.Spec) cluster {
	s, sl := spec.Objects()
	return cluster{s, sl}
}

// rulesOf is what a healthy kube-proxy programs for spec.
func rulesOf(t *testing.T, spec synth.Spec, edit func(string) string) *audit.Observed {
	t.Helper()
	var b bytes.Buffer
	if err := spec.WriteIPTablesSave(&b); err != nil {
		t.Fatal(err)
	}
	text := b.String()
	if edit != nil {
		text = edit(text)
	}
	obs, err := audit.ParseRules(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	return obs
}

// dropEndpoint returns c with the last endpoint of service i removed.
func dropEndpoint(c cluster, i int) cluster {
	out := cluster{svcs: c.svcs, slices: make([]discoveryv1.EndpointSlice, len(c.slices))}
	copy(out.slices, c.slices)
	eps := out.slices[i].Endpoints
	out.slices[i].Endpoints = eps[: len(eps)-1 : len(eps)-1]
	return out
}

func only(t *testing.T, as []audit.ServiceAssessment) audit.ServiceAssessment {
	t.Helper()
	if len(as) != 1 {
		t.Fatalf("want one service assessed, got %+v", as)
	}
	return as[0]
}

func TestAssessInSync(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	c := synthCluster(spec)
	h := audit.NewHistory(5 * time.Minute)
	h.Update(c.state(), t0)
	if as := audit.Assess(c.state(), h, "n1", rulesOf(t, spec, nil)); as != nil {
		t.Fatalf("healthy node assessed %+v", as)
	}
}

// A node that still shows the version before the last two changes lags
// since the first of them: that is when it fell behind.
func TestAssessLaggingSinceTheNextVersion(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	v0 := synthCluster(spec)
	v1 := dropEndpoint(v0, 2)
	v2 := dropEndpoint(v1, 2)
	h := audit.NewHistory(5 * time.Minute)
	h.Update(v0.state(), t0)
	h.Update(v1.state(), t0.Add(10*time.Second))
	h.Update(v2.state(), t0.Add(20*time.Second))
	a := only(t, audit.Assess(v2.state(), h, "n1", rulesOf(t, spec, nil)))
	if a.Service != "synth/svc-00002" || a.State != audit.Lagging || !a.Since.Equal(t0.Add(10*time.Second)) {
		t.Fatalf("got %s %s since %v", a.Service, a.State, a.Since)
	}
	if len(a.Findings) != 2 || a.Findings[0].Kind != audit.StaleEndpoint {
		t.Fatalf("findings %+v", a.Findings)
	}
	// The node catching up to v1 still lags, now since v2 appeared.
	a = only(t, audit.Assess(v2.state(), h, "n1", rulesOf(t, spec, withoutEndpoint(spec, 2, 2))))
	if a.State != audit.Lagging || !a.Since.Equal(t0.Add(20*time.Second)) {
		t.Fatalf("after catching up to v1: %s since %v", a.State, a.Since)
	}
}

// withoutEndpoint edits a synth ruleset as kube-proxy would after endpoint
// j of service i went away: the service chain no longer jumps to it.
func withoutEndpoint(spec synth.Spec, i, j int) func(string) string {
	return func(text string) string {
		target := "--to-destination " + spec.EndpointAddr(i, j).String() + ":8080"
		sep := ""
		for _, line := range strings.Split(text, "\n") {
			if strings.HasSuffix(line, target) {
				sep = strings.Fields(line)[1]
			}
		}
		var out []string
		for _, line := range strings.Split(text, "\n") {
			if !(strings.HasPrefix(line, "-A KUBE-SVC-") && strings.HasSuffix(line, "-j "+sep)) {
				out = append(out, line)
			}
		}
		return strings.Join(out, "\n")
	}
}

func TestAssessDivergentWhenNoVersionMatches(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	c := synthCluster(spec)
	h := audit.NewHistory(5 * time.Minute)
	h.Update(c.state(), t0)
	tampered := rulesOf(t, spec, func(s string) string {
		return strings.Replace(s, "--to-destination "+spec.EndpointAddr(1, 0).String()+":8080", "--to-destination 198.18.99.99:8080", 1)
	})
	a := only(t, audit.Assess(c.state(), h, "n1", tampered))
	if a.Service != "synth/svc-00001" || a.State != audit.Divergent || len(a.Findings) != 2 {
		t.Fatalf("got %+v", a)
	}
}

func TestAssessDeletedAndCreatedServicesLag(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	v0 := synthCluster(spec)
	h := audit.NewHistory(5 * time.Minute)
	h.Update(v0.state(), t0)
	// svc-00004 deleted, svc-00005 created, at t1.
	bigger := synthCluster(synth.Spec{Services: 6, EndpointsPerService: 3})
	v1 := cluster{svcs: append(append([]corev1.Service{}, bigger.svcs[:4]...), bigger.svcs[5]),
		slices: append(append([]discoveryv1.EndpointSlice{}, bigger.slices[:4]...), bigger.slices[5])}
	t1 := t0.Add(7 * time.Second)
	h.Update(v1.state(), t1)
	as := audit.Assess(v1.state(), h, "n1", rulesOf(t, spec, nil))
	if len(as) != 2 {
		t.Fatalf("got %+v", as)
	}
	for i, want := range []struct {
		svc  string
		kind audit.Kind
	}{{"synth/svc-00004", audit.StaleService}, {"synth/svc-00005", audit.MissingService}} {
		a := as[i]
		if a.Service != want.svc || a.State != audit.Lagging || !a.Since.Equal(t1) || len(a.Findings) != 1 || a.Findings[0].Kind != want.kind {
			t.Errorf("%s: got %+v", want.svc, a)
		}
	}
}

func TestAssessUnownedRulesAndPrunedVersions(t *testing.T) {
	spec := synth.Spec{Services: 5, EndpointsPerService: 3}
	c := synthCluster(spec)
	h := audit.NewHistory(time.Minute)
	h.Update(c.state(), t0)
	// Rules for a service the cluster never had.
	a := only(t, audit.Assess(c.state(), h, "n1", rulesOf(t, synth.Spec{Services: 6, EndpointsPerService: 3}, nil)))
	if a.Service != "" || a.State != audit.Divergent || len(a.Findings) != 1 || a.Findings[0].Kind != audit.StaleService {
		t.Fatalf("unowned: %+v", a)
	}
	// A version superseded longer ago than Keep no longer matches.
	v1 := dropEndpoint(c, 3)
	h.Update(v1.state(), t0.Add(time.Second))
	h.Update(v1.state(), t0.Add(3*time.Minute))
	if n := len(h.Versions("synth/svc-00003")); n != 1 {
		t.Fatalf("kept %d versions", n)
	}
	a = only(t, audit.Assess(v1.state(), h, "n1", rulesOf(t, spec, nil)))
	if a.State != audit.Divergent {
		t.Fatalf("pruned version matched: %+v", a)
	}
}
