// Package aggregator is proxyaudit's aggregator: it watches the API
// through one informer per kind, receives every node's rules from the
// collectors' streams, judges them with the audit core over time, and
// serves the verdict over HTTP. Only the leader judges and accepts
// streams; followers keep their informers warm and send collectors to the
// leader.
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
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// Config is what an aggregator needs besides its View.
type Config struct {
	Policy audit.Policy
	Auth   Authenticator
	// Readers, when set, decides who may read the HTTP API's findings
	// (/api/); nil serves them to anyone who reaches the port.
	Readers *ReaderAuth
	// Insecure marks Auth as accepting everyone: every connection is
	// logged with a warning.
	Insecure        bool
	MaxMessageBytes int
	// Self is this replica's stream address as collectors reach it: the
	// leader-election identity, and what followers redirect to.
	Self    string
	Log     *zap.Logger
	Metrics *Metrics
	Clock   clock.Clock
	// Remediation, when set, plans and executes repairs after each
	// verdict (dry-run by default).
	Remediation *Remediation
	// Notifier, when set, hears about the aggregator itself (its view of
	// the API going stale and coming back).
	Notifier remediate.Notifier
	// RecoveryGrace: after the view comes back from stale (an API outage),
	// node drift is neither reported nor repaired for this long, since
	// every kube-proxy reconnects with client-go's backoff (up to 30 s,
	// jittered to 60 s). Default 60 s.
	RecoveryGrace time.Duration
	// DecodeBudget bounds the bytes of large reports (full snapshots)
	// decoded and applied at once; more wait. Default 64 MiB: about 20
	// snapshots at 100k endpoints, ~0.5 GiB decoded.
	DecodeBudget int
}

// Aggregator holds every node's stream state and the judge.
type Aggregator struct {
	cfg  Config
	view *View

	mu      sync.Mutex
	leading bool
	leader  string
	judge   *audit.Judge
	nodes   map[string]*node
	// pool shares identical frontends among the nodes' copies: a fleet
	// mostly programs the same rules.
	pool    *stream.Pool
	budget  *stream.Budget
	verdict *audit.Verdict
	// memo holds the assessments made at cluster generation memoGen, by
	// node class and root (Evaluate's goroutine only).
	memo    map[[2]uint64][]assessed
	memoGen uint64
	classes func(node string) uint64
	// current indexes currentOf's services by name (assessNode).
	current   map[string]*audit.Service
	currentOf *audit.State
	// stale: since when the leader's view of the API is stale (zero: fresh)
	// and why; while stale nothing is judged or repaired.
	staleSince time.Time
	staleWhy   string
	freshSince time.Time // a stale view first looked fresh again
	// recovering: until when node drift is held back after a stale view.
	recovering time.Time
}

// node is one node's stream: the copy of its rules and what was last
// assessed of them.
type node struct {
	name     string
	conn     *conn
	state    *stream.State
	complete bool // a full snapshot arrived on this stream
	lastSeq  uint64
	heard    time.Time
	fresh    bool   // a report since the last assessment
	version  uint64 // bumps when state changes
	noRules  bool

	// readNowFor is the grace deadline a read-now request was last sent
	// for: one request per crossing.
	readNowFor time.Time

	assessedVersion, assessedGen uint64
	assessments                  []audit.ServiceAssessment
	base                         *baseline // Evaluate's goroutine only
}

type conn struct {
	net.Conn
	wmu sync.Mutex
}

func (c *conn) send(m *stream.Message) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
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

// New returns an aggregator over view. It leads only after StartedLeading
// (or at once when leader election is off: call StartedLeading yourself).
func New(cfg Config, view *View) *Aggregator {
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics()
	}
	if cfg.DecodeBudget <= 0 {
		cfg.DecodeBudget = 64 << 20
	}
	if cfg.RecoveryGrace == 0 {
		cfg.RecoveryGrace = 60 * time.Second
	}
	view.onRebuild = func(d time.Duration) { cfg.Metrics.Reconcile.WithLabelValues("cluster_state").Observe(d.Seconds()) }
	return &Aggregator{cfg: cfg, view: view, nodes: map[string]*node{}, judge: audit.NewJudge(cfg.Policy), pool: stream.NewPool(),
		budget: stream.NewBudget(cfg.DecodeBudget)}
}

