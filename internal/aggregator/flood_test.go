package aggregator

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// TestMadeUpTypesMakeNoSeries: a peer without credentials sending
// messages of made-up types cannot grow /metrics (2,000 such connections
// made 2,001 series and a 15 MB /metrics when the type was the label).
func TestMadeUpTypesMakeNoSeries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, tokens)
		before := testutil.CollectAndCount(h.agg.cfg.Metrics.StreamMessages)
		for i := range 50 {
			c := h.dial("")
			stream.Write(c, &stream.Message{Type: fmt.Sprintf("made-up-%d", i)})
			expect(t, c, stream.TypeReject, "must be a hello")
			c.Close()
		}
		// in/unknown and out/reject at most.
		if after := testutil.CollectAndCount(h.agg.cfg.Metrics.StreamMessages); after > before+2 {
			t.Errorf("50 made-up message types grew proxyaudit_stream_messages_total from %d to %d series", before, after)
		}
		if got := testutil.ToFloat64(h.agg.cfg.Metrics.StreamMessages.WithLabelValues("in", "unknown")); got != 50 {
			t.Errorf("in/unknown = %v, want 50", got)
		}
	})
}

// TestUnauthenticatedConnectionsAreCapped: connections that say nothing
// are held within the per-source and overall limits; the ones beyond are
// closed unread and counted; a collector is admitted again once the
// silent ones go.
func TestUnauthenticatedConnectionsAreCapped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, tokens)
		limits := func(max, perSource int) {
			h.agg.unauth.mu.Lock()
			h.agg.unauth.max, h.agg.unauth.perSource = max, perSource
			h.agg.unauth.mu.Unlock()
		}
		limits(4096, 5)
		var silent []net.Conn
		for range 5 {
			silent = append(silent, h.dial(""))
		}
		h.eventually(5*time.Second, "five silent connections admitted", func() bool {
			h.agg.unauth.mu.Lock()
			defer h.agg.unauth.mu.Unlock()
			return h.agg.unauth.n == 5
		})
		limited := func() float64 {
			return testutil.ToFloat64(h.agg.cfg.Metrics.StreamRejected.WithLabelValues(string(ReasonUnauthenticatedLimit)))
		}
		// The sixth from the same address is closed before its hello is read.
		if err := closedUnread(h, "n1"); err != nil {
			t.Fatalf("a connection beyond the per-source limit was served: %v", err)
		}
		if limited() != 1 {
			t.Errorf("unauthenticated_limit = %v", limited())
		}
		// An authenticated stream does not count against the limit.
		for _, s := range silent {
			s.Close()
		}
		h.eventually(5*time.Second, "silent connections gone", func() bool {
			h.agg.unauth.mu.Lock()
			defer h.agg.unauth.mu.Unlock()
			return h.agg.unauth.n == 0
		})
		ok := h.dial("n1")
		expect(t, ok, stream.TypeWelcome, "")
		for range 5 {
			h.dial("")
		}
		h.eventually(5*time.Second, "five more silent connections beside the stream", func() bool {
			h.agg.unauth.mu.Lock()
			defer h.agg.unauth.mu.Unlock()
			return h.agg.unauth.n == 5
		})
		// The overall limit holds across sources too.
		limits(5, 64)
		if err := closedUnread(h, "n2"); err != nil {
			t.Fatalf("a connection beyond the overall limit was served: %v", err)
		}
		if limited() != 2 {
			t.Errorf("unauthenticated_limit = %v", limited())
		}
	})
}

// closedUnread dials, says hello as node, and reports an error unless the
// aggregator closed the connection without answering. The close may come
// before the hello is written (the write is refused, as TCP may refuse it
// with a reset) or after (the read ends); either is the limit at work, and
// which one wins is the scheduler's choice, not the aggregator's.
func closedUnread(h *harness, node string) error {
	c := h.dial("")
	hello := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, Token: "t-" + node, IntervalSeconds: 1}}
	if err := stream.Write(c, hello); err != nil {
		return nil
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	m, _, err := stream.Read(c, 1<<20)
	switch {
	case err == nil:
		return fmt.Errorf("answered with %s", m.Type)
	case strings.Contains(err.Error(), "timeout"):
		return fmt.Errorf("held open: %w", err)
	}
	return nil
}

