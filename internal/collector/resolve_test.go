package collector

import (
	"context"
	"errors"
	"slices"
	"testing"

	"go.uber.org/zap"
)

// A node whose kube-proxy is stale may have lost its DNS (the cluster DNS
// Service goes through that kube-proxy): the collector keeps the
// aggregator's last addresses, so the node is still heard.
func TestAddressesOutliveDNS(t *testing.T) {
	dnsUp := true
	c := &client{cfg: Config{Aggregator: "agg-headless.proxyaudit.svc:9443,198.51.100.9:9443", Log: zap.NewNop()},
		lookup: func(_ context.Context, host string) ([]string, error) {
			if !dnsUp {
				return nil, errors.New("lookup " + host + ": i/o timeout")
			}
			return []string{"198.18.130.2", "198.18.131.2"}, nil
		}}
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
	fresh := &client{cfg: c.cfg, lookup: c.lookup}
	got, err = fresh.addresses(context.Background(), "")
	if err == nil || !slices.Equal(got, []string{"198.51.100.9:9443"}) {
		t.Fatalf("never resolved: %v, %v", got, err)
	}
}