// StartedLeading makes this replica judge and accept streams, from a
// clean memory (collectors resend full snapshots on connecting).
func (a *Aggregator) StartedLeading() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.leading, a.leader = true, a.cfg.Self
	a.judge = audit.NewJudge(a.cfg.Policy)
	a.nodes = map[string]*node{}
	a.verdict = nil
	a.cfg.Metrics.Leader.Set(1)
	a.cfg.Log.Info("leading: accepting collector streams", zap.String("self", a.cfg.Self))
}

// StoppedLeading ends every stream (sending collectors to the new leader
// when it is known) and forgets the nodes.
func (a *Aggregator) StoppedLeading() {
	a.mu.Lock()
	if !a.leading {
		a.mu.Unlock()
		return
	}
	a.leading = false
	a.cfg.Metrics.Leader.Set(0)
	// Only the leader judges its view; a follower's stale flag would keep
	// ProxyAuditViewStale firing for a replica that no longer decides.
	a.cfg.Metrics.ViewStale.Set(0)
	var open []*conn
	for _, n := range a.nodes {
		if n.conn != nil {
			open = append(open, n.conn)
		}
	}
	a.nodes = map[string]*node{}
	a.verdict = nil
	leader := a.leader
	a.mu.Unlock()
	// Writes happen outside the lock: a stuck collector must not hold up
	// the rest (each write has its own deadline).
	for _, c := range open {
		a.redirect(c, leader)
		c.Close()
	}
	a.cfg.Log.Info("no longer leading: streams handed over", zap.String("leader", leader), zap.Int("streams", len(open)))
}

// NewLeader records who leads (this replica or another).
func (a *Aggregator) NewLeader(identity string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if identity != a.leader {
		a.cfg.Log.Info("leader changed", zap.String("leader", identity))
	}
	a.leader = identity
}

// Leader returns the current leader's identity ("" when unknown) and
// whether it is this replica.
func (a *Aggregator) Leader() (string, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.leader, a.leading
}

// redirect tells a collector where the leader is, when another replica
// leads.
func (a *Aggregator) redirect(c *conn, leader string) {
	if leader != "" && leader != a.cfg.Self {
		a.sent(c.send(&stream.Message{Type: stream.TypeRedirect, Redirect: &stream.Redirect{Leader: leader}}))
		a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeRedirect).Inc()
	}
}

func (a *Aggregator) sent(n int, _ error) {
	a.cfg.Metrics.StreamBytes.WithLabelValues("out").Add(float64(n))
}

// Verdict returns the latest verdict, or nil before the first one (or on
// a follower).
func (a *Aggregator) Verdict() *audit.Verdict {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.verdict
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
		c := &conn{Conn: nc}
		mu.Lock()
		if ended {
			mu.Unlock()
			nc.Close()
			return nil
		}
		open[c] = true
		wg.Add(1)
		mu.Unlock()
		go func() {
			defer wg.Done()
			a.handle(ctx, c)
			mu.Lock()
			delete(open, c)
			mu.Unlock()
		}()
	}
}

// reject refuses or ends a stream with a reason the collector logs.
func (a *Aggregator) reject(log *zap.Logger, c *conn, reason, why string) {
	log.Warn("collector stream rejected", zap.String("reason", reason), zap.String("why", why))
	a.cfg.Metrics.StreamRejected.WithLabelValues(reason).Inc()
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeReject).Inc()
	a.sent(c.send(&stream.Message{Type: stream.TypeReject, Reject: &stream.Reject{Reason: why}}))
}

