package collector

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

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
	c.LearnPeers(&stream.Peers{IPs: []string{"198.18.140.2", "2001:2::7"}})
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
		c.LearnPeers(&stream.Peers{IPs: bad})
		if got, _ := c.addresses(context.Background(), ""); !slices.Equal(got, want) {
			t.Errorf("after %q: %v, want %v kept", bad, got, want)
		}
	}
	c.LearnPeers(nil)
	if got, _ := c.addresses(context.Background(), ""); !slices.Equal(got, want) {
		t.Errorf("after an empty message: %v", got)
	}
}

// Replicas' lists arrive in no order: a going replica names its successor,
// then an old follower whose copy of the Service is behind names only the
// old replicas. The successor stays (after the latest list), older
// addresses are kept only up to keptPeers, and DNS replaces them all.
func TestPeersNewestFirstOlderKept(t *testing.T) {
	dnsUp := false
	c := &client{cfg: Config{Aggregator: "agg-headless.proxyaudit.svc:9443", Log: zap.NewNop(),
		Lookup: func(_ context.Context, host string) ([]string, error) {
			if dnsUp {
				return []string{"198.18.150.2"}, nil
			}
			return nil, errors.New("lookup " + host + ": i/o timeout")
		}}}
	addrs := func() []string {
		t.Helper()
		got, err := c.addresses(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	c.LearnPeers(&stream.Peers{IPs: []string{"198.18.131.3", "198.18.132.3"}}) // the going leader: the follower and the successor
	c.LearnPeers(&stream.Peers{IPs: []string{"198.18.130.3", "198.18.131.3"}}) // the old follower, behind
	if got, want := addrs(), []string{"198.18.130.3:9443", "198.18.131.3:9443", "198.18.132.3:9443"}; !slices.Equal(got, want) {
		t.Fatalf("after a list that is behind: %v, want %v (the successor kept, last)", got, want)
	}
	// Rollout after rollout without DNS: what is kept from before is bounded.
	for i := range 10 {
		c.LearnPeers(&stream.Peers{IPs: []string{fmt.Sprintf("198.18.140.%d", i+1)}})
	}
	if got, want := addrs(), []string{"198.18.140.10:9443", "198.18.140.9:9443", "198.18.140.8:9443", "198.18.140.7:9443", "198.18.140.6:9443"}; !slices.Equal(got, want) {
		t.Fatalf("after ten lists: %v, want the latest and the %d before it, newest first: %v", got, keptPeers, want)
	}
	dnsUp = true
	if got := addrs(); !slices.Equal(got, []string{"198.18.150.2:9443"}) {
		t.Fatalf("with DNS back: %v", got)
	}
	dnsUp = false
	if got := addrs(); !slices.Equal(got, []string{"198.18.150.2:9443"}) {
		t.Fatalf("DNS's answer replaced the learned list, then outlived DNS: %v", got)
	}
}

// A collector started while the node's DNS is down (its pod replaced
// while the node's kube-proxy rules are flushed) dials the addresses a
// collector before it kept on the node; a kept file that is not what the
// collector writes is ignored, never trusted in part.
func TestPeersFileOutlivesRestart(t *testing.T) {
	file := filepath.Join(t.TempDir(), "aggregators.json")
	dnsUp := true
	cfg := Config{Aggregator: "agg-headless.proxyaudit.svc:9443", Log: zap.NewNop(), PeersFile: file,
		Lookup: func(_ context.Context, host string) ([]string, error) {
			if !dnsUp {
				return nil, errors.New("lookup " + host + ": i/o timeout")
			}
			return []string{"198.18.130.2"}, nil
		}}
	first := &client{cfg: cfg}
	first.loadPeers()
	if _, err := first.addresses(context.Background(), ""); err != nil {
		t.Fatal(err)
	}
	first.LearnPeers(&stream.Peers{IPs: []string{"198.18.131.2", "2001:2::7"}})
	want := []string{"198.18.131.2:9443", "[2001:2::7]:9443", "198.18.130.2:9443"}

	dnsUp = false
	restarted := &client{cfg: cfg}
	restarted.loadPeers()
	if got, err := restarted.addresses(context.Background(), ""); err != nil || !slices.Equal(got, want) {
		t.Fatalf("restarted without DNS: %v, %v; want the kept %v", got, err, want)
	}

	for name, content := range map[string]string{
		"garbage":       "\x00\x01not json",
		"oversized":     `{"agg-headless.proxyaudit.svc":["198.18.130.2"],"x":"` + strings.Repeat("a", maxPeersFile) + `"}`,
		"a host name":   `{"agg-headless.proxyaudit.svc":["evil.example"]}`,
		"with a port":   `{"agg-headless.proxyaudit.svc":["198.18.130.2:9443"]}`,
		"unspecified":   `{"agg-headless.proxyaudit.svc":["0.0.0.0"]}`,
		"too many":      fmt.Sprintf(`{"agg-headless.proxyaudit.svc":%q}`, slices.Repeat([]string{"198.18.130.2"}, stream.MaxPeers+1)),
		"another name":  `{"other.svc":["198.18.130.2"]}`,
		"not an object": `["198.18.130.2"]`,
	} {
		if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		c := &client{cfg: cfg}
		c.loadPeers()
		if got, err := c.addresses(context.Background(), ""); err == nil || len(got) != 0 {
			t.Errorf("%s: %v, %v; want nothing dialed and the DNS error", name, got, err)
		}
	}

	// A DNS that hangs (the node's, gone with its rules) costs a few
	// seconds when there are addresses to fall back on.
	hang := &client{cfg: cfg}
	hang.cfg.Lookup = func(ctx context.Context, host string) ([]string, error) { <-ctx.Done(); return nil, ctx.Err() }
	os.WriteFile(file, []byte(`{"agg-headless.proxyaudit.svc":["198.18.130.2"]}`), 0o600)
	hang.loadPeers()
	start := time.Now()
	if got, err := hang.addresses(context.Background(), ""); err != nil || !slices.Equal(got, []string{"198.18.130.2:9443"}) || time.Since(start) > 2*lookupWithFallback {
		t.Fatalf("hung DNS: %v, %v after %s", got, err, time.Since(start))
	}

	// A file that cannot be written costs a warning, not the stream.
	cfg.PeersFile = filepath.Join(t.TempDir(), "missing-dir", "aggregators.json")
	dnsUp = true
	c := &client{cfg: cfg}
	c.loadPeers()
	if got, err := c.addresses(context.Background(), ""); err != nil || !slices.Equal(got, []string{"198.18.130.2:9443"}) {
		t.Fatalf("unwritable file: %v, %v", got, err)
	}
}
