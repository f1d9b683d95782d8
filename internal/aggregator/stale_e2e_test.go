package aggregator

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// stallable lets requests through but can hold every watch stream still:
// the aggregator's own version of kube-proxy's dead watch (or of an API
// server whose watch cache stopped following etcd), while the Lease
// renewals, which are plain requests, keep succeeding.
type stallable struct {
	rt      http.RoundTripper
	stalled atomic.Bool
	only    string // when set, only watches of this resource (URL path part)
}

func (s *stallable) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := s.rt.RoundTrip(r)
	if err == nil && r.URL.Query().Get("watch") == "true" && (s.only == "" || strings.Contains(r.URL.Path, "/"+s.only)) {
		resp.Body = &stallBody{ReadCloser: resp.Body, s: s}
	}
	return resp, err
}

type stallBody struct {
	io.ReadCloser
	s *stallable
}

func (b *stallBody) Read(p []byte) (int, error) {
	for b.s.stalled.Load() {
		time.Sleep(20 * time.Millisecond)
	}
	return b.ReadCloser.Read(p)
}

type notices struct {
	mu   sync.Mutex
	list []remediate.Notice
}

func (n *notices) Notify(x remediate.Notice) {
	n.mu.Lock()
	n.list = append(n.list, x)
	n.mu.Unlock()
}

func (n *notices) kinds() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []string
	for _, x := range n.list {
		out = append(out, string(x.Kind))
	}
	return out
}

// A leader whose watches stop delivering while its requests succeed keeps
// its Lease, so leader election does not save it. Its view goes stale:
// it must notice (its own Lease renewals, or its own barrier stamps, no
// longer arrive through the watch), stop judging and repairing, say so
// once, and resume on its own when the watches deliver again. Two ways:
// every watch stuck (the canary sees it), and only the EndpointSlices
// watch stuck while the Lease watch flows (only the barrier sees it).
func TestE2EStuckWatchStopsJudgement(t *testing.T) {
	c := localcluster.Shared(t)
	const leaseNS = "proxyaudit-stale"
	if err := c.EnsureNamespace(context.Background(), leaseNS); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, only, lease, want string
	}{
		{"every watch", "", "stale-test", "Lease " + leaseNS + "/stale-test"},
		{"only EndpointSlices", "endpointslices", "stale-test-slices", "the EndpointSlices watch has not delivered"},
	} {
		t.Run(tc.name, func(t *testing.T) { stuckWatch(t, c, leaseNS, tc.lease, tc.only, tc.want) })
	}
}

func stuckWatch(t *testing.T, c *localcluster.Cluster, leaseNS, lease, only, want string) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := &stallable{only: only}
	cfg := rest.CopyConfig(c.RESTConfig)
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { st.rt = rt; return st }
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	log := zaptest.NewLogger(t)
	var agg *Aggregator
	vw := view.New(view.Config{Client: client, Keep: time.Minute, Debounce: 50 * time.Millisecond, Log: log,
		Canary: &view.Canary{Namespace: leaseNS, Lease: lease, Timeout: 6 * time.Second},
		Barrier: &view.Barrier{Namespace: leaseNS, Identity: lease, Every: time.Second, Timeout: 6 * time.Second,
			Active: func() bool { _, ok := agg.Leader(); return ok }}})
	heard := &notices{}
	p := audit.DefaultPolicy()
	agg = New(Config{Policy: p, Self: "127.0.0.1:1", Log: log, Notifier: heard}, vw)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(3)
	go func() { defer wg.Done(); vw.Run(ctx) }()
	go func() {
		defer wg.Done()
		RunElection(ctx, client, Election{Namespace: leaseNS, Name: lease, Identity: lease,
			LeaseDuration: 6 * time.Second, RenewDeadline: 4 * time.Second, RetryPeriod: time.Second}, agg)
	}()
	go func() { defer wg.Done(); agg.Run(ctx) }()

	until := func(d time.Duration, what string, cond func() bool) time.Duration {
		t.Helper()
		took, err := testkit.Poll(d, cond)
		if err != nil {
			since, why := vw.Stale()
			t.Fatalf("%s", testkit.Waiting(d, what, fmt.Sprintf("stale since %v: %s; notices %v", since, why, heard.kinds())))
		}
		return took
	}
	leading := func() bool { _, ok := agg.Leader(); return ok && agg.Verdict() != nil && !agg.Verdict().At.IsZero() }
	until(30*time.Second, "leading with a fresh view", leading)
	if since, why := vw.Stale(); !since.IsZero() {
		t.Fatalf("stale from the start: %s", why)
	}
	// The barrier's stamps come back: reports are judged within seconds.
	until(10*time.Second, "the barrier to cover the last seconds", func() bool { return time.Since(vw.Covered()) < 3*time.Second })
	for _, get := range []func() (metav1.Object, error){
		func() (metav1.Object, error) {
			return c.Client.CoreV1().Services(leaseNS).Get(ctx, view.BarrierName, metav1.GetOptions{})
		},
		func() (metav1.Object, error) {
			return c.Client.DiscoveryV1().EndpointSlices(leaseNS).Get(ctx, view.BarrierName, metav1.GetOptions{})
		},
	} {
		o, err := get()
		if err != nil {
			t.Fatalf("the barrier object: %v", err)
		}
		t.Logf("barrier %s stamped %s", o.GetName(), o.GetLabels()["proxyaudit.io/barrier-at"])
	}

	st.stalled.Store(true)
	what := "every watch stream"
	if only != "" {
		what = "the " + only + " watch stream"
	}
	t.Logf("injected: %s of the aggregator held still; requests (Lease renewals, barrier stamps) still succeed", what)
	took := until(20*time.Second, "the view to go stale", func() bool { s, _ := agg.Stale(); return !s.IsZero() })
	_, why := agg.Stale()
	t.Logf("stale after %s: %s", took.Round(100*time.Millisecond), why)
	if !strings.Contains(why, want) {
		t.Errorf("reason does not say %q: %s", want, why)
	}
	if only != "" && strings.Contains(why, "Lease") {
		t.Errorf("the Lease watch flows but is blamed: %s", why)
	}
	if _, ok := agg.Leader(); !ok {
		t.Error("the leader lost its Lease: this test needs renewals to keep working")
	}
	frozen := agg.Verdict().At
	time.Sleep(3 * time.Second)
	if at := agg.Verdict().At; !at.Equal(frozen) {
		t.Errorf("judged from a stale view: verdict moved from %v to %v", frozen, at)
	}

	st.stalled.Store(false)
	t.Log("healed: watch streams deliver again")
	took = until(30*time.Second, "the view to be fresh again", func() bool { s, _ := agg.Stale(); return s.IsZero() })
	t.Logf("fresh again %s after healing", took.Round(100*time.Millisecond))
	until(10*time.Second, "judging to resume", func() bool { return agg.Verdict().At.After(frozen) })
	if got := strings.Join(heard.kinds(), ","); got != "ViewStale,ViewFresh" {
		t.Errorf("notices %s, want one ViewStale then one ViewFresh", got)
	}
}
