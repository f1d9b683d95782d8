package aggregator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"k8s.io/utils/clock"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"go.uber.org/zap"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/util/validation"
)

type conn struct {
	net.Conn
	wmu sync.Mutex
	// authenticated leaves the count of connections not past their hello.
	authenticated func()
}

// pendingGate counts connections that have not passed their hello, overall and
// by source address: each costs a goroutine and up to a hello's bytes
// before anyone knows who sent it.
type pendingGate struct {
	mu             sync.Mutex
	max, perSource int
	n              int
	bySource       map[string]int
	// isNode says whether a source is an address of a Node of the
	// cluster, where collectors connect from. Other sources (pods, the
	// world) share at most a quarter of max between them: 64 addresses
	// of idle connections filled every slot and locked every collector
	// out. others counts theirs.
	isNode func(string) bool
	others int
}

// enter admits a connection from source unless a limit is reached; the
// returned func leaves (call it once).
func (g *pendingGate) enter(source string) (func(), bool) {
	node := g.isNode != nil && g.isNode(source)
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n >= g.max || g.bySource[source] >= g.perSource || (!node && g.others >= max(1, g.max/4)) {
		return nil, false
	}
	g.n++
	g.bySource[source]++
	if !node {
		g.others++
	}
	return sync.OnceFunc(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.n--
		if !node {
			g.others--
		}
		if g.bySource[source]--; g.bySource[source] <= 0 {
			delete(g.bySource, source)
		}
	}), true
}

func (c *conn) send(m *stream.Message) (int, error) {
	return c.sendNewest(func() *stream.Message { return m })
}

// sendNewest sends the message m returns when this connection's turn to
// write comes: of two sends racing, the later carries the newer message.
func (c *conn) sendNewest(newest func() *stream.Message) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	return c.writeLocked(newest())
}

// writeLocked writes m; the caller holds wmu.
func (c *conn) writeLocked(m *stream.Message) (int, error) {
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	cw := &countingWriter{w: c.Conn}
	err := stream.Write(cw, m)
	return cw.n, err
}

type countingWriter struct {
	w io.Writer
	n int
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += n
	return n, err
}

// redirect tells a collector where the leader is, when another replica
// leads.
func (a *Aggregator) redirect(c *conn, leader string) {
	if leader != "" && leader != a.cfg.Self {
		a.sent(c.send(&stream.Message{Type: stream.TypeRedirect, Redirect: &stream.Redirect{Leader: leader}, Peers: a.knownPeers()}))
		a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeRedirect).Inc()
	}
}

func (a *Aggregator) sent(n int, _ error) {
	a.cfg.Metrics.StreamBytes.WithLabelValues("out").Add(float64(n))
}

// Serve accepts collector streams on ln until ctx ends, then closes them
// and returns once every stream's goroutine has finished.
func (a *Aggregator) Serve(ctx context.Context, ln net.Listener) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		open  = map[*conn]bool{}
		ended bool
	)
	stop := context.AfterFunc(ctx, func() {
		ln.Close()
		mu.Lock()
		ended = true
		for c := range open {
			c.Close()
		}
		mu.Unlock()
	})
	defer stop()
	defer wg.Wait()
	for {
		nc, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("accept collector streams: %w", err)
		}
		source, _, _ := net.SplitHostPort(nc.RemoteAddr().String())
		leave, ok := a.unauth.enter(source)
		if !ok {
			// Nothing is read or written: a flood costs an accept and a close.
			a.cfg.Metrics.StreamRejected.WithLabelValues(string(ReasonUnauthenticatedLimit)).Inc()
			nc.Close()
			continue
		}
		c := &conn{Conn: nc, authenticated: leave}
		mu.Lock()
		if ended {
			mu.Unlock()
			leave()
			nc.Close()
			return nil
		}
		open[c] = true
		wg.Add(1)
		mu.Unlock()
		go func() {
			defer wg.Done()
			defer leave()
			a.handle(ctx, c)
			mu.Lock()
			delete(open, c)
			mu.Unlock()
		}()
	}
}

// reject refuses or ends a stream with a reason the collector logs.
func (a *Aggregator) reject(log *zap.Logger, c *conn, reason RejectReason, why string) {
	a.rejectWith(log, c, reason, &stream.Reject{Reason: why}, nil)
}

