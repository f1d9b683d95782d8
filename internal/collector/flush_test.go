package collector_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// ctTable stands in for the kernel's table: it records what it was asked
// to delete (the real deletion is TestConntrackFlushOnRealFlows's).
type ctTable struct {
	mu    sync.Mutex
	asked [][]conntrack.FlushTarget
	keys  []audit.FrontendKey // of the last read
}

func (c *ctTable) Read(_ context.Context, keys []audit.FrontendKey) (*audit.Conntrack, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.keys = keys
	return &audit.Conntrack{Families: []int{4}}, nil
}

func (c *ctTable) Delete(_ context.Context, ts []conntrack.FlushTarget) ([]int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.asked = append(c.asked, ts)
	out := make([]int, len(ts))
	for i := range out {
		out[i] = 7
	}
	return out, nil
}

// The collector decides what it deletes, whatever the aggregator asks: an
// aggregator that is wrong or compromised can have flows deleted only to
// destinations the node's own rules no longer send the frontend to, and
// only on a collector whose operator turned deletion on.
func TestFlushRefusesWhatTheRulesServe(t *testing.T) {
	rules := synthRules(t, 4)
	served := rules.Frontends[0]
	live := served.Endpoints[0].Addr.String()
	fe := stream.KeyString(served.FrontendKey)
	for _, on := range []bool{false, true} {
		t.Run(fmt.Sprintf("deletion on %v", on), func(t *testing.T) {
			table := &ctTable{}
			conn := flushingCollector(t, rules, table, on)
			ask := func(pairs ...stream.FlushPair) *stream.Flushed { return askFlush(t, conn, pairs) }
			got := ask(
				stream.FlushPair{Frontend: fe, Dest: live, TCP: true},                  // served by the rules
				stream.FlushPair{Frontend: "198.51.100.1:53/UDP", Dest: "10.0.0.1:53"}, // not the node's
				stream.FlushPair{Frontend: fe, Dest: "198.18.250.250:9", TCP: true},    // gone
			)
			if !on {
				if !strings.Contains(got.Error, "--conntrack-delete") || len(got.Results) != 0 || len(table.asked) != 0 {
					t.Fatalf("deletion off: %+v, deleted %v", got, table.asked)
				}
				return
			}
			if got.Error != "" || len(got.Results) != 3 ||
				!strings.Contains(got.Results[0].Refused, "still send") || got.Results[0].Deleted != 0 ||
				!strings.Contains(got.Results[1].Refused, "not a frontend") ||
				got.Results[2].Refused != "" || got.Results[2].Deleted != 7 {
				t.Fatalf("answer %+v", got)
			}
			table.mu.Lock()
			asked := fmt.Sprint(table.asked)
			table.mu.Unlock()
			if want := fmt.Sprint([][]conntrack.FlushTarget{{{Frontend: served.FrontendKey, Dest: mustAddrPort(t, "198.18.250.250:9"), TCP: true}}}); asked != want {
				t.Fatalf("deleted %s, want %s", asked, want)
			}
			// Garbage and floods are refused whole, and the stream lives on.
			for _, bad := range [][]stream.FlushPair{
				{{Frontend: "<script>", Dest: "x"}},
				{{Frontend: fe, Dest: "not an address"}},
				make([]stream.FlushPair, stream.MaxFlushPairs+1),
				nil,
			} {
				if got := ask(bad...); !strings.Contains(got.Error, "invalid flush") && !strings.Contains(got.Error, "pairs") {
					t.Errorf("%d pairs: %+v", len(bad), got)
				}
			}
			if got := ask(stream.FlushPair{Frontend: fe, Dest: "198.18.250.250:9"}); got.Error != "" || got.Results[0].Deleted != 7 {
				t.Errorf("after the garbage: %+v", got)
			}
		})
	}
}

func mustAddrPort(t *testing.T, s string) netip.AddrPort {
	t.Helper()
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		t.Fatal(err)
	}
	return ap
}