func readReason(err error) string {
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

// read receives one message of at most max bytes. A large one is decoded
// and held only within the decode budget; release returns its share once
// the message is applied.
func (a *Aggregator) read(c *conn, max int) (m *stream.Message, n int, release func(), err error) {
	body, n, err := stream.ReadFrame(c, max)
	if err != nil {
		return nil, n, func() {}, err
	}
	release = func() {}
	if len(body) > smallMessage {
		took := a.budget.Take(len(body))
		release = func() { a.budget.Give(took) }
	}
	if m, err = stream.Decode(body); err != nil {
		release()
		return nil, n, func() {}, err
	}
	a.cfg.Metrics.StreamBytes.WithLabelValues("in").Add(float64(n))
	a.cfg.Metrics.StreamMessages.WithLabelValues("in", m.Type).Inc()
	return m, n, release, nil
}

// smallMessage: a steady report (a root digest) or a small delta skips the
// decode budget. maxHelloBytes bounds the one message read before a
// collector is authenticated.
const (
	smallMessage  = 64 << 10
	maxHelloBytes = 64 << 10
)

func (a *Aggregator) handle(ctx context.Context, c *conn) {
	defer c.Close()
	a.cfg.Metrics.Streams.Inc()
	defer a.cfg.Metrics.Streams.Dec()
	log := a.cfg.Log.With(zap.String("remote", c.RemoteAddr().String()))

	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	m, _, release, err := a.read(c, maxHelloBytes)
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
	if err := a.cfg.Auth.Authenticate(ctx, h.Node, h.Token); err != nil {
		a.reject(log, c, ReasonAuth, err.Error())
		return
	}
	if a.cfg.Insecure {
		log.Warn("accepting an unauthenticated collector stream (--insecure-no-auth): any client can report for any node")
	}

	a.mu.Lock()
	if !a.leading {
		leader := a.leader
		a.mu.Unlock()
		if leader == "" || leader == a.cfg.Self {
			a.reject(log, c, ReasonProtocol, "this aggregator is not the leader and no leader is elected yet; retry shortly")
			return
		}
		a.redirect(c, leader)
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
	n.conn, n.state, n.complete, n.lastSeq = c, stream.NewPooledState(a.pool), false, 0
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		if n.conn == c {
			n.conn = nil
		}
		a.mu.Unlock()
	}()

	a.sent(c.send(&stream.Message{Type: stream.TypeWelcome}))
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeWelcome).Inc()
	log.Info("collector stream open", zap.String("version", h.Version), zap.Duration("interval", interval))

	// A collector sends one report per interval plus answers to resyncs.
	limit := rate.NewLimiter(rate.Every(interval/4), 8)
	for {
		c.SetReadDeadline(time.Now().Add(time.Duration(a.cfg.Policy.MissingIntervals)*interval + 15*time.Second))
		m, size, release, err := a.read(c, a.cfg.MaxMessageBytes)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				log.Info("collector stream closed")
			} else {
				a.reject(log, c, readReason(err), err.Error())
			}
			return
		}
		if m.Type != stream.TypeReport || m.Report == nil {
			release()
			a.reject(log, c, ReasonProtocol, fmt.Sprintf("expected a report, got %q", m.Type))
			return
		}
		if !limit.Allow() {
			release()
			a.reject(log, c, ReasonRate, fmt.Sprintf("reports arrive faster than four per interval (%s)", interval))
			return
		}
		a.cfg.Metrics.ReportBytes.Observe(float64(size))
		ok, reason, why := a.apply(n, c, m.Report, interval)
		release()
		if reason != "" {
			a.reject(log, c, reason, why)
			return
		}
		if !ok {
			a.cfg.Metrics.Resyncs.Inc()
			a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypeResync).Inc()
			if _, err := c.send(&stream.Message{Type: stream.TypeResync, Resync: &stream.Resync{Reason: why}}); err != nil {
				return
			}
		}
	}
}