// rejectWith sends r, and peers when not nil (the replicas a follower
// knows), and counts it.
func (a *Aggregator) rejectWith(log *zap.Logger, c *conn, reason RejectReason, r *stream.Reject, peers *stream.Peers) {
	if reason == ReasonBusy {
		// Expected by the thousand during a fleet reconnect: counted, not
		// logged one by one.
		log.Debug("collector stream rejected", zap.String("reason", string(reason)), zap.String("why", r.Reason))
	} else {
		log.Warn("collector stream rejected", zap.String("reason", string(reason)), zap.String("why", r.Reason))
	}
	a.cfg.Metrics.StreamRejected.WithLabelValues(string(reason)).Inc()
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeReject).Inc()
	a.sent(c.send(&stream.Message{Type: stream.TypeReject, Reject: r, Peers: peers}))
}

func readReason(err error) RejectReason {
	var ne net.Error
	switch {
	case errors.Is(err, stream.ErrTooLarge):
		return ReasonTooLarge
	case errors.As(err, &ne) && ne.Timeout():
		return ReasonTimeout
	default:
		return ReasonMalformed
	}
}

// read receives one message of at most max bytes. With budgeted, a large
// one is read, decoded and held only within the decode budget; release
// returns its share once the message is applied. A hello is not budgeted:
// an unauthenticated peer trickling one must not hold the budget
// (hellos are small and their connections few, see pendingGate). alive,
// when set, is called once a message has begun to arrive: its sender is
// alive even while its report waits for the budget.
func (a *Aggregator) read(c *conn, max int, budgeted bool, alive func(), ahead *readAhead) (m *stream.Message, n int, release func(), err error) {
	size, err := stream.ReadHeader(c, max)
	if err != nil {
		return nil, size + 4, func() {}, err
	}
	if alive != nil {
		alive()
	}
	n = size + 4
	release = func() {}
	if budgeted && size > smallMessage {
		if ahead != nil {
			// One budgeted frame per stream at a time, read ahead or not.
			select {
			case ahead.held <- struct{}{}:
			case <-ahead.quit:
				return nil, n, release, net.ErrClosed
			}
		}
		// The budget is taken before the body is read: while the leader
		// is behind, the bytes wait in the sockets (the collectors' writes
		// slow down) instead of in its heap. A frame takes at most an
		// eighth of the budget, so a few streams trickling huge frames
		// cannot hold all of it (each is cut at its read deadline).
		a.cfg.Metrics.ReportsWaiting.Inc()
		took := a.budget.Take(min(size, a.cfg.DecodeBudget/8))
		a.cfg.Metrics.ReportsWaiting.Dec()
		// Holding its share, the body must now arrive at the pace the
		// aggregator sets, not within a deadline the collector's own
		// declared interval stretched to half an hour: a peer claiming a
		// huge frame and trickling it held its share that long.
		c.SetReadDeadline(time.Now().Add(bodyDeadline(size)))
		release = func() {
			a.budget.Give(took)
			if ahead != nil {
				<-ahead.held
			}
		}
	}
	body, err := stream.ReadBody(c, size)
	if err != nil {
		release()
		return nil, n, func() {}, err
	}
	if m, err = stream.Decode(body); err != nil {
		release()
		return nil, n, func() {}, err
	}
	a.cfg.Metrics.StreamBytes.WithLabelValues("in").Add(float64(n))
	typ := m.Type
	if !stream.Known(typ) {
		typ = "unknown"
	}
	a.cfg.Metrics.StreamMessages.WithLabelValues("in", typ).Inc()
	return m, n, release, nil
}

// bodyRate and bodySlack bound how long a budgeted frame's body may take
// once its share of the decode budget is held: bodySlack plus its size at
// bodyRate (a 16 MiB snapshot: 26 s; in-cluster links carry it in well
// under a second). Variables for tests.
var (
	bodyRate  = 1 << 20 // bytes a second
	bodySlack = 10 * time.Second
)

func bodyDeadline(size int) time.Duration {
	return bodySlack + time.Duration(size)*time.Second/time.Duration(bodyRate)
}

// readAhead is a stream's reader running ahead of its handling: held
// admits one budgeted frame of the stream at a time (a stream must not
// hold more of the decode budget by reading ahead); quit ends a wait for
// it when the stream is done.
type readAhead struct {
	held chan struct{}
	quit <-chan struct{}
}

