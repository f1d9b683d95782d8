package view

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// Barrier bounds how far the view's Services and EndpointSlices watches
// trail the API. Every Every, the leader stamps a Service and an
// EndpointSlice of its own with its clock. One watch delivers its kind's
// events in the order the API server committed them, so when a stamp
// written at t arrives through a watch, every change of that kind
// committed before t has arrived too. A node's report heard before t
// cannot show a change the view has not been given, and is judged only
// then (see View.Covered). Without it, an aggregator whose watches trail
// the API (CPU-starved, a slow watch cache, one watch stuck while the
// others flow) sees healthy nodes that are ahead of it as divergent.
//
// A stamp not seen through its watch for Timeout makes the view stale,
// and so does failing to write one: judging would otherwise stop without
// a word.
type Barrier struct {
	Namespace string
	Identity  string // only this replica's stamps count: they carry its clock
	Every     time.Duration
	Timeout   time.Duration
	// Active says whether stamps are needed now (this replica leads).
	Active func() bool
}

// The barrier objects: a headless Service without selector (no cluster IP,
// no endpoints controller) and an EndpointSlice nobody's controller
// manages. Their labels keep them out of every kube-proxy's watches, which
// filter server-side (see stampLabels).
const (
	BarrierName = "proxyaudit-barrier"
	barrierAt   = "proxyaudit.io/barrier-at"
	barrierBy   = "proxyaudit.io/barrier-by"
	barrierSig  = "proxyaudit.io/barrier-sig"
)

var barrierKinds = [...]string{"Services", "EndpointSlices"}

// barrierState is the View's record of stamps (under dirtyMu).
type barrierState struct {
	cfg     *Barrier
	by      string               // hash of cfg.Identity, as stamped
	key     []byte               // this process's key: signs its stamps
	pending map[string]time.Time // seen, not yet in a published State
	passed  map[string]time.Time // seen and in a published State
	unseen  map[string][]time.Time
	// writeErr is the first failure of a run of failed writes.
	writeErr   error
	writeSince time.Time
	activeAt   time.Time // when stamping last started; zero while inactive
	// forged counts stamps refused: another namespace or name, a bad
	// signature, a time ahead of this replica's clock.
	forged int
}

// isBarrier says whether obj (or an informer's tombstone of it) is one of
// the barrier objects, which are never part of the cluster's state.
func isBarrier(obj any) bool {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	m, err := meta.Accessor(obj)
	return err == nil && m.GetLabels()[audit.LabelServiceProxyName] == BarrierName
}

// stampLabels are a barrier object's labels stamped by by at at, signed
// with key. kube-proxy's Services watch leaves out service-proxy-name; its
// EndpointSlices watch leaves out only service.kubernetes.io/headless
// (cmd/kube-proxy/app/server.go): without that label every kube-proxy
// received the barrier slice every second, and logged that it has no
// service-name label.
func stampLabels(key []byte, by string, at time.Time) map[string]string {
	t := strconv.FormatInt(at.UnixNano(), 10)
	return map[string]string{audit.LabelServiceProxyName: BarrierName, barrierAt: t, barrierBy: by, barrierSig: stampSig(key, by, t),
		"endpointslice.kubernetes.io/managed-by": "proxyaudit.io", corev1.IsHeadlessService: ""}
}

// stampSig authenticates a stamp: HMAC-SHA256 under a key only this
// process holds, 128 bits in hex (a label value). Whoever can write a
// Service (any tenant, in their namespace) or read the barrier objects
// cannot make a stamp this replica accepts, so cannot move "covered"
// forward and hide a stuck watch.
func stampSig(key []byte, by, at string) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(by + "/" + at))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

func identityHash(id string) string {
	h := fnv.New64a()
	h.Write([]byte(id))
	return strconv.FormatUint(h.Sum64(), 16)
}

