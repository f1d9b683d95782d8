package aggregator

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
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
			synctest.Test(t, func(t *testing.T) {
				const grace = 2 * time.Second
				client := fakeCluster()
				g := &gate{}
				g.install(client)
				var b *view.Barrier
				if barrier {
					b = &view.Barrier{Namespace: "proxyaudit", Identity: "test", Every: 100 * time.Millisecond, Timeout: 4 * time.Second}
				}
				h := startWith(t, grace, auth.InsecureNoAuth{}, client, b)
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
		})
	}
}
