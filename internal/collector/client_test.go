package collector_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

func synthRules(t *testing.T, services int) *audit.Observed {
	t.Helper()
	o, err := synth.Spec{Services: services, EndpointsPerService: 2}.Observed()
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// The protocol as a collector speaks it, against a listener that plays the
// aggregator's part by the book: a follower redirects to the leader; the
// leader gets a full snapshot, then root-only steady reports, a delta when
// the rules change, and a full snapshot again when it asks for a resync.
func TestClientProtocol(t *testing.T) {
	leader, _ := net.Listen("tcp", "127.0.0.1:0")
	follower, _ := net.Listen("tcp", "127.0.0.1:0")
	defer leader.Close()
	defer follower.Close()
	go func() {
		conn, err := follower.Accept()
		if err != nil {
			return
		}
		defer conn.Close()
		if m, _, err := stream.Read(conn, 1<<20); err == nil && m.Type == stream.TypeHello {
			stream.Write(conn, &stream.Message{Type: stream.TypeRedirect, Redirect: &stream.Redirect{Leader: leader.Addr().String()}})
		}
	}()
	var services atomic.Int32
	services.Store(20)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go collector.Run(ctx, collector.Config{
		Node: "n1", Aggregator: follower.Addr().String(), Interval: 50 * time.Millisecond,
		Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return synthRules(t, int(services.Load())), nil }},
	})

	conn, err := leader.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hello, _, err := stream.Read(conn, 1<<20)
	if err != nil || hello.Hello == nil || hello.Hello.Node != "n1" {
		t.Fatalf("hello: %+v %v", hello, err)
	}
	stream.Write(conn, &stream.Message{Type: stream.TypeWelcome})
	agg := stream.NewState()
	next := func() (*stream.Report, int) {
		t.Helper()
		m, n, err := stream.Read(conn, 1<<20)
		if err != nil || m.Report == nil {
			t.Fatalf("report: %+v %v", m, err)
		}
		if ok, err := agg.Apply(m.Report); !ok || err != nil {
			t.Fatalf("report %d does not apply: %v", m.Report.Seq, err)
		}
		return m.Report, n
	}
	if r, _ := next(); !r.Full || len(r.Frontends) != 20 {
		t.Fatalf("first report: full=%v frontends=%d", r.Full, len(r.Frontends))
	}
	r, n := next()
	if r.Full || len(r.Frontends)+len(r.Removed) != 0 {
		t.Fatalf("steady report carried %d frontends", len(r.Frontends))
	}
	t.Logf("steady-state report: %d bytes on the wire", n)
	services.Store(22)
	for r.Full || len(r.Frontends) == 0 {
		r, _ = next()
	}
	if len(r.Frontends) != 2 {
		t.Fatalf("delta carried %d frontends, want the 2 new ones", len(r.Frontends))
	}
	stream.Write(conn, &stream.Message{Type: stream.TypeResync, Resync: &stream.Resync{Reason: "test"}})
	for !r.Full {
		r, _ = next()
	}
	if len(r.Frontends) != 22 {
		t.Fatalf("resync carried %d frontends", len(r.Frontends))
	}
}

// A read-now request is answered with a report at once, but no sooner than
// collector.MinReadGap after the last read began: an aggregator cannot make a node
// read its rules in a loop.
func TestClientReadNow(t *testing.T) {
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln.Close()
	reads := &collectortest.Reader{Rules: func() (*audit.Observed, error) { return synthRules(t, 2), nil }}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go collector.Run(ctx, collector.Config{Node: "n1", Aggregator: ln.Addr().String(), Interval: time.Hour, Reader: reads})
	conn := welcome(t, ln)
	defer conn.Close()
	report := func() time.Time { return nextReport(t, conn, 5*time.Second) }
	first := report()
	for i := 0; i < 5; i++ { // a burst: one read, after the gap
		stream.Write(conn, &stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "test"}})
	}
	second := report()
	if gap := second.Sub(first); gap < collector.MinReadGap-50*time.Millisecond || gap > collector.MinReadGap+2*time.Second {
		t.Errorf("answered %s after the first read; want about %s (the gap), well before the 1 h interval", gap, collector.MinReadGap)
	}
	conn.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	if m, _, err := stream.Read(conn, 1<<20); err == nil {
		t.Errorf("a burst of requests caused more than one read: %+v", m.Type)
	}
	if n := reads.Reads(); n != 2 {
		t.Errorf("%d reads, want 2", n)
	}
}

// Reads that cost CPU are spaced by their cost once the budget's burst is
// spent: with a budget of 5 % of a core and no burst, a read that took
// 100 ms of CPU is followed by the next one 2 s after it began, however
// often the aggregator asks (or kube-proxy commits). Before the budget, a
// node under churn read once a second at whatever a read cost: a quarter
// of a core at the anchors. With the default burst (a minute's budget),
// the next read comes after the 1 s floor. In a bubble, with the read's
// CPU given (CPUTime): the spacing is exact, whatever the machine's load
// (on the machine's time and CPU, under the race detector on a loaded CI
// machine, the floor was once 2.02 s).
func TestClientReadBudget(t *testing.T) {
	t.Run("spent", func(t *testing.T) { clientReadBudget(t, time.Nanosecond, 2*time.Second) })
	t.Run("burst", func(t *testing.T) { clientReadBudget(t, 0, collector.MinReadGap) })
}

