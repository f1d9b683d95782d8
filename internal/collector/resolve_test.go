package collector

import (
	"context"
	"errors"
	"slices"
	"testing"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// A node whose kube-proxy is stale may have lost its DNS (the cluster DNS
// Service goes through that kube-proxy): the collector keeps the
// aggregator's last addresses, so the node is still heard.
func TestAddressesOutliveDNS(t *testing.T) {
	dnsUp := true
	c := &client{cfg: Config{Aggregator: "agg-headless.proxyaudit.svc:9443,198.51.100.9:9443", Log: zap.NewNop(),
		Lookup: func(_ context.Context, host string) ([]string, error) {
			if !dnsUp {
				return nil, errors.New("lookup " + host + ": i/o timeout")
			}
			return []string{"198.18.130.2", "198.18.131.2"}, nil
		}}}
	want := []string{"198.18.131.2:9443", "198.18.130.2:9443", "198.18.131.2:9443", "198.51.100.9:9443"}
	got, err := c.addresses(context.Background(), "198.18.131.2:9443")
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("with DNS: %v, %v; want %v", got, err, want)
	}
	dnsUp = false
	if got, err := c.addresses(context.Background(), "198.18.131.2:9443"); err != nil || !slices.Equal(got, want) {
		t.Fatalf("without DNS: %v, %v; want the last answer %v", got, err, want)
	}
	// A name never resolved is an error, and the literal address still comes.
	fresh := &client{cfg: c.cfg}
	got, err = fresh.addresses(context.Background(), "")
	if err == nil || !slices.Equal(got, []string{"198.51.100.9:9443"}) {
		t.Fatalf("never resolved: %v, %v", got, err)
	}
}

// The aggregator names its replicas; without DNS the collector dials
// them. What is not a list of IP addresses is ignored, and what was
// learned stays.
func TestPeersOutliveDNS(t *testing.T) {
	c := &client{cfg: Config{Aggregator: "agg-headless.proxyaudit.svc:9443,198.51.100.9:9443", Log: zap.NewNop(),
		Lookup: func(_ context.Context, host string) ([]string, error) {
			return nil, errors.New("lookup " + host + ": i/o timeout")
		}}}
	c.learnPeers(&stream.Peers{IPs: []string{"198.18.140.2", "2001:2::7"}})
	want := []string{"198.18.140.2:9443", "[2001:2::7]:9443", "198.51.100.9:9443"}
	if got, err := c.addresses(context.Background(), ""); err != nil || !slices.Equal(got, want) {
		t.Fatalf("without DNS: %v, %v; want the replicas named %v", got, err, want)
	}
	for _, bad := range [][]string{
		nil,
		{"evil.example"},
		{"198.18.140.2:9443"},
		{"fe80::1%eth0"},
		{"0.0.0.0"},
		{"224.0.0.1"},
		{"198.18.140.2", "\x1b[2J"},
		make([]string, stream.MaxPeers+1),
	} {
		c.learnPeers(&stream.Peers{IPs: bad})
		if got, _ := c.addresses(context.Background(), ""); !slices.Equal(got, want) {
			t.Errorf("after %q: %v, want %v kept", bad, got, want)
		}
	}
	c.learnPeers(nil)
	if got, _ := c.addresses(context.Background(), ""); !slices.Equal(got, want) {
		t.Errorf("after an empty message: %v", got)
	}
}
