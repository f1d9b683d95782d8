package audit

import (
	"testing"
	"time"
)

// A report with no new read counts still says which collector version
// runs (a roll is watched on quiet and stuck nodes too), and does not
// wipe the counts an earlier report gave.
func TestCollectorVersionWithoutReads(t *testing.T) {
	j := NewJudge(DefaultPolicy())
	t0 := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
	j.Heard("quiet", Heartbeat{At: t0, Interval: time.Second, Cost: &CollectorCost{Version: "v0.1.0"}})
	c := j.Cost("quiet")
	if c == nil || c.Version != "v0.1.0" || c.Reads == nil {
		t.Fatalf("a version alone, first: %+v (want the version and empty counts, not null)", c)
	}
	j.Heard("quiet", Heartbeat{At: t0.Add(time.Second), Interval: time.Second,
		Cost: &CollectorCost{Version: "v0.1.0", Reads: map[string]uint64{"change": 3}, LastReadBytes: 100}})
	j.Heard("quiet", Heartbeat{At: t0.Add(2 * time.Second), Interval: time.Second, Cost: &CollectorCost{Version: "v0.1.1"}})
	c = j.Cost("quiet")
	if c.Version != "v0.1.1" || c.Reads["change"] != 3 || c.LastReadBytes != 100 {
		t.Errorf("after a version alone: %+v, want v0.1.1 with the counts kept (change 3, 100 bytes)", c)
	}
	j.Heard("quiet", Heartbeat{At: t0.Add(3 * time.Second), Interval: time.Second})
	if c := j.Cost("quiet"); c.Version != "v0.1.1" || c.Reads["change"] != 3 {
		t.Errorf("after a report with no cost at all: %+v", c)
	}
}