// TestNodeFactsAreValidated: a report's mode and families are checked at
// the stream boundary, and a read error is cleaned before anyone sees it.
func TestNodeFactsAreValidated(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, tokens)
		c := h.dial("n1")
		expect(t, c, stream.TypeWelcome, "")
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: 1, Mode: "iptables", ReadError: "\x1b[2J" + strings.Repeat("x", 4000)}})
		stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: 2, Full: true, Families: make([]int, 100000)}})
		expect(t, c, stream.TypeReject, "IP families")
		h.until(5*time.Second, "n1's read error in the verdict", func() bool {
			for _, n := range h.verdict().Nodes {
				if n.Node == "n1" && n.ReadError != "" {
					return true
				}
			}
			return false
		})
		seen := false
		for _, n := range h.verdict().Nodes {
			if n.Node == "n1" {
				seen = true
				if n.ReadError == "" || strings.Contains(n.ReadError, "\x1b") || len(n.ReadError) > maxReadError+4 {
					t.Errorf("read error kept raw or lost: %d bytes, %q", len(n.ReadError), n.ReadError[:min(20, len(n.ReadError))])
				}
			}
		}
		if !seen {
			t.Error("n1's read error not recorded")
		}
	})
}

// TestStreamChurnLeaksNothing: streams that come and go every way a
// network and a hostile peer make them — collectors closing mid-stream,
// nodes the cluster does not have, bad tokens, junk, silence, half a
// frame — leave no goroutine behind once gone, and grow /metrics by a
// bounded number of series however many distinct names they made up.
func TestStreamChurnLeaksNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := start(t, 2*time.Second, tokens)
		series := func() int {
			mfs, err := h.agg.cfg.Metrics.Registry.Gather()
			if err != nil {
				t.Fatal(err)
			}
			n := 0
			for _, mf := range mfs {
				n += len(mf.GetMetric())
			}
			return n
		}
		churn := func(from, to int) {
			for i := from; i < to; i++ {
				var c net.Conn
				switch i % 6 {
				case 0: // a collector that reports, then goes
					c = h.dial(fmt.Sprintf("n%d", 1+i%3))
					expect(t, c, stream.TypeWelcome, "")
					stream.Write(c, &stream.Message{Type: stream.TypeReport, Report: &stream.Report{Seq: 1, Full: true, Mode: "iptables", Families: []int{4}}})
				case 1: // a node the cluster does not have, with a good token
					c = h.dial(fmt.Sprintf("ghost-%d", i))
					expect(t, c, stream.TypeWelcome, "")
				case 2: // someone else's token
					c = h.dial("")
					stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: fmt.Sprintf("n%d", 1+i%3), Token: "t-other"}})
					expect(t, c, stream.TypeReject, "")
				case 3: // junk
					c = h.dial("")
					c.Write([]byte(strings.Repeat("\xff", 64)))
				case 4: // silence
					c = h.dial("")
				case 5: // half a frame header
					c = h.dial("")
					c.Write([]byte{0, 0})
				}
				c.Close()
			}
		}
		// One round first: whatever starts once (and stays) has started.
		churn(0, 6)
		settle := func() {
			h.until(20*time.Second, "every churned stream gone and its node forgotten", func() bool {
				h.agg.mu.Lock()
				defer h.agg.mu.Unlock()
				h.agg.unauth.mu.Lock()
				defer h.agg.unauth.mu.Unlock()
				for name, n := range h.agg.fleet.nodes {
					if n.conn != nil || strings.HasPrefix(name, "ghost-") {
						return false
					}
				}
				return h.agg.unauth.n == 0
			})
		}
		settle()
		before, baseline := series(), goleak.IgnoreCurrent()
		churn(6, 606)
		settle()
		if err := goleak.Find(baseline); err != nil {
			t.Errorf("600 churned streams left goroutines behind: %v", err)
		}
		if after := series(); after > before+10 {
			t.Errorf("600 churned streams (100 made-up node names) grew /metrics from %d to %d series", before, after)
		} else {
			t.Logf("/metrics: %d series before 600 churned streams, %d after", before, after)
		}
	})
}

