package nftables

import (
	"net/netip"
	"os"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

// A node port whose service has no endpoints is in kube-proxy's
// no-endpoint-nodeports map, and the reader says so beside the
// no-endpoint-services frontends: a UDP node port scaled to zero keeps its
// flows pinned to the gone pods (kube-proxy 1.37 cleans a service's
// conntrack entries without endpoints, but not a node port's), and a
// collector that never saw the service with endpoints counts them only if
// it knows the port. Genuine kube-proxy 1.35's capture: matrix/etp-local's
// node port 31416 (externalTrafficPolicy Local, no endpoint on the node:
// drop) and matrix/no-endpoints' service IP (reject).
func TestNoEndpointNodePortsRead(t *testing.T) {
	f, err := os.Open("../../audit/testdata/k8s/v1.35/capture/clean/nft-b.rules")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	obs, err := Parse(f)
	if err != nil {
		t.Fatal(err)
	}
	np := audit.NodePortKey(4, "TCP", 31416)
	svc := audit.FrontendKey{IP: netip.MustParseAddr("198.19.239.49"), Protocol: "TCP", Port: 80}
	if !obs.RejectsKnown || !obs.Rejects[np] || !obs.Rejects[svc] {
		t.Errorf("rejects %v (known %v): want node port %v and %v", obs.Rejects, obs.RejectsKnown, np, svc)
	}
	if obs.Rejects[audit.NodePortKey(4, "TCP", 32093)] {
		t.Errorf("matrix/nodeport's node port has endpoints, yet read as rejected")
	}
}
