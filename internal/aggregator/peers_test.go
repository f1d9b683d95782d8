package aggregator

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// sharedPort returns listeners at one port on every address of the
// test's network: replicas at one port, as pods behind a headless Service
// are.
func sharedPort(t *testing.T, addrs ...string) []net.Listener {
	t.Helper()
	first, err := netOf(t).Listen(net.JoinHostPort(addrs[0], "0"))
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(first.Addr().String())
	lns := []net.Listener{first}
	for _, a := range addrs[1:] {
		ln, err := netOf(t).Listen(net.JoinHostPort(a, port))
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
	}
	return lns
}

// replicas is a fake API and aggregator replicas over it, with the
// aggregators' headless Service's EndpointSlice.
type replicas struct {
	t      *testing.T
	client *fake.Clientset
	slice  *discoveryv1.EndpointSlice
	wg     sync.WaitGroup
}

func newReplicas(t *testing.T, ips ...string) *replicas {
	r := &replicas{t: t, client: fakeCluster(), slice: &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: "agg-headless-x1", Namespace: "proxyaudit", Labels: map[string]string{discoveryv1.LabelServiceName: "agg-headless"}},
		AddressType: discoveryv1.AddressTypeIPv4,
	}}
	r.endpoints(ips...)
	t.Cleanup(r.wg.Wait)
	return r
}

// endpoints sets the slice's endpoints to ips.
func (r *replicas) endpoints(ips ...string) {
	r.t.Helper()
	ready := true
	r.slice.Endpoints = nil
	for _, ip := range ips {
		r.slice.Endpoints = append(r.slice.Endpoints, discoveryv1.Endpoint{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: &ready}})
	}
	var err error
	if r.slice.ResourceVersion == "" {
		_, err = r.client.DiscoveryV1().EndpointSlices("proxyaudit").Create(context.Background(), r.slice, metav1.CreateOptions{})
		r.slice.ResourceVersion = "1"
	} else {
		_, err = r.client.DiscoveryV1().EndpointSlices("proxyaudit").Update(context.Background(), r.slice, metav1.UpdateOptions{})
	}
	if err != nil {
		r.t.Fatal(err)
	}
}

// start runs a replica on ln; stop ends it.
func (r *replicas) start(ln net.Listener, name string) (agg *Aggregator, stop context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	r.t.Cleanup(cancel)
	log := zaptest.NewLogger(r.t).Named(name)
	view := view.New(view.Config{Client: r.client, Keep: time.Minute, Log: log, Debounce: 50 * time.Millisecond})
	p := audit.DefaultPolicy()
	p.Grace, p.DefaultInterval = 2*time.Second, time.Second
	agg = New(Config{Policy: p, Auth: auth.InsecureNoAuth{}, Self: ln.Addr().String(), Peers: "proxyaudit/agg-headless", Log: log,
		MaxMessageBytes: 1 << 20}, view)
	r.wg.Add(3)
	go func() { defer r.wg.Done(); view.Run(ctx) }()
	go func() { defer r.wg.Done(); agg.Serve(ctx, ln) }()
	go func() { defer r.wg.Done(); agg.Run(ctx) }()
	return agg, cancel
}

// collector runs a real collector client for n1 at the replicas' port
// whose DNS answers the first lookup with first and then fails; logs
// records what it says.
func (r *replicas) collector(port, first string) (logs *observer.ObservedLogs, lookups *atomic.Int32) {
	lookups = &atomic.Int32{}
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := collector.Config{Node: "n1", Aggregator: "agg-headless.proxyaudit.svc:" + port, Interval: time.Second, CPUTime: noCPU, Clock: clock.RealClock{}, Dial: netOf(r.t).Dial,
		Log:    zap.New(zapcore.NewTee(core, zaptest.NewLogger(r.t).Named("n1").Core())),
		Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules(r.t), nil }},
		Lookup: func(_ context.Context, host string) ([]string, error) {
			if lookups.Add(1) == 1 {
				return []string{first}, nil
			}
			return nil, errors.New("lookup " + host + ": i/o timeout")
		}}
	ctx, cancel := context.WithCancel(context.Background())
	r.t.Cleanup(cancel)
	r.wg.Add(1)
	go func() { defer r.wg.Done(); collector.Run(ctx, cfg) }()
	return logs, lookups
}