// TestBehindLeaderLeavesBytesInSockets: while the decode budget is spent
// (the leader is behind), a report's body stays in the connection, not
// in the leader's heap: the sender's write does not complete until the
// budget frees. A hello is not budgeted (an unauthenticated peer must not
// be able to hold the budget), so it is read at once.
func TestBehindLeaderLeavesBytesInSockets(t *testing.T) {
	a := New(Config{DecodeBudget: 1 << 20}, &view.View{})
	frame := func(size int) (hdr, body []byte) {
		body = []byte(`{"type":"report","report":{"seq":1,"root":1,"removed":["` + strings.Repeat("x", size) + `"]}}`)
		return binary.BigEndian.AppendUint32(nil, uint32(len(body))), body
	}
	// Everything: the leader is behind.
	held := 1 << 20
	_ = a.budget.all.Acquire(context.Background(), int64(held))
	defer func() { a.budget.all.Release(int64(held)) }()
	server, client := net.Pipe()
	defer client.Close()
	done := make(chan error, 1)
	alive := make(chan struct{}, 1)
	go func() {
		_, _, release, err := a.read(&conn{Conn: server}, 1<<20, true, func() { alive <- struct{}{} }, nil)
		release()
		done <- err
	}()
	hdr, body := frame(100 << 10)
	if _, err := client.Write(hdr); err != nil {
		t.Fatal(err)
	}
	client.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
	n, err := client.Write(body)
	if err == nil || n == len(body) {
		t.Fatalf("the report's body was read (%d of %d bytes) while the budget was spent", n, len(body))
	}
	select {
	case <-alive: // its sender is alive, though its report waits
	default:
		t.Error("a report waiting for the budget did not count as its collector heard from")
	}
	if w := testutil.ToFloat64(a.cfg.Metrics.ReportsWaiting); w != 1 {
		t.Errorf("proxyaudit_stream_reports_waiting = %v, want 1", w)
	}
	a.budget.all.Release(int64(held))
	held = 0
	client.SetWriteDeadline(time.Time{})
	go client.Write(body[n:]) // what the first write left
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the report, read once the budget freed: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the report was not read once the budget freed")
	}

	// A hello is read whatever the budget.
	held = 1 << 20
	_ = a.budget.all.Acquire(context.Background(), int64(held))
	server2, client2 := net.Pipe()
	defer client2.Close()
	go func() {
		_, _, release, err := a.read(&conn{Conn: server2}, maxHelloBytes, false, nil, nil)
		release()
		done <- err
	}()
	hdr, body = frame(30 << 10)
	client2.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := client2.Write(append(hdr, body...)); err != nil {
		t.Fatalf("a hello waited for the decode budget: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// A peer that claims a huge frame and then trickles it held its share of
// the decode budget for as long as the read deadline its own declared
// interval set (up to 30 minutes: eight such peers held all 64 MiB). Once
// a frame holds its share, its body must arrive at the aggregator's pace
// (bodyDeadline); a trickler is cut and its share given back.
func TestTricklingFrameGivesBackItsBudget(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		defer func(r int, s time.Duration) { bodyRate, bodySlack = r, s }(bodyRate, bodySlack)
		bodyRate, bodySlack = 64<<20, 300*time.Millisecond // a 16 MiB frame: 550 ms
		const budget = 64 << 20
		a := New(Config{DecodeBudget: budget}, &view.View{})
		server, client := net.Pipe()
		defer client.Close()
		done := make(chan error, 1)
		go func() {
			_, _, release, err := a.read(&conn{Conn: server}, 16<<20, true, nil, nil)
			release()
			done <- err
		}()
		if _, err := client.Write(binary.BigEndian.AppendUint32(nil, 16<<20)); err != nil {
			t.Fatal(err)
		}
		stop := make(chan struct{})
		var trickler sync.WaitGroup
		defer func() { close(stop); trickler.Wait() }()
		trickler.Go(func() { // a byte every 100 ms of the bubble's time
			for range 100 {
				if _, err := client.Write([]byte("{")); err != nil {
					return
				}
				select {
				case <-stop:
					return
				case <-time.After(100 * time.Millisecond):
				}
			}
		})
		select {
		case err := <-done:
			if err == nil {
				t.Fatal("a trickled 16 MiB frame was read")
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a peer trickling a 16 MiB frame still held its share of the decode budget after 5 s")
		}
		got := make(chan int, 1)
		go func() { got <- a.budget.Take(budget) }()
		select {
		case n := <-got:
			a.budget.Give(n)
		case <-time.After(time.Second):
			t.Fatal("the trickler's share was not given back")
		}
	})
}

// 64 addresses with no credentials, 64 idle connections each (the
// per-address limit), filled all 4,096 pre-hello slots and every
// collector was refused until they left. Collectors connect from the
// cluster's Node addresses (host network); other sources now share a
// quarter of the slots, so the nodes keep the rest.
func TestPreHelloGateKeepsRoomForNodes(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n1"},
		Status: corev1.NodeStatus{Addresses: []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "198.18.0.10"}, {Type: corev1.NodeHostName, Address: "n1"}}}})
	v := view.New(view.Config{Client: client, Keep: time.Minute})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	defer func() { cancel(); <-done }()
	go func() { v.Run(ctx); close(done) }()
	testkit.Eventually(t, 10*time.Second, "the view synced", func() bool { return v.Synced() == nil })
	if !v.IsNodeAddress("198.18.0.10") || !v.IsNodeAddress("::ffff:198.18.0.10") || v.IsNodeAddress("198.18.0.11") || v.IsNodeAddress("n1") {
		t.Fatal("the Node address index is wrong")
	}
	g := pendingGate{max: 4096, perSource: 64, bySource: map[string]int{}, isNode: func(s string) bool {
		return strings.HasPrefix(s, "198.18.0.") // the fleet's Node addresses
	}}
	admitted := 0
	for a := range 64 {
		for range 64 {
			if _, ok := g.enter(fmt.Sprintf("198.51.100.%d", a)); ok {
				admitted++
			}
		}
	}
	if admitted != 1024 {
		t.Errorf("%d idle connections from 64 foreign addresses admitted, want 1024 (a quarter of the slots)", admitted)
	}
	served := 0
	var leave []func()
	for n := range 10 {
		if l, ok := g.enter(fmt.Sprintf("198.18.0.%d", n+1)); ok {
			served++
			leave = append(leave, l)
		}
	}
	if served != 10 {
		t.Errorf("%d of 10 collectors from Node addresses admitted under the flood", served)
	}
	for _, l := range leave {
		l()
		l() // leaving twice counts once
	}
	if g.n != 1024 || g.others != 1024 {
		t.Errorf("after the collectors left: %d pending, %d foreign", g.n, g.others)
	}
}

