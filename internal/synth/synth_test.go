package synth

import (
	"bytes"
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

func parse(t testing.TB, b []byte) *audit.Observed {
	t.Helper()
	obs, err := audit.ParseRules(bytes.NewReader(b))
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

// The generated text is what the real tools print: loaded into a kernel and
// read back with iptables-save and nft, it audits the same.
func TestE2ESynthRoundTripsThroughTheKernel(t *testing.T) {
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ns, err := localcluster.NewScratch(ctx, "synth")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	spec := Spec{Services: 30, EndpointsPerService: 4}
	var ipt, nft bytes.Buffer
	if err := spec.WriteIPTablesSave(&ipt); err != nil {
		t.Fatal(err)
	}
	if err := spec.WriteNFTJSON(&nft); err != nil {
		t.Fatal(err)
	}
	nftLoad, err := NFTLoadOrder(nft.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name        string
		gen, input  []byte
		load, check []string
	}{
		{"iptables-nft", ipt.Bytes(), ipt.Bytes(), []string{"iptables-restore"}, []string{"iptables-save", "-t", "nat"}},
		{"iptables-legacy", ipt.Bytes(), ipt.Bytes(), []string{"iptables-legacy-restore"}, []string{"iptables-legacy-save", "-t", "nat"}},
		{"nft", nft.Bytes(), nftLoad, []string{"nft", "-j", "-f", "-"}, []string{"nft", "-j", "list", "table", "ip", "kube-proxy"}},
	} {
		cmd := ns.Command(ctx, c.load...)
		cmd.Stdin = bytes.NewReader(c.input)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: load: %v: %s", c.name, err, out)
		}
		out, err := ns.Exec(ctx, c.check...)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		got, want := parse(t, []byte(out)), parse(t, c.gen)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: the kernel's copy audits differently from the generated text", c.name)
		}
		if c.name == "iptables-nft" && strings.Count(out, "\n-A ") != strings.Count(string(c.gen), "\n-A ") {
			t.Errorf("%s: %d rules read back, %d generated", c.name, strings.Count(out, "\n-A "), strings.Count(string(c.gen), "\n-A "))
		}
	}
}