// apply records one report. It returns whether the copy matches the
// collector's root; a reason when the stream must end. The report is
// validated and applied to a copy outside the lock (a full snapshot at the
// anchors takes ~0.1 s): only this stream's goroutine changes its node's
// copy, and a newer stream for the node supersedes it.
func (a *Aggregator) apply(n *node, c *conn, r *stream.Report, interval time.Duration) (bool, string, string) {
	now := a.cfg.Clock.Now()
	a.mu.Lock()
	if n.conn != c || !a.leading {
		a.mu.Unlock()
		return true, ReasonProtocol, "stream superseded"
	}
	if r.Seq <= n.lastSeq {
		a.mu.Unlock()
		return false, ReasonReplay, fmt.Sprintf("report seq %d not after %d: replayed or reordered", r.Seq, n.lastSeq)
	}
	n.lastSeq = r.Seq
	hb := audit.Heartbeat{At: now, Interval: interval, Mode: audit.Mode(r.Mode), ReadError: r.ReadError, KubeProxy: kubeProxySignal(r.KubeProxy)}
	if r.ReadError != "" {
		a.judge.Heard(n.name, hb)
		a.mu.Unlock()
		return true, "", ""
	}
	if !r.Full && !n.complete {
		a.mu.Unlock()
		return false, "", "no full snapshot on this stream yet"
	}
	next := *n.state
	a.mu.Unlock()

	match, err := next.Apply(r)

	a.mu.Lock()
	defer a.mu.Unlock()
	if n.conn != c || !a.leading {
		return true, ReasonProtocol, "stream superseded"
	}
	if err != nil {
		return false, ReasonInvalid, "invalid report: " + err.Error()
	}
	*n.state = next
	if !match {
		n.complete = false
		return false, "", "root digest differs from the aggregator's copy"
	}
	n.complete = true
	if r.Full || len(r.Frontends) > 0 || len(r.Removed) > 0 || r.NoRules != n.noRules {
		n.version++
	}
	if r.NoRules && !n.noRules {
		a.cfg.Log.Info("node has no kube-proxy rules (flushed, or kube-proxy not running)", zap.String("node", n.name))
		a.cfg.Metrics.NoRulesSeen.WithLabelValues(n.name).Inc()
	}
	n.noRules = r.NoRules
	n.heard, n.fresh = now, true
	a.judge.Heard(n.name, hb)
	return true, "", ""
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
		EndpointChangesPending: int(k.EndpointChangesPending), ServiceChangesPending: int(k.ServiceChangesPending), Error: clip(k.Error),
		Version: clip(k.Version)}
}

