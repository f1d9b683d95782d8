package aggregator

import (
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Genuine kube-proxy's dual-stack rules (the captures of every mode in
// audit/testdata/dualstack) through the stream and the leader's
// assessment: the wire keeps both families, IPv6 node ports included;
// each node is assessed on the clean capture (its baseline) and then,
// incrementally, on the drift capture's cluster and rules, and every
// assessment equals the full one: healthy nodes in sync, the drifted
// nodes' IPv4 and IPv6 findings.
func TestDualStackCapturesThroughTheStream(t *testing.T) {
	root := filepath.Join("..", "..", "audit", "testdata", "dualstack")
	load := func(dir, node string) (*audit.State, *stream.State) {
		t.Helper()
		data, err := os.ReadFile(filepath.Join(root, dir, "cluster.json"))
		if err != nil {
			t.Fatal(err)
		}
		st, err := audit.ParseClusterList(data)
		if err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(filepath.Join(root, dir, node+".rules"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		obs, err := dataplane.ParseRules(f)
		if err != nil {
			t.Fatal(err)
		}
		rules := stream.NewPooledState(stream.NewPool())
		if _, err := rules.Apply(stream.Delta(stream.NewState(), stream.FromModel(obs), 1, true, false)); err != nil {
			t.Fatal(err)
		}
		back := rules.Observed()
		keys := map[audit.FrontendKey]int{}
		for i := range obs.Frontends {
			keys[obs.Frontends[i].FrontendKey]++
		}
		for i := range back.Frontends {
			keys[back.Frontends[i].FrontendKey]--
		}
		for k, n := range keys {
			if n != 0 {
				t.Fatalf("%s/%s: frontend %s (IPv%d) read and through the stream differ", dir, node, k, k.Family())
			}
		}
		if !reflect.DeepEqual(back.Families, obs.Families) {
			t.Fatalf("%s/%s: families %v through the stream, %v read", dir, node, back.Families, obs.Families)
		}
		return st, rules
	}
	for _, tc := range []struct {
		clean, drift string
		nodes        []string
		drifted      string
	}{
		{"clean", "drift", []string{"ds-ipt", "ds-legacy", "ds-nft"}, "ds-nft"},
		{"ipvs-clean", "ipvs-drift", []string{"ds-ipvs"}, "ds-ipvs"},
	} {
		for _, name := range tc.nodes {
			t.Run(tc.drift+"/"+name, func(t *testing.T) {
				h := audit.NewHistory(time.Minute)
				a := New(Config{}, &view.View{})
				n := &node{name: name}
				at := time.Unix(1_800_000_000, 0)
				for _, dir := range []string{tc.clean, tc.drift} {
					st, rules := load(dir, name)
					h.Update(st, at)
					at = at.Add(10 * time.Second)
					a.newGeneration(st, h)
					got := a.assessor.assessNode(st, h, n, rules)
					want := audit.Assess(st, h, name, rules.Observed())
					if !reflect.DeepEqual(norm(got), norm(want)) {
						t.Fatalf("%s: the leader's assessment\n%s\ndiffers from the full one\n%s", dir, describeAs(got), describeAs(want))
					}
					fams := map[int]int{}
					for _, as := range got {
						for _, f := range as.Findings {
							fams[f.Family]++
						}
					}
					drifted := dir == tc.drift && name == tc.drifted
					if drifted != (fams[6] > 0) || (!drifted && len(fams) > 0) {
						t.Errorf("%s: findings by family %v (drifted: %v)\n%s", dir, fams, drifted, describeAs(got))
					}
				}
				// IPVS nodes are assessed in full each time (incrementable).
				if testutilValue(a, "incremental") == 0 && tc.drifted != "ds-ipvs" {
					t.Error("the drift capture was not assessed incrementally from the clean one")
				}
			})
		}
	}
}
