package collector

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// connect runs one connection: the transport around a session. It
// returns the leader's address when the aggregator redirects, or the
// error that ended it.
func (c *client) connect(ctx context.Context, preferred string) (string, error) {
	conn, err := c.dial(ctx, preferred)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	s, leader, err := c.greet(conn)
	if s == nil {
		return leader, err
	}
	write := func(out []*stream.Message) error {
		for _, m := range out {
			if err := stream.Write(conn, m); err != nil {
				return err
			}
		}
		return nil
	}
	incoming, readErr := c.readMessages(conn)
	if err := write(s.start(ctx)); err != nil {
		return "", err
	}
	tick := c.cfg.Clock.NewTicker(c.cfg.Interval)
	defer tick.Stop()
	var poll <-chan time.Time
	if c.signal == nil && c.probe() != nil {
		// No signal announces a flush (IPVS): the probe is asked.
		t := c.cfg.Clock.NewTicker(flushPoll)
		defer t.Stop()
		poll = t.C()
	}
	for {
		var out []*stream.Message
		select {
		case <-ctx.Done():
			return "", nil
		case err := <-readErr:
			return "", err
		case m := <-incoming:
			var leader string
			if out, leader, err = s.receive(ctx, m); leader != "" || err != nil {
				return leader, err
			}
		case <-c.events():
			s.changed()
		case <-s.settle:
			out = s.settled(ctx)
		case <-s.soon:
			out = s.readOrWait(ctx, s.pending)
		case kp := <-c.scraped:
			out = s.scraped(ctx, kp)
		case <-poll:
			out = s.polled(ctx)
		case <-tick.C():
			out = s.heartbeat(ctx)
		}
		if err := write(out); err != nil {
			return "", err
		}
	}
}

// readMessages reads the aggregator's messages as they come: it may ask
// for a resync or a read, or name a new leader, at any time. The error
// that ends the reading comes on the second channel.
func (c *client) readMessages(conn net.Conn) (<-chan *stream.Message, <-chan error) {
	incoming := make(chan *stream.Message, 4)
	readErr := make(chan error, 1)
	go func() {
		for {
			m, _, err := stream.Read(conn, c.cfg.MaxMessageBytes)
			if err != nil {
				readErr <- err
				return
			}
			incoming <- m
		}
	}()
	return incoming, readErr
}

// session is one stream's protocol state on the collector's side, fed
// the aggregator's messages and the node's events; each returns the
// messages to send, in order. It never touches the connection.
type session struct {
	c *client
	// refs and tops: what the aggregator's welcome accepted.
	refs, tops bool
	// token is the credential the stream was last authenticated with.
	token string
	// sent is what the aggregator holds, as this side knows it.
	sent *stream.State
	// full: the next report carries every frontend (a new stream, a
	// resync, or the full snapshot a read error kept from being sent).
	full bool
	// recent are what the last reports of changes moved the aggregator
	// from and to, newest last: a Want names a report, and a newer report
	// may have changed the state since.
	recent []stream.Sent
	settle <-chan time.Time // a change announced, waiting to settle
	// pending is a read waiting out minReadGap, due when soon fires.
	pending stream.ReadReason
	soon    <-chan time.Time
	// pace keeps the reports within what the aggregator takes on a
	// stream (see newPace); nil: unpaced (the session scripts).
	pace *rate.Limiter
}

// The aggregator ends a stream whose reports come faster than four per
// interval, with a burst of eight. The collector paces itself a little
// inside that: under kube-proxy's syncs once a second its reads of
// changes, a second apart, would otherwise end its stream every fifteen
// seconds at a 10 s interval. Routine reads leave paceReserve reports of
// the burst for what cannot wait (a flush) and for the heartbeat.
const (
	paceBurst   = 7
	paceReserve = 2
)

// newPace is a stream's report pace: four an interval, less a tenth.
func newPace(interval time.Duration, now time.Time) *rate.Limiter {
	l := rate.NewLimiter(rate.Every(interval*11/40), paceBurst)
	l.SetBurstAt(now, paceBurst)
	return l
}

// paceWait is how long until a report may be sent leaving reserve
// reports of the burst (0: now).
func (s *session) paceWait(now time.Time, reserve int) time.Duration {
	if s.pace == nil {
		return 0
	}
	need := float64(1 + reserve)
	if tok := s.pace.TokensAt(now); tok < need {
		return time.Duration((need - tok) / float64(s.pace.Limit()) * float64(time.Second))
	}
	return 0
}

// report wraps r for sending.
func report(r *stream.Report) []*stream.Message {
	if r == nil {
		return nil
	}
	return []*stream.Message{{Type: stream.TypeReport, Report: r}}
}

// start is a new stream's first report, a full snapshot: of what the
// last read saw when nothing changed since (a leader change reconnects
// the fleet at once; it must not make every node read), else of a new
// read.
func (s *session) start(ctx context.Context) []*stream.Message {
	return report(s.next(ctx, s.c.due(stream.ReadResync)))
}