// toldOf says whether the collector logged a list of replicas holding ip.
func toldOf(logs *observer.ObservedLogs, ip string) bool {
	for _, e := range logs.FilterMessageSnippet("named its replicas").All() {
		for _, a := range e.ContextMap()["addresses"].([]any) {
			if a == ip {
				return true
			}
		}
	}
	return false
}

// leaderAndFollower starts a leader on ln and a follower naming it on
// follow, and a collector (DNS answering once, with the leader) streaming
// to the leader.
func (r *replicas) leaderAndFollower(ln, follow net.Listener, port string) (leader *Aggregator, stopLeader context.CancelFunc,
	follower *Aggregator, stopFollower context.CancelFunc, logs *observer.ObservedLogs, lookups *atomic.Int32) {
	r.t.Helper()
	leader, stopLeader = r.start(ln, "leader")
	leader.StartedLeading()
	follower, stopFollower = r.start(follow, "follower")
	follower.NewLeader(leader.cfg.Self)
	host, _, _ := net.SplitHostPort(ln.Addr().String())
	logs, lookups = r.collector(port, host)
	testkit.Eventually(r.t, 10*time.Second, "n1 streaming to the leader", func() bool { return streaming(leader) })
	return leader, stopLeader, follower, stopFollower, logs, lookups
}

// streaming says whether n1 streams to a.
func streaming(a *Aggregator) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := a.fleet.nodes["n1"]
	return n != nil && n.conn != nil
}

// told says whether the collector logged a list of want replicas.
func told(logs *observer.ObservedLogs, want int) bool {
	for _, e := range logs.FilterMessageSnippet("named its replicas").All() {
		if len(e.ContextMap()["addresses"].([]any)) == want {
			return true
		}
	}
	return false
}

// TestCollectorsFollowARolloutWithoutDNS: every aggregator replica is
// replaced while the node cannot resolve the aggregators' name (its DNS
// goes through its own kube-proxy). The collector heard of the new
// replica from the old one (stream.Peers, from the headless Service's
// EndpointSlice) and reaches it; with only what DNS last said, it would
// dial the gone replica forever.
func TestCollectorsFollowARolloutWithoutDNS(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lns := sharedPort(t, "127.0.0.1", "127.0.0.2")
		_, port, _ := net.SplitHostPort(lns[0].Addr().String())
		r := newReplicas(t, "127.0.0.1")
		// The node resolved the name once, before its DNS broke.
		_, stopOld, next, _, logs, lookups := r.leaderAndFollower(lns[0], lns[1], port)

		// The rollout: a new replica comes up (the slice lists both), the old
		// one goes, and the new one leads.
		r.endpoints("127.0.0.1", "127.0.0.2")
		testkit.Eventually(t, 10*time.Second, "n1's collector told of both replicas", func() bool { return told(logs, 2) })
		stopOld()
		next.StartedLeading()
		next.NewLeader(next.cfg.Self)
		took := testkit.Eventually(t, 30*time.Second, "n1 streaming to the new replica without DNS", func() bool { return streaming(next) })
		t.Logf("n1 reached the new replica %s after the old one stopped (%d lookups, all but the first failed)", took.Round(time.Millisecond), lookups.Load())
	})
}

// TestCollectorsLearnReplicasFromAFollower: the leader goes before it
// could tell anyone of the new replica, and the Lease still names it; the
// old follower, which redirects the collector to that gone leader, names
// the replicas in its redirect. The follower goes next (a rolling update
// does not wait for the Lease), and the collector, which never reached a
// leader in between, still finds the new replica (seen on real nodes:
// the fleet was lost when only leaders named the replicas).
func TestCollectorsLearnReplicasFromAFollower(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lns := sharedPort(t, "127.0.0.1", "127.0.0.2", "127.0.0.3")
		_, port, _ := net.SplitHostPort(lns[0].Addr().String())
		r := newReplicas(t, "127.0.0.1", "127.0.0.2")
		_, stopLeader, _, stopFollower, logs, _ := r.leaderAndFollower(lns[0], lns[1], port)
		testkit.Eventually(t, 10*time.Second, "n1 told of the two replicas", func() bool { return told(logs, 2) })

		stopLeader()
		r.endpoints("127.0.0.2", "127.0.0.3") // the new replica, which the gone leader never saw
		testkit.Eventually(t, 20*time.Second, "n1 told of the new replica by the follower's redirect", func() bool { return toldOf(logs, "127.0.0.3") })
		stopFollower()
		next, _ := r.start(lns[2], "new")
		next.StartedLeading()
		took := testkit.Eventually(t, 30*time.Second, "n1 streaming to the new replica", func() bool { return streaming(next) })
		t.Logf("n1 reached the new replica %s after it led", took.Round(time.Millisecond))
	})
}

