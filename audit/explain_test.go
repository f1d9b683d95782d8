package audit_test

import (
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// Explain marks each endpoint of each frontend against the cluster.
func TestExplain(t *testing.T) {
	spec := synth.Spec{Services: 3, EndpointsPerService: 3}
	c := synthCluster(spec)
	obs := rulesOf(t, spec, nil) // the rules of all three endpoints …
	st := dropEndpoint(c, 1).state()
	// … while the cluster dropped one of svc-00001's and has a new service.
	bigger := synthCluster(synth.Spec{Services: 4, EndpointsPerService: 3})
	st.Services = append(st.Services, audit.FromAPI(bigger.svcs[3:], bigger.slices[3:], nil).Services...)
	tr := audit.Explain(audit.ExpectedFor(st, "n1"), obs, "synth/svc-00001")
	if len(tr) != 1 || len(tr[0].Frontends) != 1 {
		t.Fatalf("trace %+v", tr)
	}
	var got []string
	for _, e := range tr[0].Frontends[0].Endpoints {
		got = append(got, e.Status)
		if e.Status != audit.TraceMissing && e.Chain == "" {
			t.Errorf("endpoint %s without its rule chain", e.Endpoint)
		}
	}
	if strings.Join(got, ",") != "ok,ok,stale" || tr[0].Frontends[0].Chain == "" {
		t.Fatalf("svc-00001: %v (%+v)", got, tr[0].Frontends[0])
	}
	all := audit.Explain(audit.ExpectedFor(st, "n1"), obs, "")
	last := all[len(all)-1]
	if last.Service != "synth/svc-00003" || last.Frontends[0].Status != audit.TraceMissing || len(last.Frontends[0].Endpoints) != 3 {
		t.Fatalf("new service: %+v", last)
	}
}