// newBarrierState is the View's record for stamps of b.
func newBarrierState(b Barrier) *barrierState {
	if b.Every <= 0 {
		b.Every = time.Second
	}
	if b.Active == nil {
		b.Active = func() bool { return true }
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		panic(fmt.Sprintf("barrier key: %v", err)) // crypto/rand does not fail on Linux
	}
	return &barrierState{cfg: &b, by: identityHash(b.Identity), key: key, pending: map[string]time.Time{},
		passed: map[string]time.Time{}, unseen: map[string][]time.Time{}}
}

// stamped records a barrier object seen through kind's watch.
func (v *View) stamped(kind string, obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	m, err := meta.Accessor(obj)
	if err != nil {
		return
	}
	now := v.clock.Now()
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	b := v.barrier
	labels := m.GetLabels()
	if b == nil || labels[barrierBy] != b.by {
		return // another replica's (or an older process's) stamps prove nothing here
	}
	ns, err := strconv.ParseInt(labels[barrierAt], 10, 64)
	at := time.Unix(0, ns)
	if err != nil || m.GetNamespace() != b.cfg.Namespace || m.GetName() != BarrierName ||
		!hmac.Equal([]byte(labels[barrierSig]), []byte(stampSig(b.key, b.by, labels[barrierAt]))) || at.After(now) {
		// A restarted process sees its predecessor's last stamp once per
		// kind (same identity, another key): expected, said quietly. A
		// stream of them is someone writing stamps.
		b.forged++
		switch {
		case b.forged == 1:
			v.log.Info("ignored a watch-barrier stamp this process did not write (an earlier process's, or forged)",
				zap.String("kind", kind), zap.String("object", m.GetNamespace()+"/"+m.GetName()))
		case b.forged == 100 || b.forged%1000 == 0:
			v.log.Warn("refusing watch-barrier stamps this process did not write: someone writes forged stamps; only this replica's own signed stamps count",
				zap.String("kind", kind), zap.String("object", m.GetNamespace()+"/"+m.GetName()), zap.Int("refused", b.forged))
		}
		return
	}
	if at.After(b.pending[kind]) {
		b.pending[kind] = at
	}
	u := b.unseen[kind]
	for len(u) > 0 && !u[0].After(at) {
		u = u[1:]
	}
	b.unseen[kind] = u
}

// barrierCovered lowers covered to what the stamps prove (dirtyMu held).
// A stamp counts once a rebuild that started after it arrived has
// published, or at once when nothing is pending.
func (v *View) barrierCovered(covered time.Time, clean bool) time.Time {
	b := v.barrier
	if b == nil {
		return covered
	}
	for _, k := range barrierKinds {
		at := b.passed[k]
		if clean && b.pending[k].After(at) {
			at = b.pending[k]
		}
		if at.Before(covered) {
			covered = at
		}
	}
	return covered
}

// barrierTaken and barrierPublished bracket a rebuild (dirtyMu held):
// stamps seen before the rebuild took its changes are in what it publishes.
func (v *View) barrierTaken() map[string]time.Time {
	if v.barrier == nil {
		return nil
	}
	out := make(map[string]time.Time, len(v.barrier.pending))
	for k, at := range v.barrier.pending {
		out[k] = at
	}
	return out
}

func (v *View) barrierPublished(taken map[string]time.Time) {
	if v.barrier == nil {
		return
	}
	for k, at := range taken {
		if at.After(v.barrier.passed[k]) {
			v.barrier.passed[k] = at
		}
	}
}

// barrierStale says why the barrier makes the view stale, if it does.
func (v *View) barrierStale(now time.Time) (time.Time, []string) {
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	b := v.barrier
	if b == nil || b.activeAt.IsZero() || b.cfg.Timeout <= 0 {
		return time.Time{}, nil
	}
	var since time.Time
	var why []string
	if b.writeErr != nil && now.Sub(b.writeSince) > b.cfg.Timeout {
		since = b.writeSince
		why = append(why, fmt.Sprintf("cannot stamp its watch barrier (Service and EndpointSlice %s/%s) since %s: %s; the chart creates them and grants patch; elsewhere create them or grant create and patch, or run with --watch-barrier=false",
			b.cfg.Namespace, BarrierName, b.writeSince.UTC().Format(time.RFC3339), safetext.Clean(b.writeErr.Error(), 80)))
	}
	for _, k := range barrierKinds {
		if u := b.unseen[k]; len(u) > 0 && now.Sub(u[0]) > b.cfg.Timeout {
			if since.IsZero() || u[0].Before(since) {
				since = u[0]
			}
			why = append(why, fmt.Sprintf("the %s watch has not delivered the aggregator's own write of %s for %s (watch stuck or far behind the API)",
				k, u[0].UTC().Format(time.RFC3339), now.Sub(u[0]).Round(time.Second)))
		}
	}
	return since, why
}