// smallMessage: a steady report (a root digest, ~200 bytes) or a small
// delta skips the decode budget; everything larger counts (at 5,000 nodes
// the ~60 KB reports under churn, exempt below 64 KB, took the leader to
// 11 GB while it was behind). maxHelloBytes bounds the one message read
// before a collector is authenticated.
const (
	smallMessage  = 4 << 10
	maxHelloBytes = 64 << 10
)

func (a *Aggregator) handle(ctx context.Context, c *conn) {
	defer c.Close()
	a.cfg.Metrics.Streams.Inc()
	defer a.cfg.Metrics.Streams.Dec()
	log := a.cfg.Log.With(zap.String("remote", c.RemoteAddr().String()))

	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	m, _, release, err := a.read(c, maxHelloBytes, false, nil, nil)
	release()
	if err != nil {
		if !errors.Is(err, io.EOF) {
			a.reject(log, c, readReason(err), "cannot read hello: "+err.Error())
		}
		return
	}
	h := m.Hello
	if m.Type != stream.TypeHello || h == nil {
		a.reject(log, c, ReasonProtocol, fmt.Sprintf("first message must be a hello, got %q", m.Type))
		return
	}
	if errs := validation.IsDNS1123Subdomain(h.Node); len(errs) > 0 {
		a.reject(log, c, ReasonProtocol, fmt.Sprintf("hello names no valid node (%q): %s", clip(h.Node), errs[0]))
		return
	}
	interval := time.Duration(h.IntervalSeconds * float64(time.Second))
	if interval < time.Second || interval > 10*time.Minute {
		a.reject(log, c, ReasonProtocol, fmt.Sprintf("interval %gs out of range (1s to 10m)", h.IntervalSeconds))
		return
	}
	log = log.With(zap.String("node", h.Node))
	// A follower sends the collector on before reviewing anything: a
	// redirect carries nothing secret, and a fleet reconnecting after a
	// leader change must not cost the API server a review at each replica.
	a.mu.Lock()
	leading, leader := a.leading, a.leader
	a.mu.Unlock()
	if !leading {
		if leader == "" || leader == a.cfg.Self {
			// The replicas it knows go with the refusal (see knownPeers).
			a.rejectWith(log, c, ReasonProtocol, &stream.Reject{Reason: "this aggregator is not the leader and no leader is elected yet; retry shortly"}, a.knownPeers())
			return
		}
		a.redirect(c, leader)
		return
	}
	source, _, _ := net.SplitHostPort(c.RemoteAddr().String())
	expires, err := a.cfg.Auth.Authenticate(ctx, Hello{Node: h.Node, Token: h.Token, Source: source})
	if err != nil {
		var busy *BusyError
		switch {
		case errors.As(err, &busy):
			a.rejectWith(log, c, ReasonBusy, &stream.Reject{Reason: err.Error(), RetryAfterSeconds: busy.RetryAfter.Seconds()}, nil)
		case errors.Is(err, ErrBusy):
			a.reject(log, c, ReasonBusy, err.Error())
		default:
			a.reject(log, c, ReasonAuth, err.Error())
		}
		return
	}
	c.authenticated()
	if a.cfg.Insecure {
		log.Warn("accepting an unauthenticated collector stream (--insecure-no-auth): any client can report for any node")
	}

	// The stream's writes are held from its registration to its welcome:
	// once registered, a flush, a read-now or a peers list may be sent on
	// it at any moment, and the collector takes the first message for the
	// answer to its hello. (Writes are never made under a.mu, so taking
	// it while holding wmu cannot deadlock.)
	c.wmu.Lock()
	a.mu.Lock()
	if !a.leading {
		a.mu.Unlock()
		c.wmu.Unlock()
		a.reject(log, c, ReasonProtocol, "this aggregator stopped leading; reconnect to find the leader")
		return
	}
	n := a.nodes[h.Node]
	if n == nil {
		n = &node{name: h.Node}
		a.nodes[h.Node] = n
	}
	if n.conn != nil {
		log.Info("a new stream replaces the node's previous one")
		n.conn.Close()
	}
	n.conn, n.state, n.complete, n.lastSeq, n.before = c, stream.NewPooledState(a.pool), false, 0, nil
	a.mu.Unlock()
	if hook := a.testHookRegistered.Load(); hook != nil {
		(*hook)()
	}
	a.sent(c.writeLocked(&stream.Message{Type: stream.TypeWelcome, Welcome: &stream.Welcome{Refs: true, Tops: true}}))
	c.wmu.Unlock()
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeWelcome).Inc()
	defer a.warmup.done(c, false)
	defer func() {
		a.mu.Lock()
		if n.conn == c {
			n.conn = nil
		}
		a.mu.Unlock()
		a.flushesEnd(c)
	}()

	if a.peersMsg.Load() != nil {
		a.sendPeers(c)
	}
	log.Info("collector stream open", zap.String("version", h.Version), zap.Duration("interval", interval))

	// A collector sends one report per interval plus answers to resyncs.
	limit := rate.NewLimiter(rate.Every(interval/4), 8)
	// w holds a report that named what the aggregator does not hold (its
	// top, buckets or frontends), and the reports that came after it,
	// until the collector sends the next level down.
	var w *waiting
	waited := false // for a cold pool's warm-up (see warmup)
	// settle applies reports in order, parking at the first that needs
	// more of the collector; false when the stream must end. asked is
	// what was wanted of the first.
	settle := func(rs []arrived, asked *waiting) bool {
		for i, r := range rs {
			resumed := asked != nil && i == 0
			ok, reason, why, missing := a.apply(n, c, r.report, r.at, interval, resumed)
			if missing != nil && !missing.Top && !waited && a.warmup.wait(ctx, c, a.cfg.Clock) {
				// Another stream is bringing a cold pool its first state:
				// most of what this one named may come with it. (Once per
				// stream: a stream waits out a warmer that never answers
				// once, not at every level it then asks for.)
				waited = true
				ok, reason, why, missing = a.apply(n, c, r.report, r.at, interval, true)
			}
			if reason != "" {
				a.reject(log, c, reason, why)
				return false
			}
			if missing == nil && ok {
				a.warmup.done(c, true)
			}
			if missing != nil {
				if asked != nil && i == 0 && asked.again(missing) {
					// Asked for and not sent: the collector no longer has it.
					ok, why = false, "the collector could not send what it named"
				} else {
					w = &waiting{report: r, queued: slices.Clone(rs[i+1:])}
					w.ask(r.report.Seq, missing)
					a.countNamed(r.report, missing)
					a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeWant).Inc()
					_, err := c.send(&stream.Message{Type: stream.TypeWant, Want: &w.want})
					return err == nil
				}
			} else {
				a.countNamed(r.report, nil)
			}
			asked = nil
			if !ok {
				a.cfg.Metrics.Resyncs.Inc()
				a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeResync).Inc()
				if _, err := c.send(&stream.Message{Type: stream.TypeResync, Resync: &stream.Resync{Reason: why}}); err != nil {
					return false
				}
			}
		}
		return true
	}
	// Messages are read ahead of their handling, up to maxQueued, so that
	// each is dated when it began to arrive (see arrived) while the
	// stream's goroutine waits: for the content a report named, a cold
	// pool's warm-up, the aggregator's lock. Read in turn, a report that
	// sat in the socket behind a 14 s want cascade was dated 14 s late
	// (5,000 nodes, after a takeover). A message that begins to arrive
	// also proves its collector alive, even while it waits for the decode
	// budget behind a fleet's worth of others: a leader that is behind
	// must not call its fleet missing.
	frames := make(chan frame, maxQueued)
	quit := make(chan struct{})
	ahead := &readAhead{held: make(chan struct{}, 1), quit: quit}
	defer func() {
		close(quit)
		c.Close()
		// The reader may wait for the decode budget a while yet.
		go func() {
			for f := range frames {
				f.release()
			}
		}()
	}()
	go func() {
		defer close(frames)
		for {
			c.SetReadDeadline(time.Now().Add(time.Duration(a.cfg.Policy.MissingIntervals)*interval + 15*time.Second))
			var f frame
			f.m, f.size, f.release, f.err = a.read(c, a.cfg.MaxMessageBytes, true, func() {
				f.at = a.cfg.Clock.Now()
				a.mu.Lock()
				a.judge.Alive(n.name, f.at)
				a.mu.Unlock()
			}, ahead)
			select {
			case frames <- f:
			case <-quit:
				f.release()
				return
			}
			if f.err != nil {
				return
			}
		}
	}()
	for {
		f := <-frames
		m, size, release, err, began := f.m, f.size, f.release, f.err, f.at
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				log.Info("collector stream closed")
			} else {
				a.reject(log, c, readReason(err), err.Error())
			}
			return
		}
		if m.Type == stream.TypeAuth && m.Auth != nil {
			release()
			// The kubelet rotated the collector's token: the stream lives on
			// with the new one, still bound to this node.
			renewed, err := a.cfg.Auth.Authenticate(ctx, Hello{Node: h.Node, Token: m.Auth.Token, Source: source})
			if err != nil {
				a.reject(log, c, ReasonAuth, "renewing the stream's token: "+err.Error())
				return
			}
			expires = renewed
			continue
		}
		if !expires.IsZero() && a.cfg.Clock.Now().After(expires) {
			release()
			a.reject(log, c, ReasonAuth, fmt.Sprintf("the stream's token expired at %s and was not renewed: reconnect with the current one", expires.UTC().Format(time.RFC3339)))
			return
		}
		if m.Type == stream.TypeContent && m.Content != nil {
			if w == nil {
				release()
				a.reject(log, c, ReasonProtocol, "content nobody asked for")
				return
			}
			err := w.fill(m.Content)
			release()
			if err != nil {
				a.reject(log, c, ReasonInvalid, "invalid content: "+err.Error())
				return
			}
			rs, asked := append([]arrived{w.report}, w.queued...), w
			w = nil
			if !settle(rs, asked) {
				return
			}
			continue
		}
		if m.Type == stream.TypeFlushed && m.Flushed != nil {
			release()
			if err := a.flushed(c, m.Flushed); err != nil {
				a.reject(log, c, ReasonProtocol, err.Error())
				return
			}
			continue
		}
		if m.Type != stream.TypeReport || m.Report == nil {
			release()
			a.reject(log, c, ReasonProtocol, fmt.Sprintf("expected a report, got %q", m.Type))
			return
		}
		if !limit.AllowN(began, 1) {
			release()
			a.reject(log, c, ReasonRate, fmt.Sprintf("reports arrive faster than four per interval (%s)", interval))
			return
		}
		a.cfg.Metrics.ReportBytes.Observe(float64(size))
		if w != nil {
			// Reports sent before the collector saw the Want wait their
			// turn: they are deltas on top of the parked one. A collector
			// answers a Want before its next read, so a few at most.
			release()
			if len(w.queued) >= maxQueued {
				a.reject(log, c, ReasonProtocol, fmt.Sprintf("%d reports sent without answering the aggregator's want", len(w.queued)+1))
				return
			}
			w.queued = append(w.queued, arrived{m.Report, began})
			continue
		}
		ok := settle([]arrived{{m.Report, began}}, nil)
		release()
		if !ok {
			return
		}
	}
}

