package aggregator

import (
	"sync"
	"time"
)

// viewHealth is whether the leader's view of the API is stale, and the
// recovery after it. Evaluate's goroutine writes it (observe); the API and
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

// freshAfter is how long a stale view must look fresh before judging
// resumes.
const freshAfter = 5 * time.Second

// observe takes what the view says of its freshness now (since: stale
// since when, zero when fresh; why) and says whether the view counts as
// stale, and whether that changed. A view that comes back is fresh only
// after freshAfter without a fault (a watch that flaps, lists working and
// watches failing, must not page on every relist), and node drift is then
// held back for grace.
func (h *viewHealth) observe(since time.Time, why string, now time.Time, grace time.Duration) (stale, changed bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	was := !h.staleSince.IsZero()
	switch {
	case !since.IsZero():
		if !was || since.Before(h.staleSince) {
			h.staleSince = since
		}
		h.staleWhy, h.freshSince = why, time.Time{}
	case was:
		if h.freshSince.IsZero() {
			h.freshSince = now
		}
		if now.Sub(h.freshSince) >= freshAfter {
			h.staleSince, h.staleWhy = time.Time{}, ""
			h.recovering = now.Add(grace)
		}
	}
	stale = !h.staleSince.IsZero()
	return stale, stale != was
}

// stale says since when and why the view is stale (zero: fresh).
func (h *viewHealth) stale() (time.Time, string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.staleSince, h.staleWhy
}

// until says until when node drift is held back (zero or past:
// not recovering).
func (h *viewHealth) until() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.recovering
}
