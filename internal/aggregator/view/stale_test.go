package view

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// t0 is where the tests' clocks start.
var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

var spec = synth.Spec{Services: 8, EndpointsPerService: 3}

// An API server that goes away (the open watch ends, lists and watches are
// refused) makes the v stale after staleAfter, naming the kind and the
// error; once it is back and the informer relists, the v is fresh.
func TestFailingWatchMakesTheViewStale(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}},
		&corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "kubernetes"}})
	// The API server "goes away": the open watch ends, every list and
	// watch after it is refused, until it comes back.
	var failing atomic.Bool
	refused := errors.New("dial tcp 10.0.0.1:443: connect: connection refused")
	watches := make(chan *watch.FakeWatcher, 10)
	client.PrependWatchReactor("services", func(k8stesting.Action) (bool, watch.Interface, error) {
		if failing.Load() {
			return true, nil, refused
		}
		w := watch.NewFake()
		watches <- w
		return true, w, nil
	})
	client.PrependReactor("list", "services", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failing.Load() {
			return true, nil, refused
		}
		return false, nil, nil
	})
	clk := clocktesting.NewFakeClock(t0)
	v := New(Config{Client: client, Keep: time.Minute, Debounce: 10 * time.Millisecond, Log: zaptest.NewLogger(t), Clock: clk})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()

	// The informers list and retry in real time; staleness is judged on
	// the v's clock.
	wait := func(what string, cond func() bool) {
		t.Helper()
		testkit.Await(t, 30*time.Second, what, cond, func() string { _, why := v.Stale(); return fmt.Sprintf("stale: %q", why) })
	}
	wait("informers synced", func() bool { return v.Synced() == nil })
	if s, why := v.Stale(); !s.IsZero() {
		t.Fatalf("stale at start: %s", why)
	}
	failing.Store(true)
	(<-watches).Stop()
	wait("the failure recorded", func() bool {
		v.fresh.mu.Lock()
		defer v.fresh.mu.Unlock()
		_, ok := v.fresh.failing["Services"]
		return ok
	})
	clk.Step(staleAfter - time.Second)
	if s, why := v.Stale(); !s.IsZero() {
		t.Fatalf("stale %s after the failure, before staleAfter: %s", staleAfter-time.Second, why)
	}
	clk.Step(2 * time.Second)
	s, why := v.Stale()
	if s.IsZero() || !strings.Contains(why, "Services watch") || !strings.Contains(why, "connection refused") {
		t.Fatalf("%s after the failure: stale since %v: %q", staleAfter+time.Second, s, why)
	}
	failing.Store(false)
	wait("a fresh v", func() bool { s, _ := v.Stale(); return s.IsZero() })
}

// The v covers "now" while nothing is pending; a change not yet in the
// State holds Covered at the moment the published State's caches were read,
// so reports from after it wait for the next rebuild instead of being judged
// against an older cluster than the node may show.
func TestViewCoveredWaitsForPendingChanges(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}})
	const debounce = 600 * time.Millisecond
	clk := clocktesting.NewFakeClock(t0)
	v := New(Config{Client: client, Keep: time.Minute, Debounce: debounce, Log: zaptest.NewLogger(t), Clock: clk})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()
	testkit.Eventually(t, 30*time.Second, "the v synced", func() bool { return v.Synced() == nil })
	// The initial list's events kick one more rebuild: let it pass, until
	// the v waits for nothing on its clock.
	testkit.Eventually(t, 30*time.Second, "the v clean", func() bool {
		if clk.HasWaiters() {
			clk.Step(debounce)
			return false
		}
		v.dirtyMu.Lock()
		defer v.dirtyMu.Unlock()
		return v.dirtySince.IsZero() && !v.rebuilding && len(v.kick) == 0
	})
	clk.Step(time.Second)
	if c := v.Covered(); !c.Equal(clk.Now()) {
		t.Fatalf("a clean v covers %s, not now (%s)", c, clk.Now())
	}
	v.dirtyMu.Lock()
	listed := v.listedAt // when the published State's caches were read
	v.dirtyMu.Unlock()
	before := clk.Now()
	if _, err := client.CoreV1().Services("default").Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "new"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Once the informer delivered the change, Covered stops following the
	// clock: it is the read of the caches before the change.
	testkit.Eventually(t, 30*time.Second, "the change pending", func() bool {
		v.dirtyMu.Lock()
		defer v.dirtyMu.Unlock()
		return !v.dirtySince.IsZero()
	})
	clk.Step(debounce / 2)
	if c := v.Covered(); !c.Equal(listed) || !c.Before(clk.Now()) {
		t.Fatalf("with a change pending the v claims to cover %s (caches read at %s, change at %s)", c, listed, before)
	}
	clk.Step(debounce / 2)
	// The v's loop sets its debounce timer once it took the kick, which
	// under load (-race beside the suites) can come after the steps above:
	// its timer then waits for a step of its own.
	testkit.Eventually(t, 30*time.Second, "the v to cover the change", func() bool {
		if v.Covered().After(before) {
			return true
		}
		if clk.HasWaiters() {
			clk.Step(debounce)
		}
		return false
	})
}

