package remediate

import (
	"strings"
	"testing"
	"time"
)

func TestWindows(t *testing.T) {
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Fatal(err)
	}
	ws, err := ParseWindows("Mon-Fri 09:00-17:00 Europe/Berlin; Sat 22:00-04:00")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		at   time.Time
		open bool
		next time.Time
	}{
		// Friday 27 Nov 2026 (CET, UTC+1).
		{time.Date(2026, 11, 27, 10, 0, 0, 0, berlin), true, time.Time{}},
		{time.Date(2026, 11, 27, 8, 59, 0, 0, berlin), false, time.Date(2026, 11, 27, 9, 0, 0, 0, berlin)},
		{time.Date(2026, 11, 27, 17, 0, 0, 0, berlin), false, time.Date(2026, 11, 28, 22, 0, 0, 0, time.UTC)},
		// Saturday's window runs past midnight into Sunday (UTC).
		{time.Date(2026, 11, 29, 3, 59, 0, 0, time.UTC), true, time.Time{}},
		{time.Date(2026, 11, 29, 4, 0, 0, 0, time.UTC), false, time.Date(2026, 11, 30, 9, 0, 0, 0, berlin)},
		// Across the spring DST change the window keeps its wall clock.
		{time.Date(2026, 3, 30, 9, 30, 0, 0, berlin), true, time.Time{}},
		{time.Date(2026, 3, 30, 7, 30, 0, 0, time.UTC), true, time.Time{}}, // 09:30 CEST
	} {
		open, next := ws.Open(tc.at)
		if open != tc.open || !next.Equal(tc.next) {
			t.Errorf("%s: open %v next %s; want %v %s", tc.at, open, next, tc.open, tc.next)
		}
	}
	if open, _ := Windows(nil).Open(t0); !open {
		t.Error("no windows: closed")
	}
	for _, bad := range []string{"Mon 9-17", "Funday 09:00-17:00", "Mon-Fri 09:00", "Mon 09:00-17:00 Mars/Olympus", "Mon 25:00-26:00"} {
		if _, err := ParseWindows(bad); err == nil || !strings.Contains(err.Error(), "Mon-Fri 09:00-17:00 Europe/Berlin") {
			t.Errorf("%q: %v", bad, err)
		}
	}
	if ws, _ := ParseWindows(" daily 00:00-24:00 ; "); len(ws) != 1 || ws.String() != "daily 00:00-24:00" {
		t.Errorf("daily: %v", ws)
	}
}

// A pause or a closed window holds every repair (restart, cordon);
// pages, resolutions and uncordons go on, and the page says why and
// when the next window opens.
func TestPlanHolds(t *testing.T) {
	closed, _ := ParseWindows("Sat 02:00-04:00") // t0 is a Saturday at noon
	restartedAgo := func(n Node, d time.Duration) Node {
		n.Incident = Incident{Stage: StageRestarted, Opened: ago(d), Restarts: []time.Time{ago(d)}}
		return n
	}
	for _, tc := range []struct {
		name    string
		windows Windows
		paused  string
		nodes   []Node
		want    string
		says    string
	}{
		{"paused: page only", nil, "by alice (migration) until 2026-11-21T14:00:00Z", append(healthy("a", "b", "c"), drifted("d")),
			"d:Page", "not repaired: remediation paused by alice (migration)"},
		{"outside the windows: page only, and when the next opens", closed, "", append(healthy("a", "b", "c"), drifted("d")),
			"d:Page", "outside the maintenance windows (Sat 02:00-04:00); the next opens at 2026-11-28T02:00:00Z"},
		{"paused: no cordon after a restart that did not help", nil, "by alice", append(healthy("a", "b", "c"), restartedAgo(drifted("d"), 3*time.Minute)),
			"d:Page", "not cordoned: remediation paused by alice"},
		{"paused: an incident that ends still resolves", nil, "by alice", append(healthy("a", "b", "c"), restartedAgo(Node{Name: "d", Healthy: true}, 3*time.Minute)),
			"d:Resolve", "back in sync"},
		{"outside the windows: proxyaudit's own cordon is still undone", closed, "", append(healthy("a", "b", "c"), Node{Name: "d", Healthy: true,
			Incident: Incident{Stage: StageEscalated, Opened: ago(time.Hour), Cordoned: ago(time.Minute)}}), "d:Uncordon", "uncordons"},
		{"inside the windows: repaired", func() Windows { w, _ := ParseWindows("Sat 11:00-13:00"); return w }(), "", append(healthy("a", "b", "c"), drifted("d")),
			"d:RestartProxy", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := policy(RestartAndCordon)
			p.Windows = tc.windows
			got := Plan(t0, p, Fleet{Nodes: tc.nodes, Paused: tc.paused})
			if describe(got) != tc.want || (tc.says != "" && !strings.Contains(got[0].Reason, tc.says)) {
				t.Fatalf("got %s (%v); want %s saying %q", describe(got), got, tc.want, tc.says)
			}
		})
	}
	// The held page is not repeated each round; once the pause lifts,
	// the open incident is repaired.
	p := policy(Restart)
	first := Plan(t0, p, Fleet{Nodes: append(healthy("a", "b", "c"), drifted("d")), Paused: "by alice"})
	d := drifted("d")
	d.Incident = first[0].Incident
	if again := Plan(t0.Add(time.Minute), p, Fleet{Nodes: append(healthy("a", "b", "c"), d), Paused: "by alice"}); len(again) != 0 {
		t.Errorf("paged again while paused: %s", describe(again))
	}
	if resumed := Plan(t0.Add(2*time.Minute), p, Fleet{Nodes: append(healthy("a", "b", "c"), d)}); describe(resumed) != "d:RestartProxy" {
		t.Errorf("after the pause: %s", describe(resumed))
	}
}