// A service left with no endpoints leaves the node's NAT rules (kube-proxy
// rejects it in the filter table) while kube-proxy leaves its UDP entries
// DNATed to the gone pods: the collector keeps counting the flows of a
// frontend that left its rules, and may flush them, as its rules send it
// nowhere now.
func TestFlushOfAFrontendThatLeftTheRules(t *testing.T) {
	all := synthRules(t, 4)
	gone := all.Frontends[0]
	var left atomic.Bool
	table := &ctTable{}
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: 50 * time.Millisecond,
		Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) {
			o := synthRules(t, 4)
			if left.Load() {
				o.Frontends = o.Frontends[1:]
			}
			return o, nil
		}},
		Conntrack: table, ConntrackInterval: 50 * time.Millisecond, ConntrackDelete: true})
	counted := func() bool {
		table.mu.Lock()
		defer table.mu.Unlock()
		for _, k := range table.keys {
			if k == gone.FrontendKey {
				return true
			}
		}
		return false
	}
	pairs := []stream.FlushPair{
		{Frontend: stream.KeyString(gone.FrontendKey), Dest: gone.Endpoints[0].Addr.String()},
		{Frontend: "198.51.100.9:53/UDP", Dest: "198.18.1.1:53"},
	}
	ask := func() []stream.FlushResult {
		got := askFlush(t, conn, pairs)
		if got.Error != "" || len(got.Results) != 2 || !strings.Contains(got.Results[1].Refused, "not a frontend") {
			t.Fatalf("answer %+v", got)
		}
		return got.Results
	}
	nextReport(t, conn, 5*time.Second)
	if r := ask(); !strings.Contains(r[0].Refused, "still send") {
		t.Fatalf("while the rules serve it: %+v", r)
	}
	left.Store(true)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if r := ask(); r[0].Deleted == 7 && r[0].Refused == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a frontend that left the rules is never flushed")
		}
	}
	if !counted() {
		t.Fatalf("the flows of %v, which left the rules, are no longer counted", gone.FrontendKey)
	}
}

// askFlush sends the collector on conn a flush of pairs and returns its
// answer, skipping the reports that come meanwhile.
func askFlush(t *testing.T, conn net.Conn, pairs []stream.FlushPair) *stream.Flushed {
	t.Helper()
	const id = 9
	stream.Write(conn, &stream.Message{Type: stream.TypeFlush, Flush: &stream.Flush{ID: id, Pairs: pairs}})
	for {
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		m, _, err := stream.Read(conn, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if m.Type == stream.TypeFlushed {
			if m.Flushed == nil || m.Flushed.ID != id {
				t.Fatalf("answer %+v", m.Flushed)
			}
			return m.Flushed
		}
	}
}

// A node port's flows are those to any of the node's addresses on its
// port — except those to a frontend of its own there (an external IP that
// is the node's address), which kube-proxy matches first. A compromised
// aggregator naming the node port with the other service's live endpoint
// must not get that service's flows deleted: the target the collector
// hands the kernel reader carries the rules' own frontends, and the reader
// spares their flows (TestConntrackFlushOnRealFlows, on a real kernel).
func TestFlushOfANodePortSparesExplicitFrontends(t *testing.T) {
	rules := synthRules(t, 2)
	np := audit.NodePortKey(4, "UDP", 30053)
	ext := audit.FrontendKey{IP: netip.MustParseAddr("198.18.77.1"), Protocol: "UDP", Port: 30053}
	rules.Frontends = append(rules.Frontends,
		audit.ObservedFrontend{FrontendKey: np, Scope: audit.ScopeCluster, Endpoints: []audit.Endpoint{{Addr: netip.MustParseAddrPort("198.18.77.3:5353")}}},
		audit.ObservedFrontend{FrontendKey: ext, Scope: audit.ScopeCluster, Endpoints: []audit.Endpoint{{Addr: netip.MustParseAddrPort("198.18.77.2:5353")}}})
	table := &ctTable{}
	conn := flushingCollector(t, rules, table, true)
	got := askFlush(t, conn, []stream.FlushPair{{Frontend: stream.KeyString(np), Dest: "198.18.77.2:5353"}})
	if got.Error != "" || len(got.Results) != 1 || got.Results[0].Refused != "" {
		t.Fatalf("answer %+v", got)
	}
	table.mu.Lock()
	defer table.mu.Unlock()
	if len(table.asked) != 1 || len(table.asked[0]) != 1 || !table.asked[0][0].Explicit[ext] || table.asked[0][0].Explicit[np] {
		t.Fatalf("the node port's target %+v: want the rules' other frontends (%v) spared", table.asked, ext)
	}
}

// flushingCollector runs a collector reading rules, with table as its
// conntrack table (deletion on or off), connected to a stand-in
// aggregator whose end it returns after the first report; all of it ends
// with the test.
func flushingCollector(t *testing.T, rules *audit.Observed, table *ctTable, deletion bool) net.Conn {
	t.Helper()
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: time.Hour,
		Reader:    &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules, nil }},
		Conntrack: table, ConntrackInterval: time.Hour, ConntrackDelete: deletion})
	nextReport(t, conn, 5*time.Second)
	return conn
}

