package aggregator

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

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

// handle runs one collector's stream: the transport around its session.
// It reads the hello, lets admission open a session for it, then reads
// frames ahead (readFrames) and hands each to the session until either
// side ends the stream.
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
	s := a.open(ctx, c, m, log)
	if s == nil {
		return
	}
	defer s.close()

	quit := make(chan struct{})
	frames := a.readFrames(c, s, quit)
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
	for f := range frames {
		if f.err != nil {
			if errors.Is(f.err, io.EOF) || errors.Is(f.err, net.ErrClosed) || ctx.Err() != nil {
				s.log.Info("collector stream closed")
			} else {
				s.reject(readReason(f.err), f.err.Error())
			}
			return
		}
		if !s.receive(ctx, f) {
			return
		}
	}
}

// readFrames reads s's messages ahead of their handling, up to maxQueued,
// so that each is dated when it began to arrive (see arrived) while the
// stream's goroutine waits: for the content a report named, a cold pool's
// warm-up, the aggregator's lock. Read in turn, a report that sat in the
// socket behind a 14 s want cascade was dated 14 s late (5,000 nodes,
// after a takeover). A message that begins to arrive also proves its
// collector alive, even while it waits for the decode budget behind a
// fleet's worth of others: a leader that is behind must not call its
// fleet missing. The channel closes after the first error, which it
// carries; quit stops the reader.
func (a *Aggregator) readFrames(c *conn, s *session, quit chan struct{}) <-chan frame {
	frames := make(chan frame, maxQueued)
	ahead := &readAhead{held: make(chan struct{}, 1), quit: quit}
	go func() {
		defer close(frames)
		for {
			c.SetReadDeadline(time.Now().Add(time.Duration(a.cfg.Policy.MissingIntervals)*s.interval + 15*time.Second))
			var f frame
			f.m, f.size, f.release, f.err = a.read(c, a.cfg.MaxMessageBytes, true, func() {
				f.at = a.cfg.Clock.Now()
				s.alive(f.at)
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
	return frames
}