// next builds the next report, of a new read when why is set.
func (s *session) next(ctx context.Context, why stream.ReadReason) *stream.Report {
	if s.pace != nil {
		s.pace.AllowN(s.c.cfg.Clock.Now(), 1)
	}
	before := *s.sent
	r := s.c.report(ctx, s.sent, s.full, why, s.refs)
	if r.ReadError != "" {
		return r
	}
	s.full = false
	if s.refs && (r.Full || len(r.Frontends)+len(r.Refs)+len(r.Removed) > 0) {
		if r.Full {
			before = stream.State{} // a full snapshot moves the other end from nothing
		}
		s.recent = append(s.recent[max(0, len(s.recent)-wantHistory+1):], stream.Sent{Seq: r.Seq, Prev: before, Next: *s.sent})
		if s.tops {
			// A full snapshot too: after a leader change the whole
			// fleet sends one at once, and most name a state
			// another node's copy already holds.
			r = r.ByTop(s.sent)
		}
	}
	return r
}

// readOrWait reads for why now, or once the read gap has passed since
// the last read began.
func (s *session) readOrWait(ctx context.Context, why stream.ReadReason) []*stream.Message {
	c := s.c
	now := c.cfg.Clock.Now()
	left := readWait(now.Sub(c.readAt), c.credit.wait(now), c.cfg.Interval)
	if c.readAt.IsZero() {
		left = 0
	}
	left = max(left, s.paceWait(now, paceReserve))
	if left > 0 && c.flushed(ctx) {
		// A flush does not wait for the budget or the gap: it breaks
		// every service through the node, and reading an empty table
		// costs nothing. Only the stream's pace holds it, and routine
		// reads leave it room.
		why, left = stream.ReadFlushed, s.paceWait(now, 0)
	}
	if left > 0 {
		if s.pending == "" || why == stream.ReadFlushed {
			s.pending, s.soon = why, c.cfg.Clock.After(left)
		}
		return nil
	}
	s.pending, s.soon = "", nil
	return report(s.next(ctx, why))
}

// receive answers one message of the aggregator; a leader or an error
// ends the stream.
func (s *session) receive(ctx context.Context, m *stream.Message) ([]*stream.Message, string, error) {
	switch m.Type {
	case stream.TypeResync:
		s.full = true
		return report(s.next(ctx, s.c.due(stream.ReadResync))), "", nil
	case stream.TypeWant:
		if m.Want == nil {
			return nil, "", nil
		}
		return []*stream.Message{{Type: stream.TypeContent, Content: stream.Reply(m.Want, s.recent)}}, "", nil
	case stream.TypeFlush:
		return []*stream.Message{{Type: stream.TypeFlushed, Flushed: s.c.flush(ctx, m.Flush)}}, "", nil
	case stream.TypeReadNow:
		// Reads start at least minReadGap apart: a read costs seconds of
		// CPU at the anchors. A request inside the gap is answered when
		// it ends.
		return s.readOrWait(ctx, stream.ReadAsked), "", nil
	case stream.TypePeers:
		s.c.learnPeers(m.Peers)
	case stream.TypeRedirect:
		if m.Redirect != nil && m.Redirect.Leader != "" {
			return nil, m.Redirect.Leader, nil
		}
	case stream.TypeReject:
		if m.Reject != nil {
			return nil, "", fmt.Errorf("aggregator ended the stream: %s", m.Reject.Reason)
		}
		return nil, "", errors.New("aggregator ended the stream")
	}
	return nil, "", nil
}

// changed: the change signal announced a change; it is read once it
// settles.
func (s *session) changed() {
	if s.settle == nil {
		s.settle = s.c.cfg.Clock.After(settleDelay)
	}
}

// settled reads a change that settled, if a read is due.
func (s *session) settled(ctx context.Context) []*stream.Message {
	s.settle = nil
	if why := s.c.due(""); why != "" {
		return s.readOrWait(ctx, why)
	}
	return nil
}

// polled asks a reader without a change signal whether the rules were
// flushed, and reads them at once if so.
func (s *session) polled(ctx context.Context) []*stream.Message {
	if !s.c.flushed(ctx) {
		return nil
	}
	if left := s.paceWait(s.c.cfg.Clock.Now(), 0); left > 0 {
		s.pending, s.soon = stream.ReadFlushed, s.c.cfg.Clock.After(left)
		return nil
	}
	s.pending, s.soon = "", nil
	return report(s.next(ctx, stream.ReadFlushed))
}

// scraped takes a heartbeat's scrape of kube-proxy's metrics.
func (s *session) scraped(ctx context.Context, kp *stream.KubeProxy) []*stream.Message {
	c := s.c
	c.kp, c.scraping = kp, false
	// On the legacy backend kube-proxy's sync time is part of the change
	// signal: a pod swap keeps the table's size.
	if c.legacy {
		if why := c.due(""); why != "" {
			return s.readOrWait(ctx, why)
		}
	}
	return nil
}

// heartbeat: a read when something changed or the backstop is due, else
// a report of the last read (a steady node sends its root digest).
// kube-proxy's metrics arrive on their own.
func (s *session) heartbeat(ctx context.Context) []*stream.Message {
	c := s.c
	c.scrapeAsync(ctx)
	var out []*stream.Message
	// The kubelet rotates the projected token long before it expires;
	// the stream lives on with the new one.
	if fresh, err := c.credentials(); err != nil {
		c.cfg.Log.Warn("cannot re-read the token; the stream ends when the current one expires", zap.Error(err))
	} else if fresh != s.token {
		out = append(out, &stream.Message{Type: stream.TypeAuth, Auth: &stream.Auth{Token: fresh}})
		s.token = fresh
	}
	if why := c.due(stream.ReadHeartbeat); why != "" {
		return append(out, s.readOrWait(ctx, why)...)
	}
	return append(out, report(s.next(ctx, ""))...)
}
