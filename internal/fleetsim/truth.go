// Package fleetsim simulates a fleet of nodes for the real aggregator: a
// healthy kube-proxy's rules on every node, derived from the real API
// server the way kube-proxy derives them, reported by simulated collectors
// that speak the real stream protocol. One process holds thousands of
// nodes because nodes that show the same version of the cluster share its
// state and the encoded reports between versions.
package fleetsim

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// Version is the rules a healthy kube-proxy in iptables mode programs for
// one state of the cluster. At is when the first change it includes was
// seen (the aggregator dates versions the same way).
type Version struct {
	Seq   uint64
	At    time.Time
	State *stream.State
}

// Truth follows the API through its own informers, like a kube-proxy, and
// keeps the recent versions of what a node's rules should be. Every
// simulated node runs the same services without node-local policies, so
// one version serves them all. Like the aggregator's view it recomputes
// only the services that changed, and versions share what did not change.
type Truth struct {
	client kubernetes.Interface
	keep   time.Duration

	mu       sync.Mutex
	versions []*Version
	dirty    time.Time
	changed  map[string]bool // services (namespace/name) changed since the last version
	kick     chan struct{}
	maxLag   time.Duration // longest from a change to the version holding it

	keys map[string][]string // frontend keys of each service in the newest version (build only)
}

// NewTruth returns a Truth keeping versions for keep (longer than any
// simulated kube-proxy lags).
func NewTruth(client kubernetes.Interface, keep time.Duration) *Truth {
	return &Truth{client: client, keep: keep, kick: make(chan struct{}, 1), changed: map[string]bool{}, keys: map[string][]string{}}
}

// MaxLag is the longest the simulated kube-proxies took from a change to a
// version holding it: a machine too busy to simulate healthy kube-proxies
// shows here (their findings are then true).
func (t *Truth) MaxLag() time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.maxLag
}

const byService = "service"

// Run lists and watches Services and EndpointSlices and builds a version
// at most once per minSync (kube-proxy's --iptables-min-sync-period is 1 s)
// until ctx ends. It returns once the first version exists or ctx ended.
func (t *Truth) Run(ctx context.Context, minSync time.Duration) {
	f := informers.NewSharedInformerFactory(t.client, 0)
	svcs := f.Core().V1().Services()
	sliceInf := f.Discovery().V1().EndpointSlices().Informer()
	sliceInf.AddIndexers(cache.Indexers{byService: func(obj any) ([]string, error) {
		if k := view.ServiceOf(obj); k != "" {
			return []string{k}, nil
		}
		return nil, nil
	}})
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    t.mark,
		UpdateFunc: func(o, n any) { t.mark(o); t.mark(n) },
		DeleteFunc: t.mark,
	}
	svcs.Informer().AddEventHandler(h)
	sliceInf.AddEventHandler(h)
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), svcs.Informer().HasSynced, sliceInf.HasSynced) {
		return
	}
	build := func(all bool) {
		t.mu.Lock()
		at, changed := t.dirty, t.changed
		t.dirty, t.changed = time.Time{}, map[string]bool{}
		t.mu.Unlock()
		if at.IsZero() {
			at = time.Now()
		}
		if all {
			list, _ := svcs.Lister().List(labels.Everything())
			for _, s := range list {
				changed[s.Namespace+"/"+s.Name] = true
			}
		}
		prev := stream.NewState()
		if v := t.Latest(); v != nil {
			prev = v.State
		}
		var removed []string
		var put []stream.Frontend
		for key := range changed {
			removed = append(removed, t.keys[key]...)
			delete(t.keys, key)
			ns, name, _ := strings.Cut(key, "/")
			svc, err := svcs.Lister().Services(ns).Get(name)
			if err != nil {
				continue
			}
			objs, _ := sliceInf.GetIndexer().ByIndex(byService, key)
			ev := make([]discoveryv1.EndpointSlice, 0, len(objs))
			for _, o := range objs {
				ev = append(ev, *o.(*discoveryv1.EndpointSlice))
			}
			for _, of := range synth.Rules(audit.FromAPI([]corev1.Service{*svc}, ev, nil)).Frontends {
				fe := stream.FromObserved(of)
				put = append(put, fe)
				t.keys[key] = append(t.keys[key], fe.Key)
			}
		}
		next := prev.With(removed, put)
		next.Mode, next.Families = string(audit.ModeIPTables), []int{4}
		t.add(next, at)
	}
	build(true)
	go func() {
		defer f.Shutdown()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.kick:
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(minSync):
			}
			build(false)
		}
	}()
}

func (t *Truth) mark(obj any) {
	t.mu.Lock()
	if t.dirty.IsZero() {
		t.dirty = time.Now()
	}
	if k := view.ServiceOf(obj); k != "" {
		t.changed[k] = true
	}
	t.mu.Unlock()
	select {
	case t.kick <- struct{}{}:
	default:
	}
}

func (t *Truth) add(st *stream.State, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	var seq uint64 = 1
	if n := len(t.versions); n > 0 {
		seq = t.versions[n-1].Seq + 1
	}
	t.versions = append(t.versions, &Version{Seq: seq, At: at, State: st})
	t.maxLag = max(t.maxLag, time.Since(at))
	// Keep every version younger than keep, and the newest older one (what
	// a node lagging by keep shows).
	i := 0
	for i+1 < len(t.versions) && time.Since(t.versions[i+1].At) > t.keep {
		i++
	}
	t.versions = slices.Clone(t.versions[i:])
}

// At returns the version a node lagging by lag shows now: the newest one
// seen at least lag ago (the oldest kept when none is).
func (t *Truth) At(now time.Time, lag time.Duration) *Version {
	t.mu.Lock()
	defer t.mu.Unlock()
	v := t.versions[0]
	for _, w := range t.versions {
		if now.Sub(w.At) < lag {
			break
		}
		v = w
	}
	return v
}

// Latest returns the newest version (nil before the first).
func (t *Truth) Latest() *Version {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.versions) == 0 {
		return nil
	}
	return t.versions[len(t.versions)-1]
}

// After returns the first version after seq (nil while there is none).
func (t *Truth) After(seq uint64) *Version {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, v := range t.versions {
		if v.Seq > seq {
			return v
		}
	}
	return nil
}
