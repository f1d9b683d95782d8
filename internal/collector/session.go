package collector

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	"k8s.io/utils/clock"

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
	st := Stream{Conn: conn, Interval: c.cfg.Interval, Clock: c.cfg.Clock, MaxMessageBytes: c.cfg.MaxMessageBytes, Log: c.cfg.Log,
		// A reader found after the stream began brings its signal, a
		// heartbeat the scrape's channel: asked at every turn.
		Events: func() (<-chan struct{}, <-chan *stream.KubeProxy) { return c.events(), c.scraped }}
	if c.signal == nil && c.probe() != nil {
		// No signal announces a flush (IPVS): the probe is asked.
		t := c.cfg.Clock.NewTicker(flushPoll)
		defer t.Stop()
		st.Poll = t.C()
	}
	return serve(ctx, s, st)
}

// Node is the node's side of a stream: what its reads show and what it
// may do. The collector is one; the fleet simulation's nodes are others,
// so the simulated fleet speaks the protocol through the collector's own
// session (Serve) and cannot drift from it.
type Node interface {
	// Report builds the next report against sent, what the aggregator
	// holds (every frontend when full), of a new read when why is set,
	// and makes sent what the report moves the aggregator to.
	Report(ctx context.Context, sent *stream.State, full bool, why stream.ReadReason, refs bool) *stream.Report
	// Due says why the rules need a read now, or "" when the last read
	// still shows them; orElse when it cannot tell.
	Due(orElse stream.ReadReason) stream.ReadReason
	// ReadWait is how long a read a change or a read-now request causes
	// must wait (0: now).
	ReadWait(now time.Time) time.Duration
	// Flushed says whether the rules were flushed since the last read: a
	// read then does not wait.
	Flushed(ctx context.Context) bool
	// Flush answers the aggregator's request to delete stale conntrack
	// entries.
	Flush(ctx context.Context, f *stream.Flush) *stream.Flushed
	// LearnPeers takes the aggregator's list of its replicas.
	LearnPeers(p *stream.Peers)
	// Token is the credential to authenticate the stream with now.
	Token() (string, error)
	// StartScrape starts a scrape of kube-proxy's metrics, whose result
	// comes on Stream.Scraped; Scraped takes it and says whether a read
	// may be due because of it.
	StartScrape(ctx context.Context)
	Scraped(kp *stream.KubeProxy) bool
}

// Stream is a welcomed stream: its connection and what paces it.
type Stream struct {
	Conn            net.Conn
	Interval        time.Duration
	Clock           clock.WithTicker
	MaxMessageBytes int
	Log             *zap.Logger
	// Write writes the session's messages in order; nil writes each with
	// stream.Write (the fleet simulation shares encoded reports).
	Write func(out []*stream.Message) error
	// Received sees each message of the aggregator before the session
	// answers it (nil: none).
	Received func(m *stream.Message)
	// Events are the node's own events, asked at every turn (nil: none):
	// changes its signal announced, kube-proxy's metrics scraped.
	Events func() (changes <-chan struct{}, scraped <-chan *stream.KubeProxy)
	// Poll ticks when the node's flush probe is to be asked (nil: never).
	Poll <-chan time.Time
}