// warmup lets one stream at a time bring a cold pool (a new leader's: the
// follower held no node's rules) its first state, while the other streams
// that named content the pool lacks wait for it. After a leader change the
// whole fleet reconnects at once, each naming its state by one hash; with
// nothing held, every stream was asked for every bucket's frontends and
// then their content (~0.6 MB and ~3 MB of JSON a node at the anchors),
// and decoding the same content from hundreds of nodes at once took the
// new leader's CPU for tens of seconds. Most of one node's state is every
// node's: the streams that waited ask only for what differs.
type warmup struct {
	mu    sync.Mutex
	warm  bool
	owner *conn
	ready chan struct{} // closed when the owner is done
}

// warmupWait bounds how long a stream waits for another to warm the pool.
const warmupWait = 5 * time.Second

// wait says whether c waited for another stream to warm the pool (its
// report should be resolved again). A warm pool, or no other stream
// warming it, does not wait: c then warms it. A warming stream that never
// answers holds the others warmupWait at a time, until its stream ends or
// another stream's state warms the pool.
func (w *warmup) wait(ctx context.Context, c *conn, clk clock.Clock) bool {
	w.mu.Lock()
	if w.warm || w.owner == nil || w.owner == c {
		if !w.warm && w.owner == nil {
			w.owner, w.ready = c, make(chan struct{})
		}
		w.mu.Unlock()
		return false
	}
	ready := w.ready
	w.mu.Unlock()
	t := clk.NewTimer(warmupWait)
	defer t.Stop()
	select {
	case <-ready:
	case <-t.C():
	case <-ctx.Done():
	}
	return true
}