// runBarrier stamps the barrier objects every Every while Active, until
// ctx ends.
func (v *View) runBarrier(ctx context.Context) {
	v.dirtyMu.Lock()
	b := v.barrier
	v.dirtyMu.Unlock()
	if b == nil {
		return
	}
	for {
		if b.cfg.Active() {
			v.stamp(ctx, b)
		} else {
			v.dirtyMu.Lock()
			b.activeAt, b.writeErr = time.Time{}, nil
			clear(b.unseen)
			v.dirtyMu.Unlock()
		}
		select {
		case <-ctx.Done():
			return
		case <-v.clock.After(b.cfg.Every):
		}
	}
}

// stamp writes the current time on both barrier objects, creating them
// when missing.
func (v *View) stamp(ctx context.Context, b *barrierState) {
	at := v.clock.Now()
	v.dirtyMu.Lock()
	if b.activeAt.IsZero() {
		b.activeAt = at
	}
	v.dirtyMu.Unlock()
	labels := stampLabels(b.key, b.by, at)
	patch := []byte(fmt.Sprintf(`{"metadata":{"labels":{%q:%q,%q:%q,%q:%q}}}`, barrierAt, labels[barrierAt], barrierBy, b.by, barrierSig, labels[barrierSig]))
	ns := b.cfg.Namespace
	meta := metav1.ObjectMeta{Name: BarrierName, Namespace: ns, Labels: labels}
	wctx, cancel := context.WithTimeout(ctx, b.cfg.Every+5*time.Second)
	defer cancel()
	var failed error
	for _, kind := range barrierKinds {
		var err error
		switch kind {
		case "Services":
			_, err = v.client.CoreV1().Services(ns).Patch(wctx, BarrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			if apierrors.IsNotFound(err) {
				_, err = v.client.CoreV1().Services(ns).Create(wctx, &corev1.Service{ObjectMeta: meta,
					Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone}}, metav1.CreateOptions{})
			}
		case "EndpointSlices":
			_, err = v.client.DiscoveryV1().EndpointSlices(ns).Patch(wctx, BarrierName, types.MergePatchType, patch, metav1.PatchOptions{})
			if apierrors.IsNotFound(err) {
				_, err = v.client.DiscoveryV1().EndpointSlices(ns).Create(wctx, &discoveryv1.EndpointSlice{ObjectMeta: meta,
					AddressType: discoveryv1.AddressTypeIPv4, Endpoints: []discoveryv1.Endpoint{}}, metav1.CreateOptions{})
			}
		}
		if err != nil {
			failed = fmt.Errorf("%s %s/%s: %w", kind, ns, BarrierName, err)
			continue
		}
		v.dirtyMu.Lock()
		// Its event may have arrived before the write returned.
		if u := b.unseen[kind]; len(u) < 4096 && b.pending[kind].Before(at) {
			b.unseen[kind] = append(u, at)
		}
		v.dirtyMu.Unlock()
	}
	v.dirtyMu.Lock()
	defer v.dirtyMu.Unlock()
	switch {
	case failed != nil && b.writeErr == nil:
		b.writeErr, b.writeSince = failed, at
		v.log.Warn("cannot stamp the watch barrier: reports wait to be judged", zap.Error(failed))
	case failed == nil && b.writeErr != nil:
		v.log.Info("watch barrier stamped again", zap.Time("failing_since", b.writeSince))
		b.writeErr = nil
	}
}
