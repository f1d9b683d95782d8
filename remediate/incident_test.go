package remediate

import (
	"testing"
	"time"
)

func TestIncidentRecord(t *testing.T) {
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	in := Incident{Stage: StageRestarted, Opened: now.Add(-time.Hour), Restarts: []time.Time{now.Add(-time.Hour), now.Add(-time.Minute)}, Cordoned: now}
	out, err := DecodeIncident(in.Encode(), now)
	if err != nil || out.Encode() != in.Encode() {
		t.Fatalf("round trip: %+v, %v; want %+v", out, err, in)
	}
	for _, tc := range []struct{ name, rec, want string }{
		{"a restart from the future is not believed, nor the stage it holds", `{"stage":"restarted","opened":"2099-01-01T00:00:00Z","restarts":["2099-01-01T00:00:00Z"]}`,
			`{"stage":"open","opened":"2026-11-23T12:00:00Z"}`},
		{"a cordon from the future is none", `{"cordoned":"2030-01-01T00:00:00Z"}`, `{}`},
		{"within the clock skew, believed", `{"stage":"restarted","opened":"2026-11-23T12:00:30Z","restarts":["2026-11-23T12:00:30Z"]}`,
			`{"stage":"restarted","opened":"2026-11-23T12:00:30Z","restarts":["2026-11-23T12:00:30Z"]}`},
	} {
		got, err := DecodeIncident(tc.rec, now)
		if err != nil || got.Encode() != tc.want {
			t.Errorf("%s: %s, %v; want %s", tc.name, got.Encode(), err, tc.want)
		}
	}
	for _, bad := range []string{``, `{"stage":"rebooted"}`, `"restarted"`, `{"restarts":"yesterday"}`} {
		if _, err := DecodeIncident(bad, now); err == nil {
			t.Errorf("record %q: no error", bad)
		}
	}
}
