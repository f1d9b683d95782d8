package aggregator

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	listersdiscoveryv1 "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/remediate"
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
	barrier    *barrierState // nil without UseBarrier
	listedAt   time.Time     // when the published State's caches were read
	kick       chan struct{}
	// What changed since the last rebuild: services by namespace/name
	// (their own events and their slices'), and whether any Node did.
	dirtySvcs  map[string]bool
	dirtyNodes bool
	// interim are the versions each changed service went through since
	// the last rebuild, reduced as their events arrived (after the first
	// rebuild): a rebuild folds them into one, but a kube-proxy syncing
	// in between may have programmed any of them.
	interim map[string][]audit.Service
	built   bool // the first rebuild is done: record interim versions

	// The rebuild's own memory (Run's goroutine only): every service
	// reduced once and kept until it changes, so a rebuild under churn
	// costs the changed services, not the cluster.
	sliceIdx cache.Indexer
	reduced  map[string]audit.Service
	nodeInfo map[string]audit.NodeInfo

	mu    sync.RWMutex
	state *audit.State
	// expected are the nodes that should have a reporting collector.
	expected []string
	history  *audit.History
	gen      uint64 // bumps on every rebuild
	rebuilt  time.Time
	// OnRebuild observes each rebuild's duration (metrics).
	onRebuild func(time.Duration)

	// Freshness: a view the API stopped updating must not be judged from.
	freshMu  sync.Mutex
	failing  map[string]watchFailure // informer kind → first error not yet followed by an event
	canary   *Canary
	canaryAt time.Time // last time the canary was seen to move
	started  time.Time
}

type watchFailure struct {
	since time.Time
	err   string
}

// Canary is an object somebody updates every few seconds (the leader
// renews its Lease every retry period). Seeing its updates through a watch
// proves the aggregator's watches deliver; not seeing them for Timeout
// means the view may be old even though nothing reported an error: the
// API server unreachable, a stuck watch, an API server whose watch cache
// lags. It is the failure proxyaudit looks for in kube-proxy, turned on
// itself.
type Canary struct {
	Namespace, Lease string
	Timeout          time.Duration
}

// staleAfter is how long a watch may fail before the view counts as stale:
// an ordinary "resource version too old" relist takes well under it.
const staleAfter = 5 * time.Second

// NewView prepares the informers; Run starts them. keep is how long
// superseded versions stay matchable (more than the grace period).
// A non-nil canary also watches that Lease (see Canary).
func NewView(client kubernetes.Interface, keep time.Duration, log *zap.Logger, clk clock.Clock, canary *Canary) *View {
	f := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTransform(Trim))
	v := &View{
		log: log, clock: clk, client: client, factory: f,
		svcs:      f.Core().V1().Services().Lister(),
		slices:    f.Discovery().V1().EndpointSlices().Lister(),
		nodes:     f.Core().V1().Nodes().Lister(),
		kick:      make(chan struct{}, 1),
		history:   audit.NewHistory(keep),
		dirtySvcs: map[string]bool{},
		interim:   map[string][]audit.Service{},
		reduced:   map[string]audit.Service{},
		state:     &audit.State{Nodes: map[string]audit.NodeInfo{}},
		failing:   map[string]watchFailure{},
		canary:    canary,
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
	for _, k := range []struct {
		kind string
		inf  cache.SharedIndexInformer
	}{
		{"Services", f.Core().V1().Services().Informer()},
		{"EndpointSlices", sliceInf},
		{"Nodes", f.Core().V1().Nodes().Informer()},
	} {
		v.watch(k.kind, k.inf, v.changed)
	}
	if canary != nil {
		lf := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithNamespace(canary.Namespace),
			informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + canary.Lease }))
		v.watch("Lease", lf.Coordination().V1().Leases().Informer(), func(obj any) {
			v.freshMu.Lock()
			v.canaryAt = v.clock.Now()
			v.freshMu.Unlock()
		})
		v.leases = lf
	}
	return v
}