// done says c applied a whole state (warmed: the pool is warm, whoever
// was warming it) or ended; either ends c's warm-up if it was warming.
func (w *warmup) done(c *conn, warmed bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.warm = w.warm || warmed
	if w.owner != nil && (w.owner == c || warmed) {
		close(w.ready)
		w.owner, w.ready = nil, nil
	}
}

// reset makes the pool count as cold again (a new leadership: what it
// held of the last one's nodes has gone with them).
func (w *warmup) reset() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.warm = false
}

// maxReadError bounds the read error a node's report may carry.
const maxReadError = 512

// maxQueued bounds the reports held behind a parked one.
const maxQueued = 4

// frame is one message read off a stream, with when it began to arrive.
type frame struct {
	m       *stream.Message
	size    int
	release func() // gives back its decode budget
	err     error
	at      time.Time
}

// arrived is a report with the time it began to arrive: what it shows
// is judged as of then, not as of when the aggregator got round to it.
// Dated when applied, a report that waited ten seconds for the content it
// named (a new leader resolving a fleet's snapshots) showed a healthy
// node ten seconds behind: false StuckProxy at 2,000 nodes.
type arrived struct {
	report *stream.Report
	at     time.Time
}

// waiting is a report parked until the collector sends the next level
// down of what it named (bucket names for its top, changed frontends of
// unknown buckets, content of unknown frontends), with the reports that
// arrived meanwhile.
type waiting struct {
	report arrived
	queued []arrived
	want   stream.Want
	asked  map[string]bool
}

