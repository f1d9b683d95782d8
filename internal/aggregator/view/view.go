// Package view is the cluster as the aggregator sees it: one informer per
// kind reduced to the audit's State and a History of recent versions,
// whether its watches still deliver (failures, the Lease canary) and how
// far it trails the API (the barrier). It knows nothing of streams,
// judging or leadership: the aggregator reads it.
package view

import (
	"context"
	"fmt"
	"net/netip"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	listersdiscoveryv1 "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
)

// View is the cluster as the aggregator sees it: one informer per kind
// (Services, EndpointSlices, Nodes), reduced to the audit's State and a
// History of recent versions. It is kept warm on followers too, so a new
// leader judges from a full history at once.
type View struct {
	log    *zap.Logger
	clock  clock.Clock
	client kubernetes.Interface

	factory informers.SharedInformerFactory
	leases  informers.SharedInformerFactory // the canary's, nil without one
	svcs    listerscorev1.ServiceLister
	slices  listersdiscoveryv1.EndpointSliceLister
	nodes   listerscorev1.NodeLister
	synced  []cache.InformerSynced

	dirtyMu    sync.Mutex
	dirtySince time.Time     // first change not yet in State; zero when clean
	rebuilding bool          // a rebuild has taken the changes and not yet published
	barrier    *barrierState // nil without a barrier
	listedAt   time.Time     // when the published State's caches were read
	kick       chan struct{}
	// What changed since the last rebuild: services by namespace/name
	// (their own events and their slices'), and whether any Node did.
	dirtySvcs  map[string]bool
	dirtyNodes bool
	// interim are the versions each changed service went through since
	// the last rebuild, reduced as their events arrived (after the first
	// rebuild) and dated by that arrival: a rebuild folds them into one,
	// but a kube-proxy syncing in between may have programmed any of them.
	interim map[string][]interimVersion
	built   bool // the first rebuild is done: record interim versions

	// The rebuild's own memory (Run's goroutine only): every service
	// reduced once and kept until it changes, so a rebuild under churn
	// costs the changed services, not the cluster.
	sliceIdx cache.Indexer
	nodeIdx  cache.Indexer // Nodes by address
	reduced  map[string]audit.Service
	nodeInfo map[string]audit.NodeInfo

	mu    sync.RWMutex
	state *audit.State
	// expected are the nodes that should have a reporting collector.
	expected []string
	history  *audit.History
	gen      uint64 // bumps on every rebuild
	rebuilt  time.Time
	// onRebuild observes each rebuild's duration (ObserveRebuilds; set
	// while the view may already run).
	onRebuild atomic.Pointer[func(time.Duration)]

	debounce time.Duration

	// fresh says whether the watches deliver: a view the API stopped
	// updating must not be judged from.
	fresh *freshness
}

// Config is what a View needs.
type Config struct {
	Client kubernetes.Interface
	// Keep is how long superseded versions stay matchable: more than the
	// grace period, or a lagging node would look divergent.
	Keep time.Duration
	// Debounce is the least time between two rebuilds (default 1 s, like
	// kube-proxy's minimum sync period).
	Debounce time.Duration
	Log      *zap.Logger
	Clock    clock.Clock
	// Canary, when set, also watches that Lease (see Canary).
	Canary *Canary
	// Barrier, when set, stamps and watches the barrier objects (see
	// Barrier).
	Barrier *Barrier
}

