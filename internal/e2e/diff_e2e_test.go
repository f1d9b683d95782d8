package e2e

import (
	"context"
	"os"
	"os/exec"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/scenario"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// TestE2ELiveDiff builds the service matrix on the real cluster, hangs the
// informers of ipt-b and nft-b, drifts the cluster and audits every node's
// live rules: exact findings on the hung nodes, none elsewhere.
func TestE2ELiveDiff(t *testing.T) {
	if *capture {
		t.Skip("capture run")
	}
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if err := scenario.Apply(ctx, c, scenario.Matrix()); err != nil {
		t.Fatal(err)
	}
	if err := scenario.WaitSynced(ctx, c, 1, c.Nodes()); err != nil {
		t.Fatal(err)
	}
	auditAll := func() map[string][]audit.Finding {
		// The cluster as the docs capture it, with the genuine kubectl.
		args := strings.Fields(strings.TrimSuffix(audit.CaptureCommand, " > cluster.json"))
		cmd := exec.CommandContext(ctx, c.Kubectl(), args[1:]...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+c.AdminKubeconfig)
		data, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s: %v", audit.CaptureCommand, err)
		}
		st, err := audit.ParseClusterList(data)
		if err != nil {
			t.Fatal(err)
		}
		out := map[string][]audit.Finding{}
		for _, n := range c.Nodes() {
			rules, err := scenario.NodeRules(ctx, n)
			if err != nil {
				t.Fatal(err)
			}
			obs, err := dataplane.ParseRules(strings.NewReader(rules))
			if err != nil {
				t.Fatalf("%s: %v", n.Name, err)
			}
			if n.Mode == localcluster.ModeNFTables {
				// The collector's netlink reader sees what nft -j shows.
				var viaNetlink *audit.Observed
				if err := localcluster.InNetNS(n.NetNS, func() error {
					var err error
					viaNetlink, err = collector.NewHost().Reader(collector.Source{Mode: audit.ModeNFTables}).Read(ctx)
					return err
				}); err != nil {
					t.Fatalf("%s: netlink read: %v", n.Name, err)
				}
				if a, b := stream.FromModel(viaNetlink).Root(), stream.FromModel(obs).Root(); a != b || !reflect.DeepEqual(viaNetlink, obs) {
					t.Errorf("%s: the netlink reader and nft -j read different rules (roots %x, %x)", n.Name, a, b)
				}
			}
			out[n.Name] = audit.Diff(audit.ExpectedFor(st, n.Name), obs)
		}
		return out
	}
	for node, fs := range auditAll() {
		if len(fs) > 0 {
			t.Fatalf("healthy %s has findings: %+v", node, fs)
		}
	}
	for _, name := range []string{"ipt-b", "nft-b"} {
		undo, err := c.Node(name).HangInformer(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer undo(context.Background())
	}
	if err := Drift(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := scenario.WaitSynced(ctx, c, 2, []*localcluster.Node{c.Node("ipt-a"), c.Node("nft-a")}); err != nil {
		t.Fatal(err)
	}
	want := driftFindings("StaleService matrix/affinity:http ")
	for node, fs := range auditAll() {
		var got []string
		for _, f := range fs {
			got = append(got, string(f.Kind)+" "+f.Service+":"+f.Port+" "+f.Endpoint)
		}
		hung := node == "ipt-b" || node == "nft-b"
		if !hung && len(got) > 0 {
			t.Errorf("false findings on healthy %s: %q", node, got)
		}
		if hung && strings.Join(got, "\n") != want {
			t.Errorf("%s findings:\n%s\nwant:\n%s", node, strings.Join(got, "\n"), want)
		}
	}
}