func clientReadBudget(t *testing.T, burst, want time.Duration) {
	synctest.Test(t, func(t *testing.T) {
		mn := testkit.NewMemNet()
		ln, err := mn.Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var cpu atomic.Int64 // what the collector's reads spent, in ns
		var mu sync.Mutex
		var began []time.Time
		reads := &collectortest.Reader{Rules: func() (*audit.Observed, error) {
			mu.Lock()
			began = append(began, time.Now())
			mu.Unlock()
			cpu.Add(int64(100 * time.Millisecond))
			return synthRules(t, 2), nil
		}}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		go collector.Run(ctx, collector.Config{Node: "n1", Aggregator: ln.Addr().String(), Interval: time.Hour, Reader: reads, ReadBudget: 0.05, ReadBurst: burst,
			Dial: mn.Dial, CPUTime: func() time.Duration { return time.Duration(cpu.Load()) }})
		conn := welcome(t, ln)
		defer conn.Close()
		report := func() time.Time { return nextReport(t, conn, 10*time.Second) }
		report()
		stream.Write(conn, &stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "test"}})
		report()
		mu.Lock()
		defer mu.Unlock()
		if len(began) != 2 {
			t.Fatalf("%d reads, want 2", len(began))
		}
		// (The burst of 1 ns that stands for none pays 20 ns of the wait.)
		if gap := began[1].Sub(began[0]); gap > want || gap < want-time.Microsecond {
			t.Errorf("a read costing 100 ms of CPU was followed by the next %s after it began; want %s", gap, want)
		}
		cancel()
	})
}

// nextReport reads the next message, which must be a report, and says
// when it came.
func nextReport(t *testing.T, conn net.Conn, within time.Duration) time.Time {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(within))
	m, _, err := stream.Read(conn, 1<<20)
	if err != nil || m.Type != stream.TypeReport {
		t.Fatalf("want a report: %+v %v", m, err)
	}
	return time.Now()
}

func TestReadWait(t *testing.T) {
	for _, tc := range []struct {
		since, budget, interval time.Duration
		want                    time.Duration
	}{
		{0, 0, 10 * time.Second, time.Second},                                                      // the floor
		{400 * time.Millisecond, 0, 10 * time.Second, 600 * time.Millisecond},                      // the rest of it
		{5 * time.Second, 0, 10 * time.Second, 0},                                                  // long past: at once
		{2 * time.Second, 3 * time.Second, 10 * time.Second, 3 * time.Second},                      // the budget's debt
		{2 * time.Second, 30 * time.Second, 10 * time.Second, 8 * time.Second},                     // never beyond the interval
		{200 * time.Millisecond, 30 * time.Second, 500 * time.Millisecond, 800 * time.Millisecond}, // nor below the floor
	} {
		if got := collector.ReadWait(tc.since, tc.budget, tc.interval); got != tc.want {
			t.Errorf("readWait(%s since the last, budget wait %s, interval %s) = %s, want %s", tc.since, tc.budget, tc.interval, got, tc.want)
		}
	}
}

// A frozen kube-proxy holds a metrics scrape for its whole timeout; the
// heartbeats go on at the interval all the same. Before, each heartbeat
// waited for the scrape, and an IPVS node with a 2 s interval looked
// CollectorMissing while its kube-proxy was frozen.
func TestFrozenKubeProxyDoesNotDelayHeartbeats(t *testing.T) {
	frozen := make(chan struct{})
	defer close(frozen)
	metrics := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select { // SIGSTOPped: accepts, never answers
		case <-frozen:
		case <-r.Context().Done():
		}
	}))
	defer metrics.Close()
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	defer ln.Close()
	reads := &collectortest.Reader{Rules: func() (*audit.Observed, error) { return synthRules(t, 2), nil }}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Without a change signal every heartbeat reads, and reads keep
	// MinReadGap apart: an interval above it.
	const interval = collector.MinReadGap + 100*time.Millisecond
	go collector.Run(ctx, collector.Config{Node: "n1", Aggregator: ln.Addr().String(), Interval: interval, Reader: reads, KubeProxyMetrics: metrics.URL})
	conn := welcome(t, ln)
	defer conn.Close()
	var at []time.Time
	for len(at) < 7 {
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		m, _, err := stream.Read(conn, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if m.Type == stream.TypeReport {
			at = append(at, time.Now())
		}
	}
	// The first report waits for one scrape (the first read's); the
	// heartbeats after it follow the interval, not the 3 s timeout.
	for i := 2; i < len(at); i++ {
		if gap := at[i].Sub(at[i-1]); gap > interval+time.Second {
			t.Errorf("report %d came %s after the one before (interval %s): the heartbeat waited for the frozen kube-proxy", i, gap.Round(time.Millisecond), interval)
		}
	}
}

// welcome accepts the collector's stream, reads its hello and welcomes it.
func welcome(t *testing.T, ln net.Listener) net.Conn {
	t.Helper()
	conn, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if m, _, err := stream.Read(conn, 1<<20); err != nil || m.Type != stream.TypeHello {
		conn.Close()
		t.Fatalf("hello: %+v %v", m, err)
	}
	stream.Write(conn, &stream.Message{Type: stream.TypeWelcome})
	return conn
}