// Eight collectors with valid tokens each claim a large frame and trickle
// it, and do it again when cut: they took the whole decode budget (an
// eighth each) and every other node's reports waited the whole time
// (trust review 4, item 9). Large frames share half the budget at most:
// the other nodes' deltas keep arriving throughout.
func TestTricklersLeaveDeltasTheirShare(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const budget = 64 << 20
		a := New(Config{DecodeBudget: budget}, &view.View{})
		stop := make(chan struct{})
		var wg sync.WaitGroup
		defer func() { close(stop); wg.Wait() }()
		for range 8 {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					server, client := net.Pipe()
					go func() {
						_, _, release, _ := a.read(&conn{Conn: server}, 16<<20, true, nil, nil)
						release()
					}()
					client.Write(binary.BigEndian.AppendUint32(nil, 16<<20))
					for i := 0; i < 50; i++ { // a byte every 100 ms, for 5 s
						select {
						case <-stop:
							client.Close()
							return
						case <-time.After(100 * time.Millisecond):
						}
						if _, err := client.Write([]byte("{")); err != nil {
							break
						}
					}
					client.Close()
				}
			})
		}
		time.Sleep(300 * time.Millisecond) // the tricklers hold their shares (the bubble's time)
		body := []byte(`{"type":"report","report":{"seq":1,"root":1,"removed":["` + strings.Repeat("x", 64<<10) + `"]}}`)
		for i := range 20 {
			server, client := net.Pipe()
			done := make(chan error, 1)
			go func() {
				_, _, release, err := a.read(&conn{Conn: server}, 1<<20, true, nil, nil)
				release()
				done <- err
			}()
			go client.Write(append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...))
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("delta %d: %v", i, err)
				}
			case <-time.After(2 * time.Second):
				t.Fatalf("delta %d of another node waited behind eight tricklers", i)
			}
			client.Close()
			time.Sleep(100 * time.Millisecond) // the bubble's time
		}
	})
}