// watch registers the informer's handlers: every event calls on and
// clears a recorded watch failure of that kind; every list or watch error
// is recorded.
func (v *View) watch(kind string, inf cache.SharedIndexInformer, on func(any)) {
	seen := func(obj any) {
		v.freshMu.Lock()
		delete(v.failing, kind)
		v.freshMu.Unlock()
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
		v.freshMu.Lock()
		if _, ok := v.failing[kind]; !ok {
			v.failing[kind] = watchFailure{since: v.clock.Now(), err: err.Error()}
		}
		v.freshMu.Unlock()
	}); err != nil {
		panic(err) // only fails on a started informer
	}
	if kind != "Lease" {
		v.synced = append(v.synced, inf.HasSynced)
	}
}

// Stale says since when, and why, the view may be older than the API: a
// watch failing for longer than staleAfter, or the canary not seen to
// move for its timeout. Zero time: fresh.
func (v *View) Stale() (time.Time, string) {
	now := v.clock.Now()
	v.freshMu.Lock()
	defer v.freshMu.Unlock()
	var since time.Time
	var why []string
	kinds := make([]string, 0, len(v.failing))
	for k := range v.failing {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		f := v.failing[k]
		if now.Sub(f.since) < staleAfter {
			continue
		}
		if since.IsZero() || f.since.Before(since) {
			since = f.since
		}
		why = append(why, fmt.Sprintf("the %s watch has failed since %s: %s", k, f.since.UTC().Format(time.RFC3339), clip(f.err)))
	}
	if v.canary != nil && !v.started.IsZero() {
		last := v.canaryAt
		if last.IsZero() {
			last = v.started
		}
		if quiet := now.Sub(last); quiet > v.canary.Timeout {
			if since.IsZero() || last.Before(since) {
				since = last
			}
			why = append(why, fmt.Sprintf("no renewal of Lease %s/%s seen through the watch for %s (API server unreachable, or watches stuck)",
				v.canary.Namespace, v.canary.Lease, quiet.Round(time.Second)))
		}
	}
	if bs, bwhy := v.barrierStale(now); len(bwhy) > 0 {
		if since.IsZero() || bs.Before(since) {
			since = bs
		}
		why = append(why, bwhy...)
	}
	return since, strings.Join(why, "; ")
}

// Trim drops what the audit never reads before an object enters the
// informer cache: managed fields, annotations, owner references, endpoint
// target references, most of Node status. At 100k endpoints this is the
// difference the benchmarks in docs/benchmarks.md record.
func Trim(obj any) (any, error) {
	if m, err := meta.Accessor(obj); err == nil {
		m.SetManagedFields(nil)
		m.SetOwnerReferences(nil)
		// Only a Node's incident annotations are read (remediation).
		var keep map[string]string
		if _, node := obj.(*corev1.Node); node {
			for k, v := range m.GetAnnotations() {
				if strings.HasPrefix(k, remediate.AnnotationPrefix) {
					if keep == nil {
						keep = map[string]string{}
					}
					keep[k] = v
				}
			}
		}
		m.SetAnnotations(keep)
	}
	switch o := obj.(type) {
	case *discoveryv1.EndpointSlice:
		for i := range o.Endpoints {
			o.Endpoints[i].TargetRef = nil
			o.Endpoints[i].DeprecatedTopology = nil
			o.Endpoints[i].Hostname = nil
		}
	case *corev1.Node:
		var ready []corev1.NodeCondition
		for _, c := range o.Status.Conditions {
			if c.Type == corev1.NodeReady || c.Type == remediate.ConditionType {
				ready = append(ready, corev1.NodeCondition{Type: c.Type, Status: c.Status, Reason: c.Reason})
			}
		}
		o.Status = corev1.NodeStatus{Conditions: ready, Addresses: o.Status.Addresses, NodeInfo: corev1.NodeSystemInfo{KubeProxyVersion: o.Status.NodeInfo.KubeProxyVersion}}
		o.Spec.PodCIDR, o.Spec.PodCIDRs = "", nil
	}
	return obj, nil
}

