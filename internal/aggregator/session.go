package aggregator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// session is one collector's stream past its hello: the protocol's state
// on the aggregator's side. It is fed the stream's messages in order
// (receive), each dated when it began to arrive, and answers on its conn;
// it never reads the socket, so a script can drive it message by message
// (see testdata/protocol). Only the stream's goroutine calls receive.
//
// The states, as docs/design.md draws them: open (registered, welcomed),
// parked (w holds a report that named content the aggregator lacks,
// waiting for the next level down), closed (receive returned false).
type session struct {
	a     *Aggregator
	c     *conn
	n     *node // set at registration
	log   *zap.Logger
	hello stream.Hello
	// source is the peer's address, bound to its token's review.
	source   string
	interval time.Duration
	// expires is when the stream's token ends (zero: never), renewed by
	// auth messages.
	expires time.Time
	limit   *rate.Limiter
	// w holds a report that named what the aggregator does not hold (its
	// top, buckets or frontends), and the reports that came after it,
	// until the collector sends the next level down.
	w *waiting
	// waited: this stream waited once for another to warm a cold pool
	// (see warmup).
	waited bool
}

// reject ends the stream, telling the collector why.
func (s *session) reject(reason RejectReason, why string) { s.a.reject(s.log, s.c, reason, why) }

// send sends m, counted by its type; false when the stream is gone.
func (s *session) send(m *stream.Message) bool {
	s.a.cfg.Metrics.StreamMessages.WithLabelValues("out", m.Type).Inc()
	_, err := s.c.send(m)
	return err == nil
}

// alive says a message of the stream began to arrive at at.
func (s *session) alive(at time.Time) {
	s.a.mu.Lock()
	s.a.fleet.judge.Alive(s.n.name, at)
	s.a.mu.Unlock()
}

// close ends the session: the node has no stream until its next hello.
func (s *session) close() {
	a := s.a
	a.mu.Lock()
	if s.n.conn == s.c {
		s.n.conn = nil
	}
	a.mu.Unlock()
	a.flush.end(s.c)
	a.warmup.done(s.c, false)
}

// receive handles one message; false when the stream must end (the
// collector was told why). f.release gives back the message's share of
// the decode budget: held until what it carried is applied.
func (s *session) receive(ctx context.Context, f frame) bool {
	m := f.m
	if m.Type == stream.TypeAuth && m.Auth != nil {
		f.release()
		// The kubelet rotated the collector's token: the stream lives on
		// with the new one, still bound to this node.
		return s.authenticate(ctx, m.Auth.Token)
	}
	if !s.expires.IsZero() && s.a.cfg.Clock.Now().After(s.expires) {
		f.release()
		s.reject(ReasonAuth, fmt.Sprintf("the stream's token expired at %s and was not renewed: reconnect with the current one", s.expires.UTC().Format(time.RFC3339)))
		return false
	}
	switch {
	case m.Type == stream.TypeContent && m.Content != nil:
		return s.content(ctx, m.Content, f.release)
	case m.Type == stream.TypeFlushed && m.Flushed != nil:
		f.release()
		if err := s.a.flush.answer(s.c, m.Flushed); err != nil {
			s.reject(ReasonProtocol, err.Error())
			return false
		}
		return true
	case m.Type != stream.TypeReport || m.Report == nil:
		f.release()
		s.reject(ReasonProtocol, fmt.Sprintf("expected a report, got %q", m.Type))
		return false
	}
	defer f.release()
	if !s.limit.AllowN(f.at, 1) {
		s.reject(ReasonRate, fmt.Sprintf("reports arrive faster than four per interval (%s)", s.interval))
		return false
	}
	s.a.cfg.Metrics.ReportBytes.Observe(float64(f.size))
	if s.w != nil {
		// Reports sent before the collector saw the Want wait their
		// turn: they are deltas on top of the parked one. A collector
		// answers a Want before its next read, so a few at most.
		if len(s.w.queued) >= maxQueued {
			s.reject(ReasonProtocol, fmt.Sprintf("%d reports sent without answering the aggregator's want", len(s.w.queued)+1))
			return false
		}
		s.w.queued = append(s.w.queued, arrived{m.Report, f.at})
		return true
	}
	return s.settle(ctx, []arrived{{m.Report, f.at}}, nil)
}

