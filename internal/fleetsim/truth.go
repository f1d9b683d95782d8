// Package fleetsim simulates a fleet of nodes for the real aggregator: a
// healthy kube-proxy's rules on every node, derived from the real API
// server the way kube-proxy derives them, reported by simulated collectors
// that speak the real stream protocol. One process holds thousands of
// nodes because nodes that show the same version of the cluster share its
// state and the encoded reports between versions.
package fleetsim

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
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
// one version serves them all.
type Truth struct {
	client kubernetes.Interface
	keep   time.Duration

	mu       sync.Mutex
	versions []*Version
	dirty    time.Time
	kick     chan struct{}
	changed  chan struct{} // closed and replaced on every new version
}

// NewTruth returns a Truth keeping versions for keep (longer than any
// simulated kube-proxy lags).
func NewTruth(client kubernetes.Interface, keep time.Duration) *Truth {
	return &Truth{client: client, keep: keep, kick: make(chan struct{}, 1), changed: make(chan struct{})}
}

// Run lists and watches Services and EndpointSlices and builds a version
// at most once per minSync (kube-proxy's --iptables-min-sync-period is 1 s)
// until ctx ends. It returns once the first version exists or ctx ended.
func (t *Truth) Run(ctx context.Context, minSync time.Duration) {
	f := informers.NewSharedInformerFactory(t.client, 0)
	svcs := f.Core().V1().Services()
	slices := f.Discovery().V1().EndpointSlices()
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { t.mark() },
		UpdateFunc: func(any, any) { t.mark() },
		DeleteFunc: func(any) { t.mark() },
	}
	svcs.Informer().AddEventHandler(h)
	slices.Informer().AddEventHandler(h)
	f.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), svcs.Informer().HasSynced, slices.Informer().HasSynced) {
		return
	}
	build := func() {
		t.mu.Lock()
		at := t.dirty
		t.dirty = time.Time{}
		t.mu.Unlock()
		if at.IsZero() {
			at = time.Now()
		}
		sl, _ := svcs.Lister().List(labels.Everything())
		el, _ := slices.Lister().List(labels.Everything())
		sv := make([]corev1.Service, len(sl))
		for i, s := range sl {
			sv[i] = *s
		}
		ev := make([]discoveryv1.EndpointSlice, len(el))
		for i, s := range el {
			ev[i] = *s
		}
		st := stream.FromModel(Rules(audit.FromAPI(sv, ev, nil)))
		t.add(st, at)
	}
	build()
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
			build()
		}
	}()
}

func (t *Truth) mark() {
	t.mu.Lock()
	if t.dirty.IsZero() {
		t.dirty = time.Now()
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
	// Keep every version younger than keep, and the newest older one (what
	// a node lagging by keep shows).
	i := 0
	for i+1 < len(t.versions) && time.Since(t.versions[i+1].At) > t.keep {
		i++
	}
	t.versions = slices.Clone(t.versions[i:])
	close(t.changed)
	t.changed = make(chan struct{})
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

// Rules is what a healthy kube-proxy in iptables mode programs for st on a
// node of a cluster without node-local policies: every expected frontend
// with the endpoints of its scope, as the collector reads them.
func Rules(st *audit.State) *audit.Observed {
	exp := audit.ExpectedFor(st, "")
	o := &audit.Observed{Mode: audit.ModeIPTables, Families: []int{4}}
	for i := range exp.Ports {
		p := &exp.Ports[i]
		for _, fe := range p.Frontends {
			of := audit.ObservedFrontend{FrontendKey: fe.FrontendKey, Scope: fe.Scope}
			for _, a := range p.Want(fe.Scope, audit.ModeIPTables) {
				of.Endpoints = append(of.Endpoints, audit.Endpoint{Addr: a, Weight: -1})
			}
			o.Frontends = append(o.Frontends, of)
		}
	}
	return o
}

// churnAddr is the address of the k-th endpoint the churn creates, past
// the synthetic cluster's own endpoints.
func churnAddr(base netip.Addr, k int) netip.Addr {
	b := base.As4()
	n := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	n += uint32(k)
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
}