// ask records what to want of the collector for what is missing.
func (w *waiting) ask(seq uint64, m *stream.MissingError) {
	w.want = stream.Want{Seq: seq}
	switch {
	case m.Top:
		w.want.Buckets = true
	case len(m.Buckets) > 0:
		w.want.Delta = m.Buckets
	default:
		w.want.Sums = m.Sums
		w.asked = make(map[string]bool, len(m.Sums))
		for _, s := range m.Sums {
			w.asked[s] = true
		}
	}
}

// again reports whether what is missing after the collector's answer is
// what was asked: it no longer has it.
func (w *waiting) again(m *stream.MissingError) bool {
	switch {
	case m.Top:
		return w.want.Buckets
	case len(m.Buckets) > 0:
		return slices.ContainsFunc(m.Buckets, func(i int) bool { return slices.Contains(w.want.Delta, i) })
	}
	return slices.ContainsFunc(m.Sums, func(s string) bool { return w.asked[s] })
}

// fill moves the collector's answer into the parked report. Only what was
// asked may come: bucket names when they were asked; changed frontends of
// the buckets asked (checked where the report is applied); frontends that
// each hash to an asked sum named under their own key.
func (w *waiting) fill(ct *stream.Content) error {
	if ct.Buckets != "" && !w.want.Buckets {
		return errors.New("bucket names were not asked for")
	}
	if (len(ct.Refs) > 0 || len(ct.Removed) > 0) && len(w.want.Delta) == 0 {
		return errors.New("changed frontends were not asked for")
	}
	r := *w.report.report
	switch {
	case w.want.Buckets:
		if len(ct.Frontends) > 0 {
			return errors.New("frontends sent for bucket names")
		}
		r.Buckets = ct.Buckets
	case len(w.want.Delta) > 0:
		if ct.Buckets != "" || len(ct.Frontends) > 0 {
			return errors.New("content besides the changed frontends asked for")
		}
		// An empty answer: the collector no longer has that report; the
		// buckets stay missing and the collector is resynced.
		if len(ct.Refs)+len(ct.Removed) > 0 {
			r.Refs = append(slices.Clone(r.Refs), ct.Refs...)
			r.Removed = append(slices.Clone(r.Removed), ct.Removed...)
			r.Patched = append(slices.Clone(r.Patched), w.want.Delta...)
		}
	default:
		if err := w.fillFrontends(&r, ct.Frontends); err != nil {
			return err
		}
	}
	w.report.report = &r
	return nil
}