// The v reduces only the services that changed; after every kind of
// change its State equals a reduction of everything from scratch.
func TestViewIncrementalRebuildMatchesFullReduction(t *testing.T) {
	svc := func(name, ip string) *corev1.Service {
		return &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
			Spec: corev1.ServiceSpec{ClusterIP: ip, ClusterIPs: []string{ip}, Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}}
	}
	port, pname, tcp := int32(8080), "http", corev1.ProtocolTCP
	slice := func(name, service string, ips ...string) *discoveryv1.EndpointSlice {
		s := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name, Labels: map[string]string{discoveryv1.LabelServiceName: service}},
			AddressType: discoveryv1.AddressTypeIPv4, Ports: []discoveryv1.EndpointPort{{Name: &pname, Port: &port, Protocol: &tcp}}}
		for _, ip := range ips {
			s.Endpoints = append(s.Endpoints, discoveryv1.Endpoint{Addresses: []string{ip}})
		}
		return s
	}
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"}},
		svc("a", "198.19.0.1"), svc("b", "198.19.0.2"), svc("c", "198.19.0.3"),
		slice("a-1", "a", "198.18.0.1"), slice("b-1", "b", "198.18.0.2"), slice("c-1", "c", "198.18.0.3"), slice("c-2", "c", "198.18.0.4"))
	v := New(Config{Client: client, Keep: time.Minute, Debounce: 10 * time.Millisecond, Log: zaptest.NewLogger(t)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()

	full := func() *audit.State {
		sl, _ := client.CoreV1().Services("").List(ctx, metav1.ListOptions{})
		el, _ := client.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
		nl, _ := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
		sort.Slice(el.Items, func(i, j int) bool { return el.Items[i].Name < el.Items[j].Name })
		return audit.FromAPI(sl.Items, el.Items, nl.Items)
	}
	converge := func(step string) {
		t.Helper()
		want := full()
		var got *audit.State
		testkit.Await(t, 10*time.Second, step+": the v's state equal to a full reduction", func() bool {
			v.Read(func(st *audit.State, _ *audit.History, _ uint64) { got = st })
			return v.Synced() == nil && reflect.DeepEqual(got, want)
		}, func() string { return fmt.Sprintf("the v's state\n%+v\na full reduction\n%+v", got, want) })
	}
	converge("start")
	s := slice("a-1", "a", "198.18.0.1", "198.18.0.9")
	if _, err := client.DiscoveryV1().EndpointSlices("default").Update(ctx, s, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	converge("endpoint added")
	if err := client.CoreV1().Services("default").Delete(ctx, "b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	converge("service deleted")
	if _, err := client.DiscoveryV1().EndpointSlices("default").Update(ctx, slice("c-2", "a", "198.18.0.4"), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	converge("slice moved from c to a")
	if _, err := client.CoreV1().Services("default").Create(ctx, svc("d", "198.19.0.4"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	converge("service created")
	n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1", Labels: map[string]string{corev1.LabelTopologyZone: "z1"}}}
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	converge("node zone")
}

// Two changes to one service inside one debounce window reach the State as
// one, but a kube-proxy syncing between them may have programmed the
// version in between; the History keeps it, so a node showing it is behind,
// not divergent. (The 1,000-node simulation called healthy nodes divergent
// for exactly this.)
func TestViewKeepsVersionsBetweenRebuilds(t *testing.T) {
	svcs, slices := spec.Objects()
	client := fake.NewClientset(&svcs[0], &slices[0])
	clk := clocktesting.NewFakeClock(t0)
	v := New(Config{Client: client, Keep: time.Minute, Debounce: 500 * time.Millisecond, Log: zaptest.NewLogger(t), Clock: clk})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()
	testkit.Eventually(t, 30*time.Second, "the v synced", func() bool { return v.Synced() == nil })
	key := svcs[0].Namespace + "/" + svcs[0].Name
	sl := slices[0].DeepCopy()
	var wantBetween []string
	for i := range 2 { // drop the last endpoint, then the next: two changes within the window
		sl.Endpoints = sl.Endpoints[:len(sl.Endpoints)-1]
		if i == 0 {
			for _, e := range sl.Endpoints {
				wantBetween = append(wantBetween, e.Addresses[0])
			}
		}
		if _, err := client.DiscoveryV1().EndpointSlices(sl.Namespace).Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		testkit.Eventually(t, 30*time.Second, "the change delivered", func() bool {
			v.dirtyMu.Lock()
			defer v.dirtyMu.Unlock()
			return len(v.interim[key]) == i+1
		})
		clk.Step(100 * time.Millisecond)
	}
	since := clk.Now()
	clk.Step(500 * time.Millisecond)
	testkit.Eventually(t, 30*time.Second, "the v to cover the changes", func() bool { return v.Covered().After(since) })
	var got [][]string
	v.Read(func(_ *audit.State, h *audit.History, _ uint64) {
		for _, v := range h.Versions(key) {
			if v.Svc == nil {
				continue // before the service was first seen
			}
			var eps []string
			for _, sl := range v.Svc.Slices {
				for _, e := range sl.Endpoints {
					eps = append(eps, e.Addr.String())
				}
			}
			got = append(got, eps)
		}
	})
	if len(got) != 3 {
		t.Fatalf("kept versions %v, want the first, the one in between and the last", got)
	}
	if fmt.Sprint(got[1]) != fmt.Sprint(wantBetween) {
		t.Errorf("version in between %v, want %v", got[1], wantBetween)
	}
}

// A rebuild held back (an evaluation cycle holding the State for tens of
// seconds, as a new leader's did at 2,000 nodes) folds every change that
// arrived meanwhile; each version must still be dated by when its event
// arrived. Dated by the first change, a node showing the version of a
// second ago looked as far behind as the rebuild was late: thousands of
// false StuckProxy findings after the takeover.
func TestHeldBackRebuildDatesEachVersion(t *testing.T) {
	svcs, slices := spec.Objects()
	client := fake.NewClientset(&svcs[0], &slices[0], &svcs[1], &slices[1])
	clk := clocktesting.NewFakeClock(t0)
	v := New(Config{Client: client, Keep: 5 * time.Minute, Debounce: 500 * time.Millisecond, Log: zaptest.NewLogger(t), Clock: clk})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()
	testkit.Eventually(t, 30*time.Second, "the v synced", func() bool { return v.Synced() == nil })

	// The State is held, so no rebuild can publish.
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	defer releaseOnce() // before the v is stopped, or a failure hangs
	go v.Read(func(*audit.State, *audit.History, uint64) { close(held); <-release })
	<-held
	key0, key1 := svcs[0].Namespace+"/"+svcs[0].Name, svcs[1].Namespace+"/"+svcs[1].Name
	var when []time.Time
	sl := slices[0].DeepCopy()
	for i := range 3 { // service 0 drops an endpoint at 0 s, 10 s, 20 s into the hold
		sl.Endpoints = sl.Endpoints[:len(sl.Endpoints)-1]
		if i == 2 {
			sl.Endpoints = slices[0].Endpoints // and gets them back
		}
		if _, err := client.DiscoveryV1().EndpointSlices(sl.Namespace).Update(ctx, sl, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		// (A rebuild may have taken the earlier changes and wait for the
		// State: the latest interim version is this change's.)
		want := len(sl.Endpoints)
		testkit.Eventually(t, 30*time.Second, fmt.Sprintf("change %d delivered", i), func() bool {
			v.dirtyMu.Lock()
			defer v.dirtyMu.Unlock()
			list := v.interim[key0]
			if len(list) == 0 || list[len(list)-1].svc == nil {
				return false
			}
			n := 0
			for _, sl := range list[len(list)-1].svc.Slices {
				n += len(sl.Endpoints)
			}
			return n == want
		})
		when = append(when, clk.Now())
		clk.Step(10 * time.Second)
		if i == 0 {
			// A rebuild takes this change and waits for the State.
			testkit.Eventually(t, 30*time.Second, "a rebuild under way", func() bool {
				v.dirtyMu.Lock()
				defer v.dirtyMu.Unlock()
				return v.rebuilding
			})
		}
	}
	// Service 1 is deleted 30 s into the hold.
	if err := client.CoreV1().Services(svcs[1].Namespace).Delete(ctx, svcs[1].Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 30*time.Second, "the deletion delivered", func() bool {
		v.dirtyMu.Lock()
		defer v.dirtyMu.Unlock()
		list := v.interim[key1]
		return len(list) > 0 && list[len(list)-1].svc == nil
	})
	deleted := clk.Now()
	clk.Step(10 * time.Second)
	releaseOnce()
	testkit.Eventually(t, 30*time.Second, "the held-back changes published", func() bool {
		clk.Step(100 * time.Millisecond) // the next rebuild's debounce
		return v.Covered().After(deleted)
	})

	v.Read(func(_ *audit.State, h *audit.History, _ uint64) {
		vs := h.Versions(key0)
		if len(vs) < 3 {
			t.Fatalf("service 0 kept %d versions, want its first and the three changes", len(vs))
		}
		vs = vs[len(vs)-3:]
		for i, v := range vs {
			if !v.Since.Equal(when[i]) {
				t.Errorf("service 0's version %d dated %s into the hold, want %s (when its event arrived)", i, v.Since.Sub(when[0]), when[i].Sub(when[0]))
			}
		}
		gone := h.Versions(key1)
		if last := gone[len(gone)-1]; last.Svc != nil || !last.Since.Equal(deleted) {
			t.Errorf("service 1's last version: gone %v, dated %s into the hold; want gone at %s", last.Svc == nil, last.Since.Sub(when[0]), deleted.Sub(when[0]))
		}
	})
}
