package collector

import (
	"context"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

var nodes = []localcluster.NodeSpec{
	{Name: "col-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "col-legacy", Mode: localcluster.ModeIPTables, Zone: "zone-a", LegacyIPTables: true},
	{Name: "col-nft", Mode: localcluster.ModeNFTables, Zone: "zone-b"},
}

func TestMain(m *testing.M) { localcluster.Main(m, nodes...) }

func onNode(t *testing.T, n *localcluster.Node, f func() error) {
	t.Helper()
	if err := localcluster.InNetNS(n.NetNS, f); err != nil {
		t.Fatalf("%s: %v", n.Name, err)
	}
}

// On each node the collector finds the mode kube-proxy really runs in, and
// its streamed read gives the same model as parsing the tool's output.
func TestE2EDetectAndReadEveryMode(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	want := map[string]Source{
		"col-ipt":    {Mode: audit.ModeIPTables},
		"col-legacy": {Mode: audit.ModeIPTables, Legacy: true},
		"col-nft":    {Mode: audit.ModeNFTables},
	}
	for _, n := range c.Nodes() {
		var src Source
		var got *audit.Observed
		onNode(t, n, func() error {
			var err error
			if src, err = Detect(ctx); err != nil {
				return err
			}
			got, err = src.Read(ctx)
			return err
		})
		if src != want[n.Name] {
			t.Errorf("%s: detected %s, want %s", n.Name, src, want[n.Name])
			continue
		}
		text, err := n.Rules(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := audit.ParseRules(strings.NewReader(text))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, ref) {
			t.Errorf("%s: the collector's read differs from parsing %s output", n.Name, src)
		}
		if got.NoRules || len(got.Frontends) == 0 {
			t.Errorf("%s: no frontends read", n.Name)
		}
	}
}

// A flushed table reads as NoRules, not as an error, in every mode; the
// node is repaired by restarting kube-proxy.
func TestE2EFlushedTableReadsAsNoRules(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, n := range c.Nodes() {
		var src Source
		onNode(t, n, func() error {
			var err error
			src, err = Detect(ctx)
			return err
		})
		if err := n.FlushRules(ctx); err != nil {
			t.Fatal(err)
		}
		var got *audit.Observed
		onNode(t, n, func() error {
			var err error
			got, err = src.Read(ctx)
			return err
		})
		if !got.NoRules {
			t.Errorf("%s: flushed table read with %d frontends", n.Name, len(got.Frontends))
		}
		if err := n.RestartProxy(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDetectWithoutKubeProxy(t *testing.T) {
	if testing.Short() {
		t.Skip("needs root: make test runs it")
	}
	if err := localcluster.CanRun(); err != nil {
		if os.Getenv(localcluster.RequireEnv) == "1" {
			t.Fatal(err)
		}
		t.Skipf("END-TO-END TEST SKIPPED: %v", err)
	}
	ctx := context.Background()
	ns, err := localcluster.NewScratch(ctx, "collector")
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	err = localcluster.InNetNS(ns.NetNS, func() error { _, err := Detect(ctx); return err })
	if err == nil || !strings.Contains(err.Error(), "no kube-proxy rules found") {
		t.Fatalf("empty namespace: %v", err)
	}
}

func TestParseMode(t *testing.T) {
	for _, m := range []string{"auto", "iptables", "iptables-legacy", "nftables", "ipvs"} {
		if _, _, err := ParseMode(m); err != nil {
			t.Errorf("%s: %v", m, err)
		}
	}
	for _, m := range []string{"userspace", "kernelspace"} {
		if _, _, err := ParseMode(m); err == nil {
			t.Errorf("%s accepted", m)
		}
	}
}