// fillFrontends moves the frontends the collector sent from the parked
// report's refs to its content.
func (w *waiting) fillFrontends(r *stream.Report, fs []stream.Frontend) error {
	if len(fs) > len(w.asked) {
		return fmt.Errorf("%d frontends sent for %d asked", len(fs), len(w.asked))
	}
	got := make(map[string]stream.Frontend, len(fs))
	for _, f := range fs {
		sum := f.Sum()
		if !w.asked[sum] {
			return fmt.Errorf("frontend %s was not asked for", clip(f.Key))
		}
		got[sum] = f
	}
	r.Frontends = slices.Clone(r.Frontends)
	r.Refs = nil
	for _, ref := range w.report.report.Refs {
		f, ok := got[ref.Sum]
		switch {
		case !ok:
			r.Refs = append(r.Refs, ref)
		case f.Key != ref.Key:
			return fmt.Errorf("frontend %s sent for a hash named under %s", clip(f.Key), clip(ref.Key))
		default:
			r.Frontends = append(r.Frontends, f)
		}
	}
	return nil
}

// countNamed counts what a report named by hash that the aggregator knew
// or wanted (missing: what it wants next).
func (a *Aggregator) countNamed(r *stream.Report, missing *stream.MissingError) {
	m := a.cfg.Metrics
	switch {
	case missing == nil:
		if r.Top != "" && r.Buckets == "" {
			m.Named.WithLabelValues("top", "known").Inc()
		}
		if len(r.Refs) > 0 {
			m.Refs.WithLabelValues("known").Add(float64(len(r.Refs)))
		}
	case missing.Top:
		m.Named.WithLabelValues("top", "wanted").Inc()
	case len(missing.Buckets) > 0:
		m.Named.WithLabelValues("bucket", "wanted").Add(float64(len(missing.Buckets)))
	default:
		m.Refs.WithLabelValues("wanted").Add(float64(len(missing.Sums)))
	}
}

// apply records one report. It returns whether the copy matches the
// collector's root; a reason when the stream must end. The report is
// validated and applied to a copy outside the lock (a full snapshot at the
// anchors takes ~0.1 s): only this stream's goroutine changes its node's
// copy, and a newer stream for the node supersedes it. missing names the
// hashes of refs no node's copy holds: the report is not applied, and
// applied again (resumed) once their content came. now is when the report
// began to arrive (see arrived).
func (a *Aggregator) apply(n *node, c *conn, r *stream.Report, now time.Time, interval time.Duration, resumed bool) (ok bool, reason RejectReason, why string, missing *stream.MissingError) {
	a.mu.Lock()
	if n.conn != c || !a.leading {
		a.mu.Unlock()
		return true, ReasonProtocol, "stream superseded", nil
	}
	if r.Seq <= n.lastSeq && !(resumed && r.Seq == n.lastSeq) {
		a.mu.Unlock()
		return false, ReasonReplay, fmt.Sprintf("report seq %d not after %d: replayed or reordered", r.Seq, n.lastSeq), nil
	}
	if r.Reads != nil {
		if err := r.Reads.Validate(); err != nil {
			a.mu.Unlock()
			return true, ReasonInvalid, "invalid report: " + err.Error(), nil
		}
	}
	if err := r.CheckFacts(); err != nil {
		a.mu.Unlock()
		return true, ReasonInvalid, "invalid report: " + err.Error(), nil
	}
	if ct := r.Conntrack; ct != nil {
		// Kept as soon as it is valid: it does not depend on the rules.
		if ct.Error != "" {
			n.conntrack, n.conntrackErr = nil, safetext.Clean(ct.Error, maxReadError)
		} else if m, err := ct.Model(); err != nil {
			a.mu.Unlock()
			return true, ReasonInvalid, "invalid report: " + err.Error(), nil
		} else {
			n.conntrack, n.conntrackErr = m, ""
		}
	}
	// A read error is shown to people (explain, report, Slack): clean
	// and short.
	r.ReadError = safetext.Clean(r.ReadError, maxReadError)
	n.lastSeq = r.Seq
	hb := audit.Heartbeat{At: now, Interval: interval, Mode: audit.Mode(r.Mode), ReadError: r.ReadError, KubeProxy: kubeProxySignal(r.KubeProxy),
		Cost: a.collectorCost(n, r.Reads)}
	if r.ReadError != "" {
		a.judge.Heard(n.name, hb)
		a.mu.Unlock()
		return true, "", "", nil
	}
	if !r.Full && !n.complete {
		a.mu.Unlock()
		return false, "", "no full snapshot on this stream yet", nil
	}
	next := *n.state
	a.mu.Unlock()

	match, err := next.Apply(r)

	a.mu.Lock()
	defer a.mu.Unlock()
	if n.conn != c || !a.leading {
		return true, ReasonProtocol, "stream superseded", nil
	}
	if me := (*stream.MissingError)(nil); errors.As(err, &me) {
		return true, "", "", me
	}
	if err != nil {
		return false, ReasonInvalid, "invalid report: " + err.Error(), nil
	}
	prev, wasComplete := *n.state, n.complete
	*n.state = next
	if !match {
		n.complete = false
		return false, "", "root digest differs from the aggregator's copy", nil
	}
	n.complete = true
	if r.Full || len(r.Frontends) > 0 || len(r.Refs) > 0 || len(r.Removed) > 0 || r.Top != "" || r.Buckets != "" || r.NoRules != n.noRules {
		// The rules the last report showed, if no judgement reached it
		// yet: judged in its stead while this report is newer than the
		// view (judgeAt).
		n.before = nil
		if wasComplete && n.fresh && n.heard.After(n.judged) {
			n.before = &shown{state: prev, at: n.heard, since: n.shownSince, version: n.version, noRules: n.noRules}
		}
		n.version++
		n.shownSince = now
	}
	if r.NoRules && !n.noRules {
		a.cfg.Log.Info("node has no kube-proxy rules (flushed, or kube-proxy not running)", zap.String("node", n.name))
		a.cfg.Metrics.NoRulesSeen.WithLabelValues(n.name).Inc()
	}
	n.noRules = r.NoRules
	n.heard, n.fresh = now, true
	a.judge.Heard(n.name, hb)
	return true, "", "", nil
}

