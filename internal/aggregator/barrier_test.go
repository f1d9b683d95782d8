package aggregator

import (
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// gate holds every EndpointSlices watch of a fake API still while stalled:
// one kind's watch stuck while the others (and every request) flow.
type gate struct{ stalled atomic.Bool }

func (g *gate) install(client *fake.Clientset) {
	client.PrependWatchReactor("endpointslices", func(a k8stesting.Action) (bool, watch.Interface, error) {
		w, err := client.Tracker().Watch(a.GetResource(), a.GetNamespace())
		if err != nil {
			return true, nil, err
		}
		out := make(chan watch.Event)
		gw := &gatedWatch{inner: w, out: out, done: make(chan struct{})}
		// The fake's watcher panics when its buffer fills: drain it
		// always, deliver only while not stalled.
		go func() {
			defer close(out)
			tick := time.NewTicker(10 * time.Millisecond)
			defer tick.Stop()
			in := w.ResultChan()
			var queue []watch.Event
			for in != nil || len(queue) > 0 {
				var send chan watch.Event
				var next watch.Event
				if len(queue) > 0 && !g.stalled.Load() {
					send, next = out, queue[0]
				}
				select {
				case ev, ok := <-in:
					if !ok {
						in = nil
						continue
					}
					queue = append(queue, ev)
				case send <- next:
					queue = queue[1:]
				case <-tick.C:
				case <-gw.done:
					return
				}
			}
		}()
		return true, gw, nil
	})
}

type gatedWatch struct {
	inner watch.Interface
	out   chan watch.Event
	done  chan struct{}
	once  sync.Once
}

func (w *gatedWatch) ResultChan() <-chan watch.Event { return w.out }
func (w *gatedWatch) Stop()                          { w.once.Do(func() { close(w.done); w.inner.Stop() }) }

// A healthy node that follows the API while the aggregator's EndpointSlices
// watch is stuck shows endpoints the view does not have. Without the
// barrier that is a Divergent finding (the control below proves the
// scenario bites); with it, the node's reports wait until the stamps come
// back through the watch, the stuck watch makes the view stale, and once
// the watch delivers again the node is in sync with no finding on the way.
func TestBarrierHoldsReportsAheadOfTheView(t *testing.T) {
	for _, barrier := range []bool{false, true} {
		name := map[bool]string{false: "without barrier (control)", true: "with barrier"}[barrier]
		t.Run(name, func(t *testing.T) {
			const grace = 2 * time.Second
			client := fakeCluster()
			g := &gate{}
			g.install(client)
			var b *Barrier
			if barrier {
				b = &Barrier{Namespace: "proxyaudit", Identity: "test", Every: 100 * time.Millisecond, Timeout: 4 * time.Second}
			}
			h := startWith(t, grace, InsecureNoAuth{}, client, b)
			view := h.agg.view
			var mu sync.Mutex
			current := rules(t)
			h.collector(h.ctx, "n1", func() *audit.Observed { mu.Lock(); defer mu.Unlock(); return current })
			inSync := func() bool {
				for _, n := range h.verdict().Nodes {
					if n.Node == "n1" {
						return n.State == audit.NodeInSync
					}
				}
				return false
			}
			h.until(10*time.Second, "n1 in sync", inSync)
			// n2 and n3 have no collector here: only n1's findings count.
			n1 := func() string {
				var out []string
				for _, f := range h.verdict().Findings {
					if f.Node == "n1" {
						out = append(out, string(f.Kind)+" "+f.Service+" "+f.Endpoint)
					}
				}
				return strings.Join(out, ", ")
			}

			g.stalled.Store(true)
			t.Log("injected: the aggregator's EndpointSlices watch holds still; Services, Nodes and every request flow")
			sl, err := client.DiscoveryV1().EndpointSlices(synth.Namespace).List(h.ctx, metav1.ListOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var changed bool
			for i := range sl.Items {
				s := &sl.Items[i]
				if s.Labels["kubernetes.io/service-name"] == synth.ServiceName(0) {
					s.Endpoints = s.Endpoints[:len(s.Endpoints)-1]
					if _, err := client.DiscoveryV1().EndpointSlices(synth.Namespace).Update(h.ctx, s, metav1.UpdateOptions{}); err != nil {
						t.Fatal(err)
					}
					changed = true
					break
				}
			}
			if !changed {
				t.Fatal("no slice of service 0")
			}
			mu.Lock()
			current = rules(t, 0) // the node follows the API: one endpoint fewer
			mu.Unlock()
			t.Log("the node's kube-proxy followed the change; the aggregator has not seen it")

			if !barrier {
				h.until(4*grace+5*time.Second, "the false finding the barrier exists to prevent", func() bool {
					return n1() != ""
				})
				t.Logf("without the barrier: %s", n1())
				return
			}
			h.advance(4*grace+5*time.Second, func() {
				if k := n1(); k != "" {
					t.Fatalf("a healthy node ahead of the view was reported: %s", k)
				}
			})
			since, why := h.agg.Stale()
			if since.IsZero() || !strings.Contains(why, "EndpointSlices watch has not delivered") {
				t.Fatalf("the stuck EndpointSlices watch did not make the view stale: %q", why)
			}
			t.Logf("stale: %s", why)
			if _, cwhy := view.Stale(); strings.Contains(cwhy, "Services watch") {
				t.Errorf("the Services watch flows but is called stuck: %s", cwhy)
			}

			g.stalled.Store(false)
			t.Log("healed: the EndpointSlices watch delivers again")
			h.until(15*time.Second, "fresh and n1 in sync", func() bool {
				s, _ := h.agg.Stale()
				return s.IsZero() && inSync()
			})
			if k := n1(); k != "" {
				t.Errorf("findings after healing: %s", k)
			}
		})
	}
}

// Stamps count only once a published State holds what arrived before them,
// and only this replica's: another replica's clock proves nothing here.
func TestBarrierCoversOnlyPublishedOwnStamps(t *testing.T) {
	v := NewView(ViewConfig{Client: fake.NewClientset(), Keep: time.Minute, Barrier: &Barrier{Namespace: "ns", Identity: "me"}})
	t0 := time.Unix(1000, 0)
	stamp := func(kind, by string, at time.Time) {
		v.stamped(kind, stampObject(v.barrier.key, "ns", by, at))
	}
	covered := func(now time.Time, clean bool) time.Time {
		v.dirtyMu.Lock()
		defer v.dirtyMu.Unlock()
		return v.barrierCovered(now, clean)
	}
	if c := covered(t0, true); !c.IsZero() {
		t.Fatalf("covered %v before any stamp", c)
	}
	stamp("Services", identityHash("me"), t0.Add(time.Second))
	stamp("EndpointSlices", identityHash("other"), t0.Add(2*time.Second))
	if c := covered(t0.Add(5*time.Second), true); !c.IsZero() {
		t.Fatalf("covered %v with no own EndpointSlices stamp", c)
	}
	stamp("EndpointSlices", identityHash("me"), t0.Add(3*time.Second))
	if c := covered(t0.Add(5*time.Second), true); !c.Equal(t0.Add(time.Second)) {
		t.Fatalf("clean: covered %v, want the older stamp %v", c, t0.Add(time.Second))
	}
	if c := covered(t0.Add(5*time.Second), false); !c.IsZero() {
		t.Fatalf("changes pending: covered %v, want nothing until a rebuild publishes", c)
	}
	v.dirtyMu.Lock()
	v.barrierPublished(v.barrierTaken())
	v.dirtyMu.Unlock()
	stamp("Services", identityHash("me"), t0.Add(4*time.Second))
	if c := covered(t0.Add(5*time.Second), false); !c.Equal(t0.Add(time.Second)) {
		t.Fatalf("pending: covered %v, want the published stamp %v", c, t0.Add(time.Second))
	}
}

func stampObject(key []byte, ns, by string, at time.Time) *corev1.Service {
	return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: BarrierName, Labels: stampLabels(key, by, at)}}
}

