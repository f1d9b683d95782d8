package aggregator

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// viewHealth is whether the leader's view of the API is stale, and the
// recovery after it. Evaluate's goroutine writes it (blind); the API and
// Evaluate read it.
type viewHealth struct {
	mu sync.Mutex
	// staleSince: since when the view is stale (zero: fresh), and why;
	// while stale nothing is judged or repaired.
	staleSince time.Time
	staleWhy   string
	freshSince time.Time // a stale view first looked fresh again
	// recovering: until when node drift is held back after a stale view.
	recovering time.Time
}

// Recovering says until when node drift is held back after the view came
// back from stale (zero or past: not recovering).
func (a *Aggregator) Recovering() time.Time {
	a.health.mu.Lock()
	defer a.health.mu.Unlock()
	return a.health.recovering
}

// blind checks the view's freshness. A stale view is not judged from:
// kube-proxies whose watches work would look drifted against it (false
// findings) and repairs would act on them. The last verdict stays, marked
// stale, and one notice goes out when it starts and one when it ends.
func (a *Aggregator) blind() bool {
	since, why := a.view.Stale()
	now := a.cfg.Clock.Now()
	a.health.mu.Lock()
	was := !a.health.staleSince.IsZero()
	switch {
	case !since.IsZero():
		if !was || since.Before(a.health.staleSince) {
			a.health.staleSince = since
		}
		a.health.staleWhy, a.health.freshSince = why, time.Time{}
	case was:
		// A watch that flaps (lists work, watches fail) must not page on
		// every relist: fresh again only after freshAfter without a fault.
		if a.health.freshSince.IsZero() {
			a.health.freshSince = now
		}
		if now.Sub(a.health.freshSince) >= freshAfter {
			a.health.staleSince, a.health.staleWhy = time.Time{}, ""
			a.health.recovering = now.Add(a.cfg.RecoveryGrace)
		}
	}
	stale := !a.health.staleSince.IsZero()
	staleSince, staleWhy := a.health.staleSince, a.health.staleWhy
	a.health.mu.Unlock()
	a.cfg.Metrics.ViewStale.Set(map[bool]float64{true: 1}[stale])
	if stale == was {
		return stale
	}
	n := remediate.Notice{Action: remediate.Action{Kind: remediate.ViewFresh, Node: remediate.SelfNode,
		Reason: "the aggregator's watches deliver again; judging resumes (a drift shows after the grace period)"}}
	if stale {
		a.cfg.Log.Error("view of the API is stale: findings are unknown, nothing is judged or repaired", zap.Time("since", staleSince), zap.String("why", staleWhy))
		n = remediate.Notice{Action: remediate.Action{Kind: remediate.ViewStale, Node: remediate.SelfNode, Reason: staleWhy}, Since: staleSince}
	} else {
		a.cfg.Log.Info("view of the API is fresh again: judging resumes; node drift held back while kube-proxies reconnect",
			zap.Duration("recovery_grace", a.cfg.RecoveryGrace))
	}
	if a.cfg.Notifier != nil {
		a.cfg.Notifier.Notify(n)
	}
	return stale
}

// freshAfter is how long a stale view must look fresh before judging
// resumes.
const freshAfter = 5 * time.Second

// Stale says since when and why the leader's view is stale (zero: fresh).
func (a *Aggregator) Stale() (time.Time, string) {
	a.health.mu.Lock()
	defer a.health.mu.Unlock()
	return a.health.staleSince, a.health.staleWhy
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

// freshness records whether the view's watches deliver: watch failures by
// kind and the canary's last movement.
type freshness struct {
	clock   clock.Clock
	mu      sync.Mutex
	failing map[string]watchFailure // informer kind → first error not yet followed by an event
	canary  *Canary
	moved   time.Time // last time the canary was seen to move
	started time.Time
}

func (f *freshness) start() {
	f.mu.Lock()
	f.started = f.clock.Now()
	f.mu.Unlock()
}

// delivered records an event of kind: its watch works.
func (f *freshness) delivered(kind string) {
	f.mu.Lock()
	delete(f.failing, kind)
	f.mu.Unlock()
}

// failed records a list or watch error of kind (the first of a run).
func (f *freshness) failed(kind string, err error) {
	f.mu.Lock()
	if _, ok := f.failing[kind]; !ok {
		f.failing[kind] = watchFailure{since: f.clock.Now(), err: err.Error()}
	}
	f.mu.Unlock()
}

func (f *freshness) canarySeen() {
	f.mu.Lock()
	f.moved = f.clock.Now()
	f.mu.Unlock()
}

// stale says since when and why the watches are not to be trusted at now:
// a watch failing for longer than staleAfter, or the canary not seen to
// move for its timeout.
func (f *freshness) stale(now time.Time) (time.Time, []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var since time.Time
	var why []string
	kinds := make([]string, 0, len(f.failing))
	for k := range f.failing {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		w := f.failing[k]
		if now.Sub(w.since) < staleAfter {
			continue
		}
		if since.IsZero() || w.since.Before(since) {
			since = w.since
		}
		why = append(why, fmt.Sprintf("the %s watch has failed since %s: %s", k, w.since.UTC().Format(time.RFC3339), clip(w.err)))
	}
	if f.canary != nil && !f.started.IsZero() {
		last := f.moved
		if last.IsZero() {
			last = f.started
		}
		if quiet := now.Sub(last); quiet > f.canary.Timeout {
			if since.IsZero() || last.Before(since) {
				since = last
			}
			why = append(why, fmt.Sprintf("no renewal of Lease %s/%s seen through the watch for %s (API server unreachable, or watches stuck)",
				f.canary.Namespace, f.canary.Lease, quiet.Round(time.Second)))
		}
	}
	return since, why
}

// Stale says since when, and why, the view may be older than the API: a
// watch failing for longer than staleAfter, the canary not seen to move
// for its timeout, or the barrier's stamps not coming back. Zero time:
// fresh.
func (v *View) Stale() (time.Time, string) {
	now := v.clock.Now()
	since, why := v.fresh.stale(now)
	if bs, bwhy := v.barrierStale(now); len(bwhy) > 0 {
		if since.IsZero() || bs.Before(since) {
			since = bs
		}
		why = append(why, bwhy...)
	}
	return since, strings.Join(why, "; ")
}