// Evaluate assesses every node that reported since the last call and
// concludes; the loop in Run calls it every second.
func (a *Aggregator) Evaluate() {
	a.mu.Lock()
	leading := a.leading
	a.mu.Unlock()
	if !leading || a.view.Synced() != nil {
		return
	}
	if a.blind() {
		return
	}
	start := a.cfg.Clock.Now()
	type job struct {
		n      *node
		snap   stream.State // a copy: its buckets are immutable
		at     time.Time
		reuse  bool
		noRule bool
	}
	var nodeInfo map[string]audit.NodeInfo
	// A report is judged once the cluster state covers its time (see
	// View.Covered); a later cycle takes the rest.
	covered := a.view.Covered()
	a.view.Read(func(st *audit.State, h *audit.History, gen uint64) {
		nodeInfo = st.Nodes
		var jobs []job
		a.mu.Lock()
		for _, n := range a.nodes {
			if !n.fresh || !n.complete || n.heard.After(covered) {
				continue
			}
			n.fresh = false
			j := job{n: n, at: n.heard, noRule: n.noRules}
			if n.assessedVersion == n.version && n.assessedGen == gen {
				j.reuse = true
			} else {
				j.snap = *n.state
				n.assessedVersion, n.assessedGen = n.version, gen
			}
			jobs = append(jobs, j)
		}
		a.mu.Unlock()
		if a.memoGen != gen || a.memo == nil {
			a.memo, a.memoGen, a.classes = map[[2]uint64][]assessed{}, gen, audit.NodeClasses(st)
		}
		services := servicesProgrammed(st)
		for _, j := range jobs {
			as := j.n.assessments
			if !j.reuse {
				as = a.assessNode(st, h, j.n, &j.snap)
			}
			a.mu.Lock()
			j.n.assessments = as
			lags := a.judge.Observe(j.n.name, j.at, services, j.noRule, as, h)
			a.mu.Unlock()
			for _, l := range lags {
				a.cfg.Metrics.ProgrammingLag.Observe(max(l, 0).Seconds())
			}
		}
	})
	names := a.view.ExpectedNodes()
	a.mu.Lock()
	if !a.leading {
		a.mu.Unlock()
		return
	}
	now := a.cfg.Clock.Now()
	v := a.judge.Evaluate(now, names)
	audit.WarnKnownBad(&v, nodeInfo)
	recovering := now.Before(a.recovering)
	if recovering {
		v = holdBackDrift(v)
	}
	prev := a.verdict
	a.verdict = &v
	asks := a.readNowDue(now, &v, recovering)
	a.mu.Unlock()
	// Each on its own: a collector slow to read its socket must not hold
	// up the evaluation (a write may wait out its 10 s deadline).
	for _, c := range asks {
		go func() {
			a.sent(c.send(&stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "a change is crossing the grace period"}}))
		}()
		a.cfg.Metrics.ReadNow.Inc()
	}
	a.cfg.Metrics.setVerdict(&v)
	a.cfg.Metrics.Reconcile.WithLabelValues("evaluate").Observe(a.cfg.Clock.Since(start).Seconds())
	a.logChanges(prev, &v)
	if !recovering {
		a.remediate(&v)
	}
}

// maxReadNow bounds the read-now requests of one evaluation: a change
// every node lags behind (an API burst) must not make the whole fleet read
// at once.
const maxReadNow = 100

// readNowMinLag is how far behind a node must have been at its last report
// to be asked: under churn a healthy kube-proxy is nearly always a change
// or two behind (its minimum sync period is 1 s), and asking every such
// node would double the fleet's reads (the 500-node simulation sent 5,504
// requests for 10 stuck nodes without it).
const readNowMinLag = 3 * time.Second

// readNowDue picks the lagging nodes whose oldest missing change crossed
// the grace period after their last report, and that were already more
// than readNowMinLag behind then: without a word from them the finding
// waits for their next interval (up to 10 s by default). Each crossing is
// asked once. a.mu held.
func (a *Aggregator) readNowDue(now time.Time, v *audit.Verdict, recovering bool) []*conn {
	if recovering {
		return nil
	}
	var out []*conn
	for _, s := range v.Nodes {
		if s.State != audit.NodeLagging || s.Watermark.IsZero() || s.LastReport.Sub(s.Watermark) < readNowMinLag {
			continue
		}
		due := s.Watermark.Add(a.cfg.Policy.Grace)
		n := a.nodes[s.Node]
		if n == nil || n.conn == nil || now.Before(due) || !n.heard.Before(due) || n.readNowFor.Equal(due) {
			continue
		}
		n.readNowFor = due
		out = append(out, n.conn)
		if len(out) == maxReadNow {
			break
		}
	}
	return out
}

// holdBackDrift keeps only CollectorMissing findings and shows drifted
// nodes as Lagging: right after an API outage every kube-proxy is catching
// up, and one still behind when the recovery grace ends is reported then,
// with its drift dated from when it began.
func holdBackDrift(v audit.Verdict) audit.Verdict {
	var kept []audit.TimedFinding
	for _, f := range v.Findings {
		if f.Kind == audit.CollectorMissing {
			kept = append(kept, f)
		}
	}
	v.Findings = kept
	nodes := make([]audit.NodeStatus, len(v.Nodes))
	for i, n := range v.Nodes {
		if n.State == audit.NodeStuck || n.State == audit.NodeDivergent || n.State == audit.NodeNoRules {
			n.State = audit.NodeLagging
		}
		nodes[i] = n
	}
	v.Nodes = nodes
	return v
}