// New prepares the informers; Run starts them.
func New(cfg Config) *View {
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = time.Second
	}
	client, canary := cfg.Client, cfg.Canary
	f := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTransform(Trim))
	v := &View{
		log: cfg.Log, clock: cfg.Clock, client: client, factory: f, debounce: cfg.Debounce,
		svcs:      f.Core().V1().Services().Lister(),
		slices:    f.Discovery().V1().EndpointSlices().Lister(),
		nodes:     f.Core().V1().Nodes().Lister(),
		kick:      make(chan struct{}, 1),
		history:   audit.NewHistory(cfg.Keep),
		dirtySvcs: map[string]bool{},
		interim:   map[string][]interimVersion{},
		reduced:   map[string]audit.Service{},
		state:     &audit.State{Nodes: map[string]audit.NodeInfo{}},
		fresh:     &freshness{clock: cfg.Clock, failing: map[string]watchFailure{}, canary: canary},
	}
	if cfg.Barrier != nil {
		v.barrier = newBarrierState(*cfg.Barrier)
	}
	sliceInf := f.Discovery().V1().EndpointSlices().Informer()
	if err := sliceInf.AddIndexers(cache.Indexers{byService: func(obj any) ([]string, error) {
		if key := ServiceOf(obj); key != "" {
			return []string{key}, nil
		}
		return nil, nil
	}}); err != nil {
		panic(err) // only fails on a started informer
	}
	v.sliceIdx = sliceInf.GetIndexer()
	nodeInf := f.Core().V1().Nodes().Informer()
	if err := nodeInf.AddIndexers(cache.Indexers{byAddress: func(obj any) ([]string, error) {
		n, ok := obj.(*corev1.Node)
		if !ok {
			return nil, nil
		}
		var out []string
		for _, a := range n.Status.Addresses {
			if ip, err := netip.ParseAddr(a.Address); err == nil {
				out = append(out, ip.Unmap().String())
			}
		}
		return out, nil
	}}); err != nil {
		panic(err)
	}
	v.nodeIdx = nodeInf.GetIndexer()
	for _, k := range []struct {
		kind string
		inf  cache.SharedIndexInformer
	}{
		{"Services", f.Core().V1().Services().Informer()},
		{"EndpointSlices", sliceInf},
		{"Nodes", nodeInf},
	} {
		v.watch(k.kind, k.inf, v.changed)
	}
	if canary != nil {
		lf := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(canary.Namespace),
			informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + canary.Lease }))
		v.watch("Lease", lf.Coordination().V1().Leases().Informer(), func(any) { v.fresh.canarySeen() })
		v.leases = lf
	}
	return v
}

// watch registers the informer's handlers: every event calls on and
// clears a recorded watch failure of that kind; every list or watch error
// is recorded.
func (v *View) watch(kind string, inf cache.SharedIndexInformer, on func(any)) {
	seen := func(obj any) {
		v.fresh.delivered(kind)
		if isBarrier(obj) {
			v.stamped(kind, obj)
			return
		}
		on(obj)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: seen,
		// Both: a slice can move to another service.
		UpdateFunc: func(o, n any) { seen(o); seen(n) },
		DeleteFunc: seen,
	}); err != nil {
		panic(err) // only fails on a stopped informer
	}
	if err := inf.SetWatchErrorHandlerWithContext(func(ctx context.Context, r *cache.Reflector, err error) {
		cache.DefaultWatchErrorHandler(ctx, r, err)
		v.fresh.failed(kind, err)
	}); err != nil {
		panic(err) // only fails on a started informer
	}
	if kind != "Lease" {
		v.synced = append(v.synced, inf.HasSynced)
	}
}

func (v *View) changed(obj any) {
	v.dirtyMu.Lock()
	if v.dirtySince.IsZero() {
		v.dirtySince = v.clock.Now()
	}
	key := ServiceOf(obj)
	if key != "" {
		v.dirtySvcs[key] = true
	} else {
		v.dirtyNodes = true // a Node, or something unrecognised: recount nodes
	}
	built := v.built
	v.dirtyMu.Unlock()
	if key != "" && built {
		at := v.clock.Now()
		var iv interimVersion
		if svc, ok := v.reduceFrom(key); ok {
			iv = interimVersion{svc: &svc}
		}
		iv.at = at
		v.dirtyMu.Lock()
		if list := v.interim[key]; len(list) == 0 || !reflect.DeepEqual(list[len(list)-1].svc, iv.svc) {
			v.interim[key] = append(list, iv)
		}
		v.dirtyMu.Unlock()
	}
	select {
	case v.kick <- struct{}{}:
	default:
	}
}

