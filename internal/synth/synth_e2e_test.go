package synth_test

import (
	"bytes"
	"context"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// (An external test package: localcluster loads synth's rules.)

func parseRules(t testing.TB, b []byte) *audit.Observed {
	t.Helper()
	obs, err := dataplane.ParseRules(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return obs
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
	spec := synth.Spec{Services: 30, EndpointsPerService: 4}
	var ipt, nft bytes.Buffer
	if err := spec.WriteIPTablesSave(&ipt); err != nil {
		t.Fatal(err)
	}
	if err := spec.WriteNFTJSON(&nft); err != nil {
		t.Fatal(err)
	}
	nftLoad, err := synth.NFTLoadOrder(nft.Bytes())
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
		got, want := parseRules(t, []byte(out)), parseRules(t, c.gen)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: the kernel's copy audits differently from the generated text", c.name)
		}
		if c.name == "iptables-nft" && strings.Count(out, "\n-A ") != strings.Count(string(c.gen), "\n-A ") {
			t.Errorf("%s: %d rules read back, %d generated", c.name, strings.Count(out, "\n-A "), strings.Count(string(c.gen), "\n-A "))
		}
	}
}
