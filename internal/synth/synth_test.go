package synth

import (
	"bytes"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
)

func parse(t testing.TB, b []byte) *audit.Observed {
	t.Helper()
	obs, err := dataplane.ParseRules(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return obs
}

// A synthetic node is a healthy node: the audit finds nothing, and sees
// every service with every endpoint.
func TestSynthIsHealthy(t *testing.T) {
	for _, spec := range []Spec{
		{Services: 40, EndpointsPerService: 3, Comments: true},
		{Services: 150, EndpointsPerService: 10},
		{Services: 2, EndpointsPerService: 1500},
	} {
		svcs, slices := spec.Objects()
		exp := audit.ExpectedFor(audit.FromAPI(svcs, slices, nil), "node-1")
		for name, write := range map[string]func(*bytes.Buffer) error{
			"iptables": func(b *bytes.Buffer) error { return spec.WriteIPTablesSave(b) },
			"nftables": func(b *bytes.Buffer) error { return spec.WriteNFTJSON(b) },
		} {
			var b bytes.Buffer
			if err := write(&b); err != nil {
				t.Fatal(err)
			}
			obs := parse(t, b.Bytes())
			if fs := audit.Diff(exp, obs); len(fs) != 0 {
				t.Errorf("%s %+v: %d findings, first %+v", name, spec, len(fs), fs[0])
			}
			if len(obs.Frontends) != spec.Services {
				t.Errorf("%s %+v: %d frontends", name, spec, len(obs.Frontends))
			}
			for _, f := range obs.Frontends {
				if len(f.Endpoints) != spec.EndpointsPerService {
					t.Fatalf("%s %+v: %s has %d endpoints", name, spec, f.FrontendKey, len(f.Endpoints))
				}
			}
		}
	}
}

func TestSynthRejectsImpossibleSpecs(t *testing.T) {
	for _, spec := range []Spec{{}, {Services: MaxServices + 1, EndpointsPerService: 1}, {Services: 10000, EndpointsPerService: 13}} {
		if err := spec.WriteIPTablesSave(&bytes.Buffer{}); err == nil {
			t.Errorf("%+v: no error", spec)
		}
	}
}

// The IPVS table is what `ipvsadm -Sn` prints of kube-proxy's: every
// service's cluster IP with its endpoints, masqueraded at weight 1.
func TestSynthIPVS(t *testing.T) {
	spec := Spec{Services: 30, EndpointsPerService: 4}
	var b bytes.Buffer
	if err := spec.WriteIPVSRestore(&b, nil, false); err != nil {
		t.Fatal(err)
	}
	obs, err := ipvs.Parse(&b)
	if err != nil {
		t.Fatal(err)
	}
	if len(obs.Frontends) != spec.Services {
		t.Fatalf("%d virtual servers, want %d", len(obs.Frontends), spec.Services)
	}
	for _, f := range obs.Frontends {
		if len(f.Endpoints) != spec.EndpointsPerService {
			t.Errorf("%s: %d real servers, want %d", f.IP, len(f.Endpoints), spec.EndpointsPerService)
		}
	}
	var edits bytes.Buffer
	if err := spec.WriteIPVSRestore(&edits, []int{3}, true); err != nil {
		t.Fatal(err)
	}
	if n := bytes.Count(edits.Bytes(), []byte("-e -t ")); n != spec.EndpointsPerService {
		t.Errorf("%d real servers edited, want %d", n, spec.EndpointsPerService)
	}
}
