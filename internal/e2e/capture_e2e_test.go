package e2e

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/scenario"
)

var (
	capture    = flag.Bool("capture", false, "rewrite audit/testdata/capture from a live cluster")
	captureDir = flag.String("capture-dir", "audit/testdata/capture", "where -capture writes, below the repository (make fixtures K8S_VERSION=vX.Y.Z: audit/testdata/k8s/vX.Y/capture)")
)

func TestMain(m *testing.M) { localcluster.Main(m, scenario.Nodes...) }

// TestE2ECaptureFixtures captures the fixtures under audit/testdata/capture
// from genuine kube-proxies: clean (the whole matrix), drift (two nodes with
// hung informers after endpoint and service changes) and large (more than
// 1,000 endpoints, kube-proxy drops rule comments). Run with -capture.
func TestE2ECaptureFixtures(t *testing.T) {
	if !*capture {
		t.Skip("fixture capture runs only with -capture (make fixtures)")
	}
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(root, filepath.FromSlash(*captureDir))
	os.RemoveAll(out)

	if err := scenario.Apply(ctx, c, scenario.Matrix()); err != nil {
		t.Fatal(err)
	}
	if err := scenario.WaitSynced(ctx, c, 1, c.Nodes()); err != nil {
		t.Fatal(err)
	}
	if err := scenario.Capture(ctx, c, filepath.Join(out, "clean")); err != nil {
		t.Fatal(err)
	}

	// Drift: ipt-b and nft-b lose the API, then the cluster changes.
	var undo []localcluster.Undo
	for _, name := range []string{"ipt-b", "nft-b"} {
		u, err := c.Node(name).HangInformer(ctx)
		if err != nil {
			t.Fatal(err)
		}
		undo = append(undo, u)
	}
	if err := Drift(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := scenario.WaitSynced(ctx, c, 2, []*localcluster.Node{c.Node("ipt-a"), c.Node("nft-a")}); err != nil {
		t.Fatal(err)
	}
	if err := scenario.Capture(ctx, c, filepath.Join(out, "drift")); err != nil {
		t.Fatal(err)
	}
	for _, u := range undo {
		if err := u(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := scenario.WaitSynced(ctx, c, 3, c.Nodes()); err != nil {
		t.Fatal(err)
	}

	if err := scenario.Apply(ctx, c, []scenario.Entry{scenario.Bulk(1001)}); err != nil {
		t.Fatal(err)
	}
	if err := scenario.WaitSynced(ctx, c, 4, c.Nodes()); err != nil {
		t.Fatal(err)
	}
	if err := scenario.Capture(ctx, c, filepath.Join(out, "large")); err != nil {
		t.Fatal(err)
	}
}

// driftFindings are a hung node's findings after Drift, as kind
// service:port endpoint lines; staleAffinity is how the deleted affinity
// service shows (IPVS names nothing, so its virtual server has no service).
func driftFindings(staleAffinity string) string {
	return strings.Join([]string{
		staleAffinity,
		"MissingService matrix/created:http ",
		"MissingEndpoint matrix/multi:dns 198.18.128.4:5353",
		"StaleEndpoint matrix/multi:dns 198.18.128.3:5353",
		"MissingEndpoint matrix/multi:http 198.18.128.4:8080",
		"StaleEndpoint matrix/multi:http 198.18.128.3:8080",
		"MissingEndpoint matrix/multi:metrics 198.18.128.4:9090",
		"StaleEndpoint matrix/multi:metrics 198.18.128.3:9090",
		"StaleEndpoint matrix/nodeport:http 198.18.128.11:8080",
		"MissingEndpoint matrix/two-slices:http 198.18.128.77:8080",
		"MissingService matrix/zz-sentinel-2:http ",
	}, "\n")
}

// Drift changes the cluster in every way a stale node can miss: an endpoint
// replaced, one removed, one added, a service deleted and one created.
func Drift(ctx context.Context, c *localcluster.Cluster) error {
	for _, e := range scenario.Matrix() {
		switch e.Service.Name {
		case "multi": // .3 replaced by .4
			s := e.Slices[0]
			s.Endpoints[2] = scenario.Endpoint("198.18.128.4", "ready", "", "")
			if err := c.ApplySlice(ctx, s); err != nil {
				return err
			}
		case "nodeport": // scaled down: .11 gone
			s := e.Slices[0]
			s.Endpoints = s.Endpoints[:1]
			if err := c.ApplySlice(ctx, s); err != nil {
				return err
			}
		case "two-slices": // scaled up: .77 added
			s := e.Slices[1]
			s.Endpoints = append(s.Endpoints, scenario.Endpoint("198.18.128.77", "ready", "", ""))
			if err := c.ApplySlice(ctx, s); err != nil {
				return err
			}
		case "affinity": // deleted
			if err := c.Client.CoreV1().Services(scenario.Namespace).Delete(ctx, "affinity", metav1.DeleteOptions{}); err != nil {
				return err
			}
			if err := c.Client.DiscoveryV1().EndpointSlices(scenario.Namespace).Delete(ctx, "affinity-1", metav1.DeleteOptions{}); err != nil {
				return err
			}
		}
	}
	return scenario.Apply(ctx, c, []scenario.Entry{scenario.One("created", "198.18.128.95")})
}