// runCollector runs a collector of cfg against an aggregator's listener
// for at most 30 s and returns that aggregator's end once welcomed, and
// stop, which ends the collector and waits for it (at the test's end at
// the latest).
func runCollector(t *testing.T, cfg collector.Config) (net.Conn, func()) {
	t.Helper()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	cfg.Aggregator = ln.Addr().String()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	done := make(chan struct{})
	go func() {
		defer close(done)
		collector.Run(ctx, cfg)
	}()
	var conn net.Conn
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			<-done
			ln.Close()
			if conn != nil {
				conn.Close()
			}
		})
	}
	t.Cleanup(stop)
	conn = welcome(t, ln)
	return conn, stop
}

// datedTable is a conntrack table whose pairs' last packets are dated.
type datedTable struct {
	ctTable
	flows []audit.ConntrackFlows
}

func (d *datedTable) Read(context.Context, []audit.FrontendKey) (*audit.Conntrack, error) {
	return &audit.Conntrack{Families: []int{4}, Flows: d.flows, Entries: len(d.flows)}, nil
}

// The last packet of a pair goes to the aggregator only for destinations
// the node's rules no longer send the frontend to: to one they still
// send it to, new flows keep coming (and a stuck kube-proxy's stale
// destination is judged as before, by its flows alone).
func TestConntrackLastPacketOnlyOffTheRules(t *testing.T) {
	rules := synthRules(t, 4)
	served := rules.Frontends[0]
	at := time.Unix(1_800_000_000, 0)
	table := &datedTable{flows: []audit.ConntrackFlows{
		{Frontend: served.FrontendKey, Dest: served.Endpoints[0].Addr, UDP: 1, Active: at},
		{Frontend: served.FrontendKey, Dest: mustAddrPort(t, "198.18.250.250:9"), UDP: 1, Active: at},
	}}
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: time.Hour,
		Reader:    &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules, nil }},
		Conntrack: table, ConntrackInterval: time.Hour})
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(conn, 1<<20)
	if err != nil || m.Type != stream.TypeReport || m.Report.Conntrack == nil {
		t.Fatalf("want a report with conntrack counts: %+v %v", m, err)
	}
	for _, p := range m.Report.Conntrack.Pairs {
		off := p.Dest == "198.18.250.250:9"
		if got := p.Active != 0; got != off {
			t.Errorf("pair to %s: last packet sent %v, want %v", p.Dest, got, off)
		}
	}
}

