package collector

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// BenchmarkConntrackKeys is what a conntrack read's frontend bookkeeping
// costs at 10k services (30k frontends), side by side: the rules
// unchanged (no write), and one service gone since the last read, which
// writes the conntrack file (--conntrack-file) on top.
func BenchmarkConntrackKeys(b *testing.B) {
	obs, err := synth.Spec{Services: 10_000, EndpointsPerService: 10}.Observed()
	if err != nil {
		b.Fatal(err)
	}
	all := stream.FromModel(obs)
	obs.Frontends = obs.Frontends[1:]
	less := stream.FromModel(obs)
	for _, tc := range []struct {
		name string
		file bool
		flip bool
	}{{"unchanged", true, false}, {"changed/no-file", false, true}, {"changed/file", true, true}} {
		b.Run(tc.name, func(b *testing.B) {
			c := &client{cfg: Config{Log: zap.NewNop()}, cached: all}
			if tc.file {
				c.cfg.ConntrackFile = filepath.Join(b.TempDir(), "conntrack.json")
			}
			now := time.Now()
			c.conntrackKeys(now)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				if tc.flip {
					c.cached = map[bool]*stream.State{true: less, false: all}[i%2 == 0]
				}
				c.conntrackKeys(now)
			}
			if st, err := os.Stat(c.cfg.ConntrackFile); tc.file && err == nil {
				b.ReportMetric(float64(st.Size()), "file-bytes")
				b.ReportMetric(float64(len(c.ctKeys)), "frontends")
			}
		})
	}
}

// noConntrack is a conntrack source that is never read.
type noConntrack struct{}

func (noConntrack) Read(context.Context, []audit.FrontendKey) (*audit.Conntrack, error) {
	return nil, nil
}

// BenchmarkLeftRules is what remembering the frontends a rules read took
// out costs at 10k services (30k frontends), beside what a whole read
// already spends turning its model into the state (stream.FromModel):
// after a whole read (every frontend looked up in the new state), after a
// read of changes (the removed keys only).
func BenchmarkLeftRules(b *testing.B) {
	obs, err := synth.Spec{Services: 10_000, EndpointsPerService: 10}.Observed()
	if err != nil {
		b.Fatal(err)
	}
	all := stream.FromModel(obs)
	gone := obs.Frontends[0].FrontendKey
	less := *obs
	less.Frontends = obs.Frontends[1:]
	lessState := stream.FromModel(&less)
	b.Run("FromModel", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			stream.FromModel(obs)
		}
	})
	for _, tc := range []struct {
		name    string
		changes *audit.Changes
	}{{"whole", nil}, {"changes", &audit.Changes{Removed: []audit.FrontendKey{gone}}}} {
		b.Run("leftRules/"+tc.name, func(b *testing.B) {
			c := &client{cfg: Config{Log: zap.NewNop(), Conntrack: noConntrack{}, Clock: clock.RealClock{}}, cached: lessState}
			b.ReportAllocs()
			for b.Loop() {
				c.ctGone = nil
				c.leftRules(all, tc.changes)
			}
			if len(c.ctGone) != 1 {
				b.Fatalf("remembered %d frontends, want the one gone", len(c.ctGone))
			}
		})
	}
}
