package aggregator

import (
	"context"
	"fmt"
	"hash/fnv"
	"net"
	"time"

	"go.uber.org/zap"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// noLeaderRetry is when a collector refused for want of a leader (or of
// its shard's holder) is told to come back: 2 to 5 s, spread by its node's
// name so that a fleet refused at once does not come back at once, and
// the same for a node each time (a protocol script can say it).
func noLeaderRetry(node string) time.Duration {
	h := fnv.New32a()
	h.Write([]byte(node))
	return 2*time.Second + time.Duration(h.Sum32()%3000)*time.Millisecond
}

// redirect tells a collector where the leader is, when another replica
// leads.
func (a *Aggregator) redirect(c *conn, leader string) {
	if leader != "" && leader != a.cfg.Self {
		a.cfg.Metrics.sent(c.send(&stream.Message{Type: stream.TypeRedirect, Redirect: &stream.Redirect{Leader: leader}, Peers: a.knownPeers()}))
		a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeRedirect).Inc()
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
	a.cfg.Metrics.sent(c.send(&stream.Message{Type: stream.TypeReject, Reject: r, Peers: peers}))
}

// checkHello says what is wrong with a stream's first message, if
// anything, and the report interval it declares.
func checkHello(m *stream.Message) (time.Duration, string) {
	h := m.Hello
	if m.Type != stream.TypeHello || h == nil {
		return 0, fmt.Sprintf("first message must be a hello, got %q", m.Type)
	}
	if errs := validation.IsDNS1123Subdomain(h.Node); len(errs) > 0 {
		return 0, fmt.Sprintf("hello names no valid node (%q): %s", clip(h.Node), errs[0])
	}
	interval := time.Duration(h.IntervalSeconds * float64(time.Second))
	if interval < time.Second || interval > 10*time.Minute {
		return 0, fmt.Sprintf("interval %gs out of range (1s to 10m)", h.IntervalSeconds)
	}
	return interval, ""
}

// open admits a stream whose first message m arrived on c: a valid
// hello, to the leader, with a token the authenticator accepts. It
// registers the stream as its node's, answers with the welcome and
// returns the session; nil when the stream was refused (c was told why).
func (a *Aggregator) open(ctx context.Context, c *conn, m *stream.Message, log *zap.Logger) *session {
	interval, bad := checkHello(m)
	if bad != "" {
		a.reject(log, c, ReasonProtocol, bad)
		return nil
	}
	h := m.Hello
	log = log.With(zap.String("node", h.Node))
	// A follower sends the collector on before reviewing anything: a
	// redirect carries nothing secret, and a fleet reconnecting after a
	// leader change must not cost the API server a review at each replica.
	// With shards, the node's shard's holder stands for the leader.
	a.mu.Lock()
	owns := a.ownsLocked(h.Node)
	a.mu.Unlock()
	if !owns {
		if holder := a.holderOf(h.Node); holder != "" && holder != a.cfg.Self {
			a.redirect(c, holder)
			return nil
		}
		why := "this aggregator is not the leader and no leader is elected yet; retry shortly"
		if a.sharded() {
			why = fmt.Sprintf("no aggregator replica holds this node's shard (%d) yet (a handover); retry shortly", a.shardOf(h.Node))
		}
		// The replicas it knows go with the refusal (see knownPeers), and
		// when to come back: a leader is usually elected within seconds,
		// and a collector left to its own backoff (to 30 s once it has
		// been welcomed) came back after the new leader's allowance ran
		// out, making every node CollectorMissing after an API server
		// restart. The fleet's retries are spread by node over 2–5 s.
		a.rejectWith(log, c, ReasonProtocol, &stream.Reject{Reason: why, RetryAfterSeconds: noLeaderRetry(h.Node).Seconds()}, a.knownPeers())
		return nil
	}
	s := &session{a: a, c: c, log: log, hello: *h, interval: interval,
		// A collector sends one report per interval plus answers to resyncs.
		limit: rate.NewLimiter(rate.Every(interval/4), 8)}
	s.source, _, _ = net.SplitHostPort(c.RemoteAddr().String())
	if !s.authenticate(ctx, h.Token) {
		return nil
	}
	c.authenticated()
	if a.cfg.Insecure {
		log.Warn("accepting an unauthenticated collector stream (--insecure-no-auth): any client can report for any node")
	}
	if !a.register(s) {
		return nil
	}
	if a.peersMsg.Load() != nil {
		a.sendPeers(c)
	}
	log.Info("collector stream open", zap.String("version", h.Version), zap.Duration("interval", interval))
	return s
}

// register makes s its node's stream, replacing the one before, and
// welcomes it; false when this aggregator stopped leading meanwhile.
func (a *Aggregator) register(s *session) bool {
	c := s.c
	// The stream's writes are held from its registration to its welcome:
	// once registered, a flush, a read-now or a peers list may be sent on
	// it at any moment, and the collector takes the first message for the
	// answer to its hello. (Writes are never made under a.mu, so taking
	// it while holding wmu cannot deadlock.)
	c.wmu.Lock()
	a.mu.Lock()
	if !a.ownsLocked(s.hello.Node) {
		a.mu.Unlock()
		c.wmu.Unlock()
		s.reject(ReasonProtocol, "this aggregator stopped leading (or gave up the node's shard); reconnect to find the leader")
		return false
	}
	n, replaced := a.fleet.register(s.hello.Node, clip(s.hello.Version), c, a.pool)
	s.n = n
	a.mu.Unlock()
	if replaced != nil {
		s.log.Info("a new stream replaces the node's previous one")
		replaced.Close()
	}
	if hook := a.testHookRegistered.Load(); hook != nil {
		(*hook)()
	}
	a.cfg.Metrics.sent(c.writeLocked(&stream.Message{Type: stream.TypeWelcome, Welcome: &stream.Welcome{Refs: true, Tops: true}}))
	c.wmu.Unlock()
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeWelcome).Inc()
	return true
}