// TestCollectorsFollowAQuickRollout: the rolling update terminates the
// leader a moment after its successor got an address, before the
// leader's copy of the Service (or its once-a-second announcement) shows
// it, and the old follower goes next (seen on real nodes: every
// collector kept dialing the two gone replicas). On its way out the
// leader reads the replicas from the API and names them to its streams
// (Farewell); the old follower, asked next with its copy behind, does
// not make the collector forget the successor.
func TestCollectorsFollowAQuickRollout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lns := sharedPort(t, "127.0.0.1", "127.0.0.2", "127.0.0.3")
		_, port, _ := net.SplitHostPort(lns[0].Addr().String())
		r := newReplicas(t, "127.0.0.1", "127.0.0.2")
		leader, stopLeader, _, stopFollower, logs, _ := r.leaderAndFollower(lns[0], lns[1], port)
		testkit.Eventually(t, 10*time.Second, "n1 told of the two replicas", func() bool { return told(logs, 2) })

		// The API, ahead of every replica's informer: the leader terminating,
		// the successor with an address, not ready yet.
		yes, no := true, false
		ahead := r.slice.DeepCopy()
		ahead.Endpoints = []discoveryv1.Endpoint{
			{Addresses: []string{"127.0.0.1"}, Conditions: discoveryv1.EndpointConditions{Ready: &no, Terminating: &yes}},
			{Addresses: []string{"127.0.0.2"}, Conditions: discoveryv1.EndpointConditions{Ready: &yes}},
			{Addresses: []string{"127.0.0.3"}, Conditions: discoveryv1.EndpointConditions{Ready: &no}},
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		leader.Farewell(ctx, fake.NewClientset(ahead))
		testkit.Eventually(t, 5*time.Second, "n1 told of the successor on the leader's way out", func() bool { return toldOf(logs, "127.0.0.3") })
		if toldOf(logs, "127.0.0.1") && told(logs, 3) {
			t.Error("the going leader named itself")
		}
		stopLeader()
		// The old follower stays a moment (2 s of the bubble's time),
		// redirecting with its copy (.1, .2), then goes; the successor leads.
		time.Sleep(2 * time.Second)
		stopFollower()
		next, _ := r.start(lns[2], "new")
		next.StartedLeading()
		took := testkit.Eventually(t, 30*time.Second, "n1 streaming to the successor", func() bool { return streaming(next) })
		t.Logf("n1 reached the successor %s after it led", took.Round(time.Millisecond))
	})
}

// TestCollectorComesBackSoonAfterALeaderlessSpell: the API server
// restarts, the leader loses its Lease and no replica leads for a while.
// The collector, welcomed before, is refused each time with when to come
// back (2–5 s) and streams again within that of a leader being elected;
// left to its own backoff it would wait up to 16 s by then (30 s later
// on), past the new leader's allowance, and every node was
// CollectorMissing after the soak restarted the API server.
func TestCollectorComesBackSoonAfterALeaderlessSpell(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lns := sharedPort(t, "127.0.0.1")
		_, port, _ := net.SplitHostPort(lns[0].Addr().String())
		r := newReplicas(t, "127.0.0.1")
		agg, _ := r.start(lns[0], "agg")
		agg.StartedLeading()
		logs, _ := r.collector(port, "127.0.0.1")
		testkit.Eventually(t, 10*time.Second, "n1 streaming to the leader", func() bool { return streaming(agg) })

		agg.StoppedLeading()
		agg.NewLeader("")
		time.Sleep(12 * time.Second) // the bubble's time
		refusals := logs.FilterMessageSnippet("come back later").Len()
		if refusals < 2 {
			t.Errorf("%d refusals told when to come back in 12 s without a leader, want one every 2–5 s", refusals)
		}
		agg.StartedLeading()
		took := testkit.Eventually(t, 30*time.Second, "n1 streaming to the new leader", func() bool { return streaming(agg) })
		if took > 6*time.Second {
			t.Errorf("n1 streamed again %s after a leader was elected, want within the 2–5 s it was told", took)
		}
		t.Logf("12 s without a leader: %d refusals; n1 streaming %s after the leader came", refusals, took.Round(time.Millisecond))
	})
}
