package aggregator

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
)

// sharedPort returns a port free on both loopback addresses: two replicas
// at one port, as pods behind a headless Service are.
func sharedPort(t *testing.T, a, b string) (net.Listener, net.Listener) {
	t.Helper()
	for range 20 {
		la, err := net.Listen("tcp", net.JoinHostPort(a, "0"))
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(la.Addr().String())
		lb, err := net.Listen("tcp", net.JoinHostPort(b, port))
		if err == nil {
			return la, lb
		}
		la.Close()
	}
	t.Fatal("no port free on both addresses")
	return nil, nil
}

// TestCollectorsFollowARolloutWithoutDNS: every aggregator replica is
// replaced while the node cannot resolve the aggregators' name (its DNS
// goes through its own kube-proxy). The collector heard of the new
// replica from the old one (stream.Peers, from the headless Service's
// EndpointSlice) and reaches it; with only what DNS last said, it would
// dial the gone replica forever.
func TestCollectorsFollowARolloutWithoutDNS(t *testing.T) {
	lnOld, lnNew := sharedPort(t, "127.0.0.1", "127.0.0.2")
	_, port, _ := net.SplitHostPort(lnOld.Addr().String())
	client := fakeCluster()
	ready := true
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "agg-headless-x1", Namespace: "proxyaudit", Labels: map[string]string{discoveryv1.LabelServiceName: "agg-headless"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{"127.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}}},
	}
	ctx := context.Background()
	if _, err := client.DiscoveryV1().EndpointSlices("proxyaudit").Create(ctx, slice, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	replica := func(ln net.Listener, name string) (*Aggregator, context.CancelFunc) {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		log := zaptest.NewLogger(t).Named(name)
		view := NewView(ViewConfig{Client: client, Keep: time.Minute, Log: log, Debounce: 50 * time.Millisecond})
		p := audit.DefaultPolicy()
		p.Grace, p.DefaultInterval = 2*time.Second, time.Second
		agg := New(Config{Policy: p, Auth: InsecureNoAuth{}, Self: ln.Addr().String(), Peers: "proxyaudit/agg-headless", Log: log,
			MaxMessageBytes: 1 << 20}, view)
		wg.Add(3)
		go func() { defer wg.Done(); view.Run(ctx) }()
		go func() { defer wg.Done(); agg.Serve(ctx, ln) }()
		go func() { defer wg.Done(); agg.Run(ctx) }()
		return agg, cancel
	}
	old, stopOld := replica(lnOld, "old")
	old.StartedLeading()
	next, _ := replica(lnNew, "new")
	next.NewLeader(old.cfg.Self)

	// The node resolved the name once, before its DNS broke.
	var lookups atomic.Int32
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := collector.Config{Node: "n1", Aggregator: "agg-headless.proxyaudit.svc:" + port, Interval: time.Second, Clock: clock.RealClock{},
		Log:    zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Named("n1").Core())),
		Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules(t), nil }},
		Lookup: func(_ context.Context, host string) ([]string, error) {
			if lookups.Add(1) == 1 {
				return []string{"127.0.0.1"}, nil
			}
			return nil, errors.New("lookup " + host + ": i/o timeout")
		}}
	cctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	wg.Add(1)
	go func() { defer wg.Done(); collector.Run(cctx, cfg) }()
	streaming := func(a *Aggregator) bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		n := a.nodes["n1"]
		return n != nil && n.conn != nil
	}
	eventually(t, 10*time.Second, "n1 streaming to the old replica", func() bool { return streaming(old) })

	// The rollout: a new replica comes up (the slice lists both), the old
	// one goes, and the new one leads.
	slice.Endpoints = append(slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{"127.0.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	if _, err := client.DiscoveryV1().EndpointSlices("proxyaudit").Update(ctx, slice, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "n1's collector told of both replicas", func() bool {
		for _, e := range logs.FilterMessageSnippet("named its replicas").All() {
			if len(e.ContextMap()["addresses"].([]any)) == 2 {
				return true
			}
		}
		return false
	})
	stopOld()
	next.StartedLeading()
	next.NewLeader(next.cfg.Self)
	took := eventually(t, 30*time.Second, "n1 streaming to the new replica without DNS", func() bool { return streaming(next) })
	t.Logf("n1 reached the new replica %s after the old one stopped (%d lookups, all but the first failed)", took.Round(time.Millisecond), lookups.Load())
}

// eventually waits in real time for cond and returns how long it took.
func eventually(t *testing.T, limit time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > limit {
			t.Fatalf("after %s, still waiting for %s", limit, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return time.Since(start)
}
