package aggregator

import (
	"testing"
	"time"
)

// TestViewHealthWaitsOutAFlappingWatch: the view is stale from its first
// fault; fresh again only after freshAfter without another (a watch whose
// lists work and watches fail must not page on every relist), and then
// node drift is held back for the recovery grace. Each step says whether
// it changed anything, which is when the aggregator notifies.
func TestViewHealthWaitsOutAFlappingWatch(t *testing.T) {
	const grace = time.Minute
	var h viewHealth
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	steps := []struct {
		now           int
		staleSince    int // -1: the view says fresh
		stale, change bool
	}{
		{0, -1, false, false},
		{1, 1, true, true},   // the first fault
		{2, -1, true, false}, // fresh for 0 s
		{5, -1, true, false}, // 3 s
		{6, 6, true, false},  // a fault again: the count starts over
		{7, -1, true, false},
		{11, -1, true, false}, // 4 s
		{12, -1, false, true}, // 5 s: fresh
		{13, -1, false, false},
	}
	for _, s := range steps {
		var since time.Time
		if s.staleSince >= 0 {
			since = at(s.staleSince)
		}
		stale, changed := h.observe(since, "watch failed", at(s.now), grace)
		if stale != s.stale || changed != s.change {
			t.Fatalf("at %d s: stale %v changed %v, want %v %v", s.now, stale, changed, s.stale, s.change)
		}
		if got, _ := h.stale(); stale && !got.Equal(at(1)) {
			t.Errorf("at %d s: stale since %s, want the first fault's time", s.now, got)
		}
	}
	if got, want := h.until(), at(12).Add(grace); !got.Equal(want) {
		t.Errorf("drift held back until %s, want %s", got, want)
	}
}