// Recovering says until when node drift is held back after the view came
// back from stale (zero or past: not recovering).
func (a *Aggregator) Recovering() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.recovering
}

// blind checks the view's freshness. A stale view is not judged from:
// kube-proxies whose watches work would look drifted against it (false
// findings) and repairs would act on them. The last verdict stays, marked
// stale, and one notice goes out when it starts and one when it ends.
func (a *Aggregator) blind() bool {
	since, why := a.view.Stale()
	now := a.cfg.Clock.Now()
	a.mu.Lock()
	was := !a.staleSince.IsZero()
	switch {
	case !since.IsZero():
		if !was || since.Before(a.staleSince) {
			a.staleSince = since
		}
		a.staleWhy, a.freshSince = why, time.Time{}
	case was:
		// A watch that flaps (lists work, watches fail) must not page on
		// every relist: fresh again only after freshAfter without a fault.
		if a.freshSince.IsZero() {
			a.freshSince = now
		}
		if now.Sub(a.freshSince) >= freshAfter {
			a.staleSince, a.staleWhy = time.Time{}, ""
			a.recovering = now.Add(a.cfg.RecoveryGrace)
		}
	}
	stale := !a.staleSince.IsZero()
	staleSince, staleWhy := a.staleSince, a.staleWhy
	a.mu.Unlock()
	a.cfg.Metrics.ViewStale.Set(map[bool]float64{true: 1}[stale])
	if stale == was {
		return stale
	}
	n := remediate.Notice{Action: remediate.Action{Kind: remediate.ViewFresh, Node: remediate.SelfNode,
		Reason: "the aggregator's watches deliver again; judging resumes (a drift shows after the grace period)"}}
	if stale {
		a.cfg.Log.Error("view of the API is stale: findings are unknown, nothing is judged or repaired", zap.Time("since", staleSince), zap.String("why", staleWhy))
		n = remediate.Notice{Action: remediate.Action{Kind: remediate.ViewStale, Node: remediate.SelfNode, Reason: staleWhy}, Since: staleSince}
	} else {
		a.cfg.Log.Info("view of the API is fresh again: judging resumes; node drift held back while kube-proxies reconnect",
			zap.Duration("recovery_grace", a.cfg.RecoveryGrace))
	}
	if a.cfg.Notifier != nil {
		a.cfg.Notifier.Notify(n)
	}
	return stale
}

// freshAfter is how long a stale view must look fresh before judging
// resumes.
const freshAfter = 5 * time.Second

// Stale says since when and why the leader's view is stale (zero: fresh).
func (a *Aggregator) Stale() (time.Time, string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.staleSince, a.staleWhy
}

// logChanges logs findings that appeared or cleared since the last verdict.
func (a *Aggregator) logChanges(prev, cur *audit.Verdict) {
	key := func(f audit.TimedFinding) string {
		return f.Node + "|" + f.Service + "|" + f.Port + "|" + string(f.Kind) + "|" + f.Endpoint
	}
	old := map[string]bool{}
	if prev != nil {
		for _, f := range prev.Findings {
			old[key(f)] = true
		}
	}
	now := map[string]bool{}
	for _, f := range cur.Findings {
		now[key(f)] = true
		if !old[key(f)] {
			a.cfg.Log.Warn("finding", zap.String("node", f.Node), zap.String("kind", string(f.Kind)), zap.String("service", f.Service),
				zap.String("port", f.Port), zap.String("endpoint", f.Endpoint), zap.Time("since", f.Since), zap.String("detail", f.Detail))
		}
	}
	if prev != nil {
		for _, f := range prev.Findings {
			if !now[key(f)] {
				a.cfg.Log.Info("finding cleared", zap.String("node", f.Node), zap.String("kind", string(f.Kind)), zap.String("service", f.Service), zap.String("endpoint", f.Endpoint))
			}
		}
	}
}

// Run evaluates every second until ctx ends.
func (a *Aggregator) Run(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			a.Evaluate()
		}
	}
}

func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