// A pair off the rules whose last packet came before the previous read
// (and its rounding) is Quiet: its flows only count down (packets sent
// through a gone pod during a fault stop when the fault is healed, their
// TCP entries live on for two minutes). One still carrying packets is
// not; one the rules still serve carries no date at all.
func TestConntrackQuietWhenPacketsStop(t *testing.T) {
	rules := synthRules(t, 4)
	served := rules.Frontends[0]
	now := time.Now()
	table := &datedTable{flows: []audit.ConntrackFlows{
		{Frontend: served.FrontendKey, Dest: served.Endpoints[0].Addr, UDP: 1, Active: now.Add(-time.Hour)},
		{Frontend: served.FrontendKey, Dest: mustAddrPort(t, "198.18.250.250:9"), UDP: 1, Active: now.Add(time.Minute)},
		{Frontend: served.FrontendKey, Dest: mustAddrPort(t, "198.18.250.251:9"), TCP: map[string]int{"SYN_SENT": 2}, Active: now.Add(-time.Minute)},
	}}
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: time.Hour,
		Reader:    &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules, nil }},
		Conntrack: table, ConntrackInterval: 20 * time.Second})
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(conn, 1<<20)
	if err != nil || m.Type != stream.TypeReport || m.Report.Conntrack == nil {
		t.Fatalf("want a report with conntrack counts: %+v %v", m, err)
	}
	want := map[string][2]bool{ // dated, quiet
		served.Endpoints[0].Addr.String(): {false, false},
		"198.18.250.250:9":                {true, false},
		"198.18.250.251:9":                {true, true},
	}
	for _, p := range m.Report.Conntrack.Pairs {
		if got := [2]bool{p.Active != 0, p.Quiet}; got != want[p.Dest] {
			t.Errorf("pair to %s: dated, quiet %v, want %v", p.Dest, got, want[p.Dest])
		}
	}
	ct, err := m.Report.Conntrack.Model()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range ct.Flows {
		if f.Quiet != want[f.Dest.String()][1] {
			t.Errorf("model of the pair to %s: quiet %v", f.Dest, f.Quiet)
		}
	}
}

// kube-proxy takes a pod out of the rules between two conntrack reads (a
// rollout): the next report carries the pair's last packet, read before,
// with the rules that show it left. Sent undated until the next conntrack
// read, each lookup answered by the old pod was judged StaleConntrack on
// every node of a CoreDNS rollout.
func TestConntrackLastPacketFollowsTheRules(t *testing.T) {
	before := synthRules(t, 4)
	served := before.Frontends[0]
	after := synthRules(t, 4)
	after.Frontends[0].Endpoints = after.Frontends[0].Endpoints[1:]
	scaledDown := before.Frontends[1] // a service scaled to zero leaves the NAT rules whole
	for i, f := range after.Frontends {
		if f.FrontendKey == scaledDown.FrontendKey {
			after.Frontends = append(after.Frontends[:i], after.Frontends[i+1:]...)
			break
		}
	}
	var rules atomic.Pointer[audit.Observed]
	rules.Store(before)
	at := time.Unix(1_800_000_000, 0)
	table := &datedTable{flows: []audit.ConntrackFlows{{Frontend: served.FrontendKey, Dest: served.Endpoints[0].Addr, UDP: 60, Active: at},
		{Frontend: scaledDown.FrontendKey, Dest: scaledDown.Endpoints[0].Addr, UDP: 1, Active: at}}}
	conn, _ := runCollector(t, collector.Config{Node: "n1", Interval: time.Hour,
		Reader:    &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules.Load(), nil }},
		Conntrack: table, ConntrackInterval: time.Hour})
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(conn, 1<<20)
	if err != nil || m.Type != stream.TypeReport || m.Report.Conntrack == nil || len(m.Report.Conntrack.Pairs) != 2 {
		t.Fatalf("want a report with two pairs' counts: %+v %v", m, err)
	}
	for _, p := range m.Report.Conntrack.Pairs {
		if p.Active != 0 {
			t.Fatalf("the rules still send %s to %s, yet its last packet was sent (%d)", p.Frontend, p.Dest, p.Active)
		}
	}
	rules.Store(after)
	stream.Write(conn, &stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "test"}})
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		m, _, err := stream.Read(conn, 1<<20)
		if err != nil {
			t.Fatalf("no report with the pair's last packet after the endpoint left the rules: %v", err)
		}
		if m.Type != stream.TypeReport || m.Report.Conntrack == nil {
			continue
		}
		if p := m.Report.Conntrack.Pairs; len(p) != 2 || p[0].Active != at.Unix() || p[1].Active != at.Unix() {
			t.Fatalf("after an endpoint and a whole service left the rules: %+v, want both pairs' last packet %d", p, at.Unix())
		}
		return
	}
}