func kubeProxySignal(k *stream.KubeProxy) *audit.KubeProxySignal {
	if k == nil {
		return nil
	}
	unix := func(f float64) time.Time {
		if f <= 0 {
			return time.Time{}
		}
		return time.Unix(0, int64(f*1e9)).UTC()
	}
	return &audit.KubeProxySignal{LastSync: unix(k.LastSync), LastQueued: unix(k.LastQueued),
		EndpointChangesPending: int(k.EndpointChangesPending), ServiceChangesPending: int(k.ServiceChangesPending), Error: safetext.Clean(k.Error, maxReadError),
		Version: clip(k.Version)}
}

// collectorCost turns what a collector says its reads cost into the
// node's record and the fleet's metrics (a.mu held): counts are
// cumulative per collector, so the metrics add what grew since its last
// word (a restarted collector starts from zero).
func (a *Aggregator) collectorCost(n *node, rs *stream.ReadStats) *audit.CollectorCost {
	if rs == nil {
		return nil
	}
	cost := &audit.CollectorCost{Reads: make(map[string]uint64, len(rs.Reads)), LastReadSeconds: rs.LastSeconds,
		LastReadCPUSeconds: rs.LastCPUSeconds, LastReadBytes: rs.LastBytes, FullReadIntervalSeconds: rs.FullReadIntervalSeconds, SignalLost: rs.SignalLost,
		Reader: safetext.Clean(rs.Reader, maxReadError), Fallbacks: rs.Fallbacks, FallbackReason: safetext.Clean(rs.FallbackReason, maxReadError)}
	if prev := n.fallbacks; rs.Fallbacks > prev {
		a.cfg.Metrics.CollectorFallbacks.Add(float64(rs.Fallbacks - prev))
	}
	n.fallbacks = rs.Fallbacks
	grew := false
	for reason, count := range rs.Reads {
		cost.Reads[string(reason)] = count
		prev := n.reads[reason]
		if count < prev {
			prev = 0
		}
		if count > prev {
			grew = true
			a.cfg.Metrics.CollectorReads.WithLabelValues(string(reason)).Add(float64(count - prev))
		}
	}
	if grew {
		a.cfg.Metrics.CollectorReadSeconds.Observe(rs.LastSeconds)
		a.cfg.Metrics.CollectorReadBytes.Observe(float64(rs.LastBytes))
	}
	n.reads = rs.Reads
	return cost
}
