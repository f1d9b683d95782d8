package aggregator

import (
	"sync"
	"time"

	"go.uber.org/zap"

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
