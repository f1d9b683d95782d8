package realnodes

import (
	"bytes"
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/demo"
)

// `make demo`'s story on this package's cluster: every claim it prints is
// borne out by the report it shows next. The report shown while the node
// drifts names the drifted node's stale kube-dns endpoints (both ports)
// beside StuckProxy, and the words printed under it say what it shows.
func TestE2EDemoScenario(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const drift = "real-ipt-b"
	var out bytes.Buffer
	res, err := demo.Run(ctx, demo.Config{Cluster: c, Drift: drift, CLI: filepath.Join(shared.bin, "proxyaudit"),
		Capture: t.TempDir(), Out: &out})
	defer func() {
		if err := demo.Uninstall(context.Background(), c); err != nil {
			t.Error(err)
		}
	}()
	t.Logf("what the demo printed:\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
	printed := out.String()

	// The report table as printed: kube-dns on the drifted node, both
	// ports, the gone pod's address, beside StuckProxy.
	table := res.DriftedTable
	if !strings.Contains(printed, table) {
		t.Errorf("the drifted report is not what the demo printed")
	}
	for _, want := range []string{string(audit.StuckProxy), "kube-system/kube-dns", res.GoneDNS + ":53", "shop/web", "198.18.250.21"} {
		if !strings.Contains(table, want) {
			t.Errorf("the report shown while %s drifted does not name %s:\n%s", drift, want, table)
		}
	}
	var dnsPorts []string
	for _, f := range res.Drifted.Findings {
		if f.Node != drift && f.Kind != audit.StaleConntrack {
			t.Errorf("a finding on a node that did not drift: %+v", f)
		} else if f.Node != drift {
			// A flow's entry outliving grace (see demo.Grace): the
			// narrative names it, and it is no drift of the rules.
			t.Logf("on %s: %s %s", f.Node, f.Kind, f.Detail)
		}
		if f.Node == drift && f.Kind == audit.StaleEndpoint && f.Service == "kube-system/kube-dns" && f.Endpoint == res.GoneDNS+":53" {
			dnsPorts = append(dnsPorts, f.Port)
		}
	}
	if len(dnsPorts) < 2 {
		t.Errorf("stale kube-dns endpoints on %s for ports %v, want dns and dns-tcp", drift, dnsPorts)
	}
	// The narrative under the report names what it shows, and only that.
	_, story, ok := strings.Cut(printed, "What the report says about "+drift+":")
	if !ok {
		t.Fatalf("no narrative of the report:\n%s", printed)
	}
	story, _, _ = strings.Cut(story, "\n▶")
	if others := !strings.Contains(story, "about the other nodes: nothing"); others != slices.ContainsFunc(res.Drifted.Findings, func(f audit.TimedFinding) bool { return f.Node != drift }) {
		t.Errorf("the narrative about the other nodes does not match the report:\n%s", story)
	}
	for _, want := range []string{"StuckProxy", "StaleEndpoint kube-system/kube-dns (", res.GoneDNS + ":53", "StaleEndpoint shop/web ("} {
		if !strings.Contains(story, want) {
			t.Errorf("the narrative does not say %q:\n%s", want, story)
		}
	}
	// Before the report, the demo claimed the node still sends DNS to the
	// gone pod and printed the rules that do.
	if !strings.Contains(printed, "still send DNS to the CoreDNS pod that is gone ("+res.GoneDNS+")") ||
		!strings.Contains(printed, "--to-destination "+res.GoneDNS+":53") {
		t.Errorf("the demo did not show %s's rules to the gone CoreDNS pod:\n%s", drift, printed)
	}
	if res.Healed <= 0 || !strings.Contains(printed, "repairs resumed") {
		t.Errorf("no repair after resume:\n%s", printed)
	}
	t.Logf("the report named StuckProxy and kube-dns %v on %s; in sync %s after the last change, the repair included",
		dnsPorts, drift, res.Healed.Round(time.Second))
}