// content takes the collector's answer to a want: the parked report
// goes on with it, then the reports queued behind it.
func (s *session) content(ctx context.Context, ct *stream.Content, release func()) bool {
	if s.w == nil {
		release()
		s.reject(ReasonProtocol, "content nobody asked for")
		return false
	}
	err := s.w.fill(ct)
	release()
	if err != nil {
		s.reject(ReasonInvalid, "invalid content: "+err.Error())
		return false
	}
	rs, asked := append([]arrived{s.w.report}, s.w.queued...), s.w
	s.w = nil
	return s.settle(ctx, rs, asked)
}

// settle applies reports in order, parking at the first that needs more
// of the collector; false when the stream must end. asked is what was
// wanted of the first.
func (s *session) settle(ctx context.Context, rs []arrived, asked *waiting) bool {
	a := s.a
	for i, r := range rs {
		resumed := asked != nil && i == 0
		ok, reason, why, missing := a.apply(s.n, s.c, r.report, r.at, s.interval, resumed)
		if missing != nil && !missing.Top && !s.waited && a.warmup.wait(ctx, s.c, a.cfg.Clock) {
			// Another stream is bringing a cold pool its first state:
			// most of what this one named may come with it. (Once per
			// stream: a stream waits out a warmer that never answers
			// once, not at every level it then asks for.)
			s.waited = true
			ok, reason, why, missing = a.apply(s.n, s.c, r.report, r.at, s.interval, true)
		}
		if reason != "" {
			s.reject(reason, why)
			return false
		}
		if missing == nil && ok {
			a.warmup.done(s.c, true)
		}
		if missing != nil {
			if !(asked != nil && i == 0 && asked.again(missing)) {
				return s.want(r, rs[i+1:], missing)
			}
			// Asked for and not sent: the collector no longer has it.
			ok, why = false, "the collector could not send what it named"
		} else {
			a.countNamed(r.report, nil)
		}
		asked = nil
		if !ok {
			a.cfg.Metrics.Resyncs.Inc()
			if !s.send(&stream.Message{Type: stream.TypeResync, Resync: &stream.Resync{Reason: why}}) {
				return false
			}
		}
	}
	return true
}

// want parks r, with the reports after it, and asks the collector for
// the next level down of what r named.
func (s *session) want(r arrived, after []arrived, missing *stream.MissingError) bool {
	s.w = &waiting{report: r, queued: slices.Clone(after)}
	s.w.ask(r.report.Seq, missing)
	s.a.countNamed(r.report, missing)
	return s.send(&stream.Message{Type: stream.TypeWant, Want: &s.w.want})
}

// frame is one message read off a stream, with when it began to arrive.
type frame struct {
	m       *stream.Message
	size    int
	release func() // gives back its decode budget
	err     error
	at      time.Time
}

// authenticate reviews the stream's token, at its hello or renewed; false
// when the stream was refused.
func (s *session) authenticate(ctx context.Context, token string) bool {
	expires, err := s.a.cfg.Auth.Authenticate(ctx, auth.Hello{Node: s.hello.Node, Token: token, Source: s.source})
	if err != nil {
		var busy *auth.BusyError
		switch {
		case s.n != nil:
			s.reject(ReasonAuth, "renewing the stream's token: "+err.Error())
		case errors.As(err, &busy):
			s.a.rejectWith(s.log, s.c, ReasonBusy, &stream.Reject{Reason: err.Error(), RetryAfterSeconds: busy.RetryAfter.Seconds()}, nil)
		case errors.Is(err, auth.ErrBusy):
			s.reject(ReasonBusy, err.Error())
		default:
			s.reject(ReasonAuth, err.Error())
		}
		return false
	}
	s.expires = expires
	return true
}
