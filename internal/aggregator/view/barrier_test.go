package view

import (
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// Stamps count only once a published State holds what arrived before them,
// and only this replica's: another replica's clock proves nothing here.
func TestBarrierCoversOnlyPublishedOwnStamps(t *testing.T) {
	v := New(Config{Client: fake.NewClientset(), Keep: time.Minute, Barrier: &Barrier{Namespace: "ns", Identity: "me"}})
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
	v := New(Config{Client: fake.NewClientset(), Keep: time.Minute, Barrier: &Barrier{Namespace: "ns", Identity: "me", Timeout: 10 * time.Second}})
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