// byService indexes EndpointSlices by the namespace/name of their service.
const byService = "service"

// ServiceOf is the namespace/name an EndpointSlice or Service (or an
// informer's tombstone of one) belongs to; "" for anything else.
func ServiceOf(obj any) string {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	switch o := obj.(type) {
	case *corev1.Service:
		return o.Namespace + "/" + o.Name
	case *discoveryv1.EndpointSlice:
		if name := o.Labels[discoveryv1.LabelServiceName]; name != "" {
			return o.Namespace + "/" + name
		}
	}
	return ""
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
		svc, ok := v.reduceFrom(key)
		v.dirtyMu.Lock()
		if list := v.interim[key]; ok && (len(list) == 0 || !reflect.DeepEqual(list[len(list)-1], svc)) {
			v.interim[key] = append(list, svc)
		}
		v.dirtyMu.Unlock()
	}
	select {
	case v.kick <- struct{}{}:
	default:
	}
}

// Run starts the informers and rebuilds the State after changes, at most
// every debounce, until ctx ends.
func (v *View) Run(ctx context.Context, debounce time.Duration) {
	v.freshMu.Lock()
	v.started = v.clock.Now()
	v.freshMu.Unlock()
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
		case <-v.clock.After(debounce):
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

// rebuild reduces what changed in the caches and publishes a State, recorded
// in the History dated by the first change it includes. The first rebuild
// reduces everything; later ones only the services whose Service or
// EndpointSlices changed (and the nodes when a Node did).
func (v *View) rebuild() {
	start := v.clock.Now()
	v.dirtyMu.Lock()
	at := v.dirtySince
	v.dirtySince = time.Time{}
	v.rebuilding = true
	dirty, dirtyNodes, interim := v.dirtySvcs, v.dirtyNodes, v.interim
	v.dirtySvcs, v.dirtyNodes, v.interim = map[string]bool{}, false, map[string][]audit.Service{}
	stamps := v.barrierTaken()
	v.dirtyMu.Unlock()
	if at.IsZero() {
		at = start
	}
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
		for i := range nd {
			if reason := quietReason(&nd[i]); reason == "" {
				expected = append(expected, nd[i].Name)
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
		final, ok := v.reduced[key]
		for i := range list {
			if !ok || !reflect.DeepEqual(list[i], final) {
				v.history.Passed(&list[i], at)
			}
		}
	}
	v.history.Update(st, at)
	v.state = st
	v.gen++
	v.rebuilt = v.clock.Now()
	v.mu.Unlock()
	v.dirtyMu.Lock()
	v.rebuilding, v.listedAt, v.built = false, start, true
	v.barrierPublished(stamps)
	v.dirtyMu.Unlock()
	if v.onRebuild != nil {
		v.onRebuild(v.clock.Since(start))
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
// node except those going away or known broken (see quietReason), sorted.
// A node left out is still judged while it reports; it is only never
// called CollectorMissing.
func (v *View) ExpectedNodes() []string {
	v.mu.RLock()
	defer v.mu.RUnlock()
	return v.expected
}

// ToBeDeletedTaint is the cluster autoscaler's mark on a node it removes.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// quietReason says why a node is not expected to report, or "": it is
// being deleted, the autoscaler is removing it, or its kubelet is not
// Ready (a broken node is the kubelet's finding; its collector being
// down with it is not news). A node without a Ready condition at all is
// expected (nothing says it is broken).
func quietReason(n *corev1.Node) string {
	if n.DeletionTimestamp != nil {
		return "being deleted"
	}
	for _, t := range n.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			return "removed by the cluster autoscaler"
		}
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status != corev1.ConditionTrue {
			return "not Ready"
		}
	}
	return ""
}

// servicesProgrammed counts the services kube-proxy programs (not skipped).
func servicesProgrammed(st *audit.State) int {
	n := 0
	for i := range st.Services {
		if st.Services[i].Skip == "" {
			n++
		}
	}
	return n
}