// A stamp moves "covered" only when this process wrote it: a tenant's
// Service labelled like the barrier (any namespace may create one), a copy
// of the barrier's labels with a later time, or a stamp from the future
// (the attack: one stamped for 2099 hid stuck watches for good) is
// refused, and the view still goes stale when the real stamps stop.
func TestBarrierRefusesForgedStamps(t *testing.T) {
	v := NewView(ViewConfig{Client: fake.NewClientset(), Keep: time.Minute, Barrier: &Barrier{Namespace: "ns", Identity: "me", Timeout: 10 * time.Second}})
	b := v.barrier
	now := time.Now()
	covered := func() time.Time {
		v.dirtyMu.Lock()
		defer v.dirtyMu.Unlock()
		return v.barrierCovered(now.Add(time.Hour), true)
	}
	for _, kind := range barrierKinds {
		v.stamped(kind, stampObject(b.key, "ns", b.by, now.Add(-time.Minute)))
	}
	honest := covered()
	if !honest.Equal(now.Add(-time.Minute)) {
		t.Fatalf("an own stamp is not counted: covered %v", honest)
	}
	future := now.Add(100 * 365 * 24 * time.Hour)
	copied := stampObject(b.key, "ns", b.by, now.Add(-time.Minute))
	copied.Labels[barrierAt] = strconv.FormatInt(now.UnixNano(), 10) // the signature of another time
	for name, obj := range map[string]*corev1.Service{
		"a tenant's Service, signed with another key": stampObject([]byte("guess"), "tenant", b.by, now),
		"the barrier's name in another namespace":     stampObject(b.key, "tenant", b.by, now),
		"another name in the namespace":               {ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "x", Labels: stampLabels(b.key, b.by, now)}},
		"no signature":                                {ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: BarrierName, Labels: map[string]string{barrierBy: b.by, barrierAt: strconv.FormatInt(now.UnixNano(), 10)}}},
		"a copied signature with a later time":        copied,
		"signed, from the future":                     stampObject(b.key, "ns", b.by, future),
	} {
		for _, kind := range barrierKinds {
			v.stamped(kind, obj)
		}
		if c := covered(); !c.Equal(honest) {
			t.Errorf("%s moved covered to %v", name, c)
		}
	}
	if b.forged != 6*len(barrierKinds) {
		t.Errorf("%d stamps refused, want %d", b.forged, 6*len(barrierKinds))
	}
	// Stamping has stopped arriving: the view goes stale whatever was forged.
	v.dirtyMu.Lock()
	b.activeAt = now.Add(-time.Minute)
	b.unseen["Services"] = []time.Time{now.Add(-30 * time.Second)}
	v.dirtyMu.Unlock()
	if since, why := v.barrierStale(now); since.IsZero() || len(why) == 0 {
		t.Errorf("not stale with forged stamps only: %v %q", since, why)
	}
}