// Run starts the informers and rebuilds the State after changes, at most
// once per debounce, until ctx ends.
func (v *View) Run(ctx context.Context) {
	v.fresh.start()
	v.factory.Start(ctx.Done())
	defer v.factory.Shutdown()
	if v.leases != nil {
		v.leases.Start(ctx.Done())
		defer v.leases.Shutdown()
	}
	go v.runBarrier(ctx)
	if !cache.WaitForCacheSync(ctx.Done(), v.synced...) {
		return
	}
	v.log.Info("informers synced")
	v.rebuild()
	for {
		select {
		case <-ctx.Done():
			return
		case <-v.kick:
		}
		select {
		case <-ctx.Done():
			return
		case <-v.clock.After(v.debounce):
		}
		v.rebuild()
	}
}

// Synced says whether every informer has listed its kind.
func (v *View) Synced() error {
	for i, s := range v.synced {
		if !s() {
			return fmt.Errorf("%s informer not synced yet", []string{"Services", "EndpointSlices", "Nodes"}[i])
		}
	}
	v.mu.RLock()
	defer v.mu.RUnlock()
	if v.rebuilt.IsZero() {
		return fmt.Errorf("cluster state not built yet")
	}
	return nil
}

// interimVersion is one version of a service as an event delivered it,
// dated by the event's arrival; svc is nil when the service was gone.
type interimVersion struct {
	svc *audit.Service
	at  time.Time
}

// rebuild reduces what changed in the caches and publishes a State. Every
// version a service went through is recorded in the History dated by the
// arrival of the event that brought it (the time kube-proxies watching the
// same API saw it too), never by the rebuild: a rebuild held back (by an
// evaluation cycle holding the State, under a takeover's load) folds many
// changes, and dating them all by the first would make every healthy node
// look as far behind as the rebuild was late (the 2,000-node takeover's
// false StuckProxy findings). What no event dated (the first rebuild) is
// dated by when the caches were read. The first rebuild reduces
// everything; later ones only the services whose Service or EndpointSlices
// changed (and the nodes when a Node did).
func (v *View) rebuild() {
	start := v.clock.Now()
	v.dirtyMu.Lock()
	v.dirtySince = time.Time{}
	v.rebuilding = true
	dirty, dirtyNodes, interim := v.dirtySvcs, v.dirtyNodes, v.interim
	v.dirtySvcs, v.dirtyNodes, v.interim = map[string]bool{}, false, map[string][]interimVersion{}
	stamps := v.barrierTaken()
	v.dirtyMu.Unlock()
	first := v.nodeInfo == nil
	if first {
		svcs, _ := v.svcs.List(labels.Everything())
		slices, _ := v.slices.List(labels.Everything())
		sv := make([]corev1.Service, len(svcs))
		sv = sv[:0]
		for _, s := range svcs {
			if !isBarrier(s) {
				sv = append(sv, *s)
			}
		}
		sl := make([]discoveryv1.EndpointSlice, len(slices))
		sl = sl[:0]
		for _, s := range slices {
			if !isBarrier(s) {
				sl = append(sl, *s)
			}
		}
		sort.Slice(sl, func(i, j int) bool { return sl[i].Name < sl[j].Name }) // as reduce orders them
		for _, s := range audit.FromAPI(sv, sl, nil).Services {
			v.reduced[s.Namespace+"/"+s.Name] = s
		}
	} else {
		for key := range dirty {
			v.reduce(key)
		}
	}
	expected := v.ExpectedNodes()
	if first || dirtyNodes {
		nodes, _ := v.nodes.List(labels.Everything())
		nd := make([]corev1.Node, len(nodes))
		for i, n := range nodes {
			nd[i] = *n
		}
		v.nodeInfo = audit.FromAPI(nil, nil, nd).Nodes
		expected = make([]string, 0, len(nd))
		for name, info := range v.nodeInfo {
			if info.Quiet == "" {
				expected = append(expected, name)
			}
		}
		sort.Strings(expected)
	}
	st := &audit.State{Services: make([]audit.Service, 0, len(v.reduced)), Nodes: v.nodeInfo}
	for _, s := range v.reduced {
		st.Services = append(st.Services, s)
	}
	sort.Slice(st.Services, func(i, j int) bool {
		a, b := &st.Services[i], &st.Services[j]
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		return a.Name < b.Name
	})
	v.mu.Lock()
	v.expected = expected
	for key, list := range interim {
		for _, iv := range list {
			if iv.svc != nil {
				v.history.Passed(iv.svc, iv.at)
			} else {
				v.history.Gone(key, iv.at)
			}
		}
	}
	v.history.Update(st, start)
	v.state = st
	v.gen++
	v.rebuilt = v.clock.Now()
	v.mu.Unlock()
	v.dirtyMu.Lock()
	v.rebuilding, v.listedAt, v.built = false, start, true
	v.barrierPublished(stamps)
	v.dirtyMu.Unlock()
	if f := v.onRebuild.Load(); f != nil {
		(*f)(v.clock.Since(start))
	}
}

