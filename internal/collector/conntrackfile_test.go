package collector_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// A service scaled to zero leaves the node's NAT rules, and kube-proxy
// leaves its UDP entries pinned to the gone pod (kubernetes#139628). A
// collector restarted then (a chart upgrade, an eviction) must still
// count those flows, and may still flush them: the frontends it counts
// are kept on the node (--conntrack-file), whether the service left the
// rules before the restart or while the collector was down. A file that
// is not what the collector writes is ignored whole; the collector reports
// on as if it had none.
func TestConntrackFrontendsOutliveRestart(t *testing.T) {
	all := synthRules(t, 4)
	gone := all.Frontends[0]
	without := func() (*audit.Observed, error) {
		o := synthRules(t, 4)
		o.Frontends = o.Frontends[1:]
		return o, nil
	}
	with := func() (*audit.Observed, error) { return synthRules(t, 4), nil }
	// run runs a collector on rules until its first conntrack read and
	// says whether it counted gone's flows, and whether it would flush
	// them.
	run := func(t *testing.T, file string, rules func() (*audit.Observed, error), rejected ...audit.FrontendKey) (counted, flushable bool) {
		t.Helper()
		table := &ctTable{}
		conn, stop := runCollector(t, collector.Config{Node: "n1", Interval: time.Hour,
			Reader:    &collectortest.Reader{Rules: rules, Rejected: func() []audit.FrontendKey { return rejected }},
			Conntrack: table, ConntrackInterval: time.Hour, ConntrackDelete: true, ConntrackFile: file})
		defer stop()
		nextReport(t, conn, 5*time.Second)
		table.mu.Lock()
		counted = slices.Contains(table.keys, gone.FrontendKey)
		table.mu.Unlock()
		r := askFlush(t, conn, []stream.FlushPair{{Frontend: stream.KeyString(gone.FrontendKey), Dest: "198.18.250.250:9"}})
		return counted, r.Error == "" && len(r.Results) == 1 && r.Results[0].Deleted == 7
	}

	t.Run("left before the restart", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "conntrack.json")
		run(t, file, with)
		if c, _ := run(t, file, without); !c {
			t.Fatal("the frontend that left the rules is not counted")
		}
		if c, f := run(t, file, without); !c || !f {
			t.Fatalf("after a restart: counted %v, flushable %v; want both", c, f)
		}
		var kept map[string]any
		if b, err := os.ReadFile(file); err != nil || json.Unmarshal(b, &kept) != nil || !strings.Contains(fmt.Sprint(kept["gone"]), gone.FrontendKey.Wire()) {
			t.Fatalf("the file does not name %s as gone: %v %v", gone.FrontendKey.Wire(), kept, err)
		}
	})
	t.Run("left while the collector was down", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "conntrack.json")
		run(t, file, with)
		if c, f := run(t, file, without); !c || !f {
			t.Fatalf("counted %v, flushable %v; want both", c, f)
		}
	})
	t.Run("without a file the restart forgets", func(t *testing.T) {
		run(t, "", with)
		if c, f := run(t, "", without); c || f {
			t.Fatalf("counted %v, flushable %v without a file: the test shows nothing", c, f)
		}
	})
	// Where the rules name what they reject for having no endpoints
	// (nftables' no-endpoint-services map), a collector that never saw the
	// service with endpoints, and has no file, counts its flows too.
	t.Run("started while the rules reject it, no file", func(t *testing.T) {
		if c, f := run(t, "", without, gone.FrontendKey); !c || !f {
			t.Fatalf("counted %v, flushable %v; want both", c, f)
		}
	})
	t.Run("a day later it is forgotten", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "conntrack.json")
		old := time.Now().Add(-25 * time.Hour).Unix()
		os.WriteFile(file, []byte(fmt.Sprintf(`{"frontends":[],"gone":{%q:%d}}`, gone.FrontendKey.Wire(), old)), 0o600)
		if c, _ := run(t, file, without); c {
			t.Fatal("a frontend gone 25 hours ago is still counted")
		}
	})
	key := gone.FrontendKey.Wire()
	for name, content := range map[string]string{
		"garbage":          "\x00\x01not json",
		"oversized":        fmt.Sprintf(`{"frontends":[%q],"x":"%s"}`, key, strings.Repeat("a", 8<<20)),
		"a bad key":        fmt.Sprintf(`{"frontends":[%q,"<script>"]}`, key),
		"from the future":  fmt.Sprintf(`{"gone":{%q:%d}}`, key, time.Now().Add(time.Hour).Unix()),
		"not an object":    fmt.Sprintf(`[%q]`, key),
		"a number as time": fmt.Sprintf(`{"gone":{%q:"yesterday"}}`, key),
	} {
		t.Run("hostile file: "+name, func(t *testing.T) {
			file := filepath.Join(t.TempDir(), "conntrack.json")
			os.WriteFile(file, []byte(content), 0o600)
			if c, f := run(t, file, without); c || f {
				t.Fatalf("counted %v, flushable %v from a file the collector did not write", c, f)
			}
			if b, _ := os.ReadFile(file); strings.Contains(string(b), "<script>") || len(b) > 1<<20 {
				t.Fatalf("the file was not rewritten: %.100q", b)
			}
		})
	}
	t.Run("unwritable", func(t *testing.T) {
		file := filepath.Join(t.TempDir(), "missing-dir", "conntrack.json")
		run(t, file, with)
		if c, _ := run(t, file, without); c {
			t.Fatal("counted with a file that cannot exist")
		}
	})
}

// A frontend that comes and leaves between two conntrack reads — a node
// port whose one pod went seconds after it came, as the soak made its UDP
// blackhole on kube-proxy 1.37 — was never among a conntrack read's
// frontends: its flows, pinned to the gone pod, must still be counted,
// since the rules read that saw it leave.
func TestConntrackCountsAFrontendThatCameAndWentBetweenReads(t *testing.T) {
	gone := synthRules(t, 4).Frontends[0]
	var reads atomic.Int64
	rules := func() (*audit.Observed, error) {
		o := synthRules(t, 4)
		if reads.Add(1) != 2 { // only the second read shows it
			o.Frontends = o.Frontends[1:]
		}
		return o, nil
	}
	table := &ctTable{}
	// Reads come a second apart (a read starts at least 1 s after the
	// last), conntrack reads 2.5 s apart: the first with the first read,
	// the next after the third.
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: 50 * time.Millisecond,
		Reader: &collectortest.Reader{Rules: rules}, Conntrack: table, ConntrackInterval: 2500 * time.Millisecond})
	counted := func() bool {
		table.mu.Lock()
		defer table.mu.Unlock()
		return slices.Contains(table.keys, gone.FrontendKey)
	}
	for deadline := time.Now().Add(10 * time.Second); !counted(); {
		if time.Now().After(deadline) {
			t.Fatalf("after %d rules reads the conntrack read does not count %s, which one read showed and the next did not", reads.Load(), gone.FrontendKey.Wire())
		}
		nextReport(t, conn, 5*time.Second)
	}
	if reads.Load() < 3 {
		t.Fatalf("counted after %d reads: the test shows nothing", reads.Load())
	}
}