// Serve runs node's side of a stream whose hello the aggregator answered
// with welcome, until ctx ends or the stream does. It returns the
// leader's address when the aggregator redirects, or the error that ended
// the stream.
func Serve(ctx context.Context, node Node, hello *stream.Hello, welcome *stream.Message, st Stream) (string, error) {
	if st.Clock == nil {
		st.Clock = clock.RealClock{}
	}
	if st.MaxMessageBytes <= 0 {
		st.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if st.Log == nil {
		st.Log = zap.NewNop()
	}
	return serve(ctx, newSession(node, hello, welcome, st), st)
}

// newSession is the session of a stream whose hello was answered by
// welcome.
func newSession(node Node, hello *stream.Hello, welcome *stream.Message, st Stream) *session {
	s := &session{n: node, clock: st.Clock, log: st.Log, token: hello.Token, sent: stream.NewState(), full: true, pace: newPace(st.Interval, st.Clock.Now())}
	// refs: changed frontends go as their hashes; the aggregator asks for
	// the content of those no node sent it yet. An aggregator that does
	// not say so gets content.
	s.refs = hello.Refs && welcome.Welcome != nil && welcome.Welcome.Refs
	// tops: a report of changes names the whole state it moves to; the
	// aggregator asks one level down (bucket names, changed frontends,
	// content) only for what no node's copy holds.
	s.tops = s.refs && hello.Tops && welcome.Welcome.Tops
	return s
}

// serve runs session s on the stream until it ends.
func serve(ctx context.Context, s *session, st Stream) (string, error) {
	conn := st.Conn
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	write := st.Write
	if write == nil {
		write = func(out []*stream.Message) error {
			for _, m := range out {
				if err := stream.Write(conn, m); err != nil {
					return err
				}
			}
			return nil
		}
	}
	incoming, readErr := readMessages(conn, st.MaxMessageBytes)
	if err := write(s.start(ctx)); err != nil {
		return "", err
	}
	tick := st.Clock.NewTicker(st.Interval)
	defer tick.Stop()
	for {
		var out []*stream.Message
		var changes <-chan struct{}
		var scraped <-chan *stream.KubeProxy
		if st.Events != nil {
			changes, scraped = st.Events()
		}
		select {
		case <-ctx.Done():
			return "", nil
		case err := <-readErr:
			return "", err
		case m := <-incoming:
			if st.Received != nil {
				st.Received(m)
			}
			var leader string
			var err error
			if out, leader, err = s.receive(ctx, m); leader != "" || err != nil {
				return leader, err
			}
		case <-changes:
			s.changed()
		case <-s.settle:
			out = s.settled(ctx)
		case <-s.soon:
			out = s.readOrWait(ctx, s.pending)
		case kp := <-scraped:
			out = s.scraped(ctx, kp)
		case <-st.Poll:
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
func readMessages(conn net.Conn, maxBytes int) (<-chan *stream.Message, <-chan error) {
	incoming := make(chan *stream.Message, 4)
	readErr := make(chan error, 1)
	go func() {
		for {
			m, _, err := stream.Read(conn, maxBytes)
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
	n     Node
	clock clock.WithTicker
	log   *zap.Logger
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
	return report(s.next(ctx, s.n.Due(stream.ReadResync)))
}

// next builds the next report, of a new read when why is set.
func (s *session) next(ctx context.Context, why stream.ReadReason) *stream.Report {
	if s.pace != nil {
		s.pace.AllowN(s.clock.Now(), 1)
	}
	before := *s.sent
	r := s.n.Report(ctx, s.sent, s.full, why, s.refs)
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
	now := s.clock.Now()
	left := max(s.n.ReadWait(now), s.paceWait(now, paceReserve))
	if left > 0 && s.n.Flushed(ctx) {
		// A flush does not wait for the budget or the gap: it breaks
		// every service through the node, and reading an empty table
		// costs nothing. Only the stream's pace holds it, and routine
		// reads leave it room.
		why, left = stream.ReadFlushed, s.paceWait(now, 0)
	}
	if left > 0 {
		if s.pending == "" || why == stream.ReadFlushed {
			s.pending, s.soon = why, s.clock.After(left)
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
		return report(s.next(ctx, s.n.Due(stream.ReadResync))), "", nil
	case stream.TypeWant:
		if m.Want == nil {
			return nil, "", nil
		}
		return []*stream.Message{{Type: stream.TypeContent, Content: stream.Reply(m.Want, s.recent)}}, "", nil
	case stream.TypeFlush:
		return []*stream.Message{{Type: stream.TypeFlushed, Flushed: s.n.Flush(ctx, m.Flush)}}, "", nil
	case stream.TypeReadNow:
		// Reads start at least minReadGap apart: a read costs seconds of
		// CPU at the anchors. A request inside the gap is answered when
		// it ends.
		return s.readOrWait(ctx, stream.ReadAsked), "", nil
	case stream.TypePeers:
		s.n.LearnPeers(m.Peers)
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
		s.settle = s.clock.After(settleDelay)
	}
}

// settled reads a change that settled, if a read is due.
func (s *session) settled(ctx context.Context) []*stream.Message {
	s.settle = nil
	if why := s.n.Due(""); why != "" {
		return s.readOrWait(ctx, why)
	}
	return nil
}

// polled asks a reader without a change signal whether the rules were
// flushed, and reads them at once if so.
func (s *session) polled(ctx context.Context) []*stream.Message {
	if !s.n.Flushed(ctx) {
		return nil
	}
	if left := s.paceWait(s.clock.Now(), 0); left > 0 {
		s.pending, s.soon = stream.ReadFlushed, s.clock.After(left)
		return nil
	}
	s.pending, s.soon = "", nil
	return report(s.next(ctx, stream.ReadFlushed))
}

// scraped takes a heartbeat's scrape of kube-proxy's metrics.
func (s *session) scraped(ctx context.Context, kp *stream.KubeProxy) []*stream.Message {
	if s.n.Scraped(kp) {
		if why := s.n.Due(""); why != "" {
			return s.readOrWait(ctx, why)
		}
	}
	return nil
}

// heartbeat: a read when something changed or the backstop is due, else
// a report of the last read (a steady node sends its root digest).
// kube-proxy's metrics arrive on their own.
func (s *session) heartbeat(ctx context.Context) []*stream.Message {
	s.n.StartScrape(ctx)
	var out []*stream.Message
	// The kubelet rotates the projected token long before it expires;
	// the stream lives on with the new one.
	if fresh, err := s.n.Token(); err != nil {
		s.log.Warn("cannot re-read the token; the stream ends when the current one expires", zap.Error(err))
	} else if fresh != s.token {
		out = append(out, &stream.Message{Type: stream.TypeAuth, Auth: &stream.Auth{Token: fresh}})
		s.token = fresh
	}
	if why := s.n.Due(stream.ReadHeartbeat); why != "" {
		return append(out, s.readOrWait(ctx, why)...)
	}
	return append(out, report(s.next(ctx, ""))...)
}