// reduce recomputes one service (namespace/name) from the caches: its
// Service and the EndpointSlices labelled for it.
func (v *View) reduce(key string) {
	if svc, ok := v.reduceFrom(key); ok {
		v.reduced[key] = svc
	} else {
		delete(v.reduced, key) // gone (an informer cache has no other errors)
	}
}

// reduceFrom reduces one service from the caches; false when it is gone.
// Safe from any goroutine (it only reads the informer caches).
func (v *View) reduceFrom(key string) (audit.Service, bool) {
	ns, name, _ := strings.Cut(key, "/")
	svc, err := v.svcs.Services(ns).Get(name)
	if err != nil {
		return audit.Service{}, false
	}
	objs, _ := v.sliceIdx.ByIndex(byService, key)
	sl := make([]discoveryv1.EndpointSlice, 0, len(objs))
	for _, o := range objs {
		sl = append(sl, *o.(*discoveryv1.EndpointSlice))
	}
	// The index has no order; the reduced service must not change with it.
	slices.SortFunc(sl, func(a, b discoveryv1.EndpointSlice) int { return strings.Compare(a.Name, b.Name) })
	if st := audit.FromAPI([]corev1.Service{*svc}, sl, nil); len(st.Services) == 1 {
		return st.Services[0], true
	}
	return audit.Service{}, false
}

// ObserveRebuilds has f hear each rebuild's duration from now on (the
// aggregator's metrics).
func (v *View) ObserveRebuilds(f func(time.Duration)) { v.onRebuild.Store(&f) }

// Covered is the time up to which the published State holds every change
// the informers delivered: now when nothing is pending, else when the
// caches were read for it. A node's report from after it may show changes
// the State does not have yet; judged against it, a healthy node that is
// ahead of the aggregator would look divergent.
func (v *View) Covered() time.Time {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	if v.dirtySince.IsZero() && !v.rebuilding && !v.listedAt.IsZero() {
		return v.barrierCovered(v.clock.Now(), true)
	}
	return v.barrierCovered(v.listedAt, false)
}

// Read runs f with the current State and History held still.
func (v *View) Read(f func(st *audit.State, h *audit.History, gen uint64)) {
	v.mu.RLock()
	defer v.mu.RUnlock()
	f(v.state, v.history, v.gen)
}

// ExpectedNodes lists the nodes whose collectors should report: every
// node except those going away or known broken (see audit.QuietOf), sorted.
// A node left out is still judged while it reports; it is only never
// called CollectorMissing.
func (v *View) ExpectedNodes() []string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return v.expected
}

const byAddress = "address"
