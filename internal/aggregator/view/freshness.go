package view

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

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
		why = append(why, fmt.Sprintf("the %s watch has failed since %s: %s", k, w.since.UTC().Format(time.RFC3339), safetext.Clean(w.err, 80)))
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
