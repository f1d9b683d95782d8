package collector

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/tlsfile"
)

// Config is what a collector needs to run.
type Config struct {
	Node string
	// Aggregator is host:port, or a comma-separated list; a host name is
	// resolved to every address (a headless Service lists every replica)
	// and each is tried until one answers (the leader, or a follower that
	// redirects to it).
	Aggregator string
	// Reader reads the rules; nil detects the mode on Host (and retries
	// detection every interval until kube-proxy has programmed the node).
	Reader RuleReader
	// Host is the node's kernel and tools; nil is NewHost().
	Host     *Host
	Interval time.Duration
	// TokenFile is the projected ServiceAccount token, re-read on every
	// connection (the kubelet rotates it).
	TokenFile string
	// TLS, when set, wraps the stream.
	TLS *tls.Config
	// CAFile, when set, is re-read at every connection for TLS.RootCAs:
	// a rotated CA (the Secret's mounted file) is trusted without a
	// restart. A file that no longer loads keeps the last good pool.
	CAFile          string
	MaxMessageBytes int
	Version         string
	Log             *zap.Logger
	// KubeProxyMetrics is kube-proxy's metrics URL, scraped with each read
	// as a second signal; empty disables it.
	KubeProxyMetrics string
	// Clock paces reads, read-now gaps and reconnects (network deadlines
	// stay on the real clock); nil is the real clock.
	Clock clock.WithTicker
	// FullReadInterval is the longest time between two reads of a source
	// with a change signal, for what the signal can miss (default 5m).
	FullReadInterval time.Duration
	// ReadBudget is the share of a core reads may average while the rules
	// keep changing: reads that changes or read-now requests cause wait
	// while reads have spent more than this earns (see readCredit), and
	// start at least 1 s and at most Interval apart. 0 means
	// DefaultReadBudget. ReadBurst is the CPU reads may spend at once
	// after a quiet spell (0: what the budget earns in
	// DefaultReadBurstWindow).
	ReadBudget float64
	ReadBurst  time.Duration
	// Conntrack reads the node's conntrack table; nil: not read.
	// ConntrackInterval is the least time between two reads (a report
	// reads it when that much has passed since the last): a hung
	// kube-proxy changes no rules, so conntrack is read on its own clock.
	Conntrack         ConntrackSource
	ConntrackInterval time.Duration
	// ConntrackDelete lets the aggregator have stale conntrack entries
	// deleted (Flush): the collector's one power beyond reading. Off, a
	// flush is answered with a refusal.
	ConntrackDelete bool
	// Lookup resolves the aggregator's host name; nil is
	// net.DefaultResolver's (tests replace it).
	Lookup func(ctx context.Context, host string) ([]string, error)
}

// ConntrackDeleter deletes the conntrack entries of flush targets
// (ConntrackReader).
type ConntrackDeleter interface {
	Delete(ctx context.Context, targets []FlushTarget) ([]int, error)
}

// ConntrackSource reads what the node's conntrack table holds for its
// frontends (ConntrackReader).
type ConntrackSource interface {
	Read(ctx context.Context, frontends []audit.FrontendKey) (*audit.Conntrack, error)
}

// DefaultReadBudget: 5 % of a core. A whole read at the anchors costs
// 0.5-1.9 s of CPU, so where every read is whole (the legacy backend)
// the collector reads under sustained churn about once an interval (10 s)
// instead of after every kube-proxy commit; a change after a quiet spell
// is still read at once, and reads of changes cost milliseconds.
const DefaultReadBudget = 0.05

// Run connects to the aggregator and reports until ctx ends, reconnecting
// with jittered exponential backoff (1 s to 30 s) and following redirects
// to the leader.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Node == "" {
		return errors.New("node name is empty (set --node-name or NODE_NAME)")
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 10 * time.Second
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Host == nil {
		cfg.Host = NewHost()
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.FullReadInterval <= 0 {
		cfg.FullReadInterval = DefaultFullReadInterval
	}
	if cfg.ReadBudget <= 0 {
		cfg.ReadBudget = DefaultReadBudget
	}
	if cfg.ReadBurst <= 0 {
		cfg.ReadBurst = time.Duration(cfg.ReadBudget * float64(DefaultReadBurstWindow))
	}
	c := &client{cfg: cfg, reader: cfg.Reader, credit: newReadCredit(cfg.ReadBudget, cfg.ReadBurst, cfg.Interval)}
	c.cost.Reads = map[stream.ReadReason]uint64{}
	if src, ok := cfg.Reader.(interface{ Source() Source }); ok {
		c.openSignal(src.Source())
	}
	defer func() {
		if c.signal != nil {
			c.signal.Close()
		}
	}()
	Reconnect(ctx, cfg.Clock, c.session, func(err error, wait time.Duration) {
		switch {
		case IsBusy(err):
			cfg.Log.Info("aggregator busy admitting other collectors", zap.Duration("retry_in", wait))
		case err != nil:
			cfg.Log.Warn("stream to the aggregator ended", zap.Error(err), zap.Duration("retry_in", wait))
		}
	})
	return nil
}

type client struct {
	cfg Config
	// resolved keeps each aggregator name's last answer, from DNS or the
	// aggregator's list of its replicas (learnPeers).
	resolved map[string][]string
	// welcomed: the aggregator welcomed the current session.
	welcomed bool
	reader   RuleReader
	seq      uint64
	lastKP   *stream.KubeProxy // sent on this stream
	// ct is the last conntrack read (or its error) and ctAt when it was
	// made; ctSent the digest of the counts last sent on this stream.
	ct     *stream.Conntrack
	ctAt   time.Time
	ctSent uint64
	// ctKeys are the frontends of the rules at the last conntrack read;
	// ctGone those that left the rules since, and when: their flows are
	// still counted for ctRemember, and may be flushed. A service left
	// with no endpoints leaves the NAT rules (kube-proxy rejects it in
	// the filter table), and kube-proxy leaves its UDP entries alone.
	ctKeys map[audit.FrontendKey]bool
	ctGone map[audit.FrontendKey]time.Time
	http   http.Client

	// The last successful read, kept across streams: its state, the
	// change signal's token it reflects, and when it began.
	cached *stream.State
	token  uint64
	readAt time.Time

	signal      ChangeSignal
	signalTried bool
	// fed: the signal hands its notifications to the reader, whose reads
	// of changes say which generation they reflect.
	fed bool
	// legacy: the signal is the legacy backend's, which kube-proxy's own
	// sync time completes.
	legacy bool
	// kp is kube-proxy's metrics as last scraped; kpSyncAtRead its last
	// sync time as of the last read.
	kp           *stream.KubeProxy
	kpSyncAtRead float64
	// scraped delivers a heartbeat's scrape, run off the stream's loop: a
	// frozen kube-proxy holds a scrape for its whole timeout (3 s), and
	// that must not delay the heartbeat (an IPVS node at a 2 s interval
	// looked CollectorMissing while its kube-proxy was frozen).
	scraped  chan *stream.KubeProxy
	scraping bool

	// fallbacksSeen is the reader's count of fallbacks to the text tool
	// as last logged.
	fallbacksSeen uint64
	// credit is the read budget (see readCredit).
	credit *readCredit

	cost struct {
		Reads                       map[stream.ReadReason]uint64
		LastSeconds, LastCPUSeconds float64
		LastBytes                   int64
	}
	statsChanged bool
}

// addresses resolves the aggregator (host:port, or several separated by
// commas) to every address, the preferred first.
func (c *client) addresses(ctx context.Context, preferred string) ([]string, error) {
	var out []string
	if preferred != "" {
		out = append(out, preferred)
	}
	var errs []error
	for _, a := range strings.Split(c.cfg.Aggregator, ",") {
		host, port, err := net.SplitHostPort(strings.TrimSpace(a))
		if err != nil {
			return nil, fmt.Errorf("--aggregator %q: want host:port", a)
		}
		if net.ParseIP(host) != nil {
			out = append(out, net.JoinHostPort(host, port))
			continue
		}
		lookup := c.cfg.Lookup
		if lookup == nil {
			lookup = net.DefaultResolver.LookupHost
		}
		ips, err := lookup(ctx, host)
		if err != nil {
			// The node's DNS goes to the cluster DNS Service through this
			// node's own kube-proxy: when that kube-proxy is stale and the
			// DNS pods moved, the name cannot be resolved, which is when
			// the node must be heard. Use what it resolved to last.
			if last := c.resolved[host]; len(last) > 0 {
				c.cfg.Log.Warn("cannot resolve the aggregator: using the addresses it resolved to last (the node's DNS goes through its own kube-proxy, which may be stale)",
					zap.String("host", host), zap.Strings("addresses", last), zap.Error(err))
				ips = last
			} else {
				errs = append(errs, fmt.Errorf("resolve %s: %w", host, err))
				continue
			}
		} else {
			if c.resolved == nil {
				c.resolved = map[string][]string{}
			}
			c.resolved[host] = ips
		}
		for _, ip := range ips {
			out = append(out, net.JoinHostPort(ip, port))
		}
	}
	return out, errors.Join(errs...)
}

// learnPeers keeps the aggregator replicas' addresses the aggregator sent
// as what each aggregator name resolves to, for when it cannot be
// resolved: a rollout during a DNS outage replaces every replica, and the
// collector has heard of the new ones while connected to the old.
func (c *client) learnPeers(p *stream.Peers) {
	if p == nil {
		return
	}
	if err := p.Check(); err != nil {
		c.cfg.Log.Warn("ignoring the aggregator's list of replicas", zap.Error(err))
		return
	}
	for _, a := range strings.Split(c.cfg.Aggregator, ",") {
		host, _, err := net.SplitHostPort(strings.TrimSpace(a))
		if err != nil || net.ParseIP(host) != nil {
			continue
		}
		if c.resolved == nil {
			c.resolved = map[string][]string{}
		}
		if !slices.Equal(slices.Sorted(slices.Values(c.resolved[host])), slices.Sorted(slices.Values(p.IPs))) { // DNS answers in any order
			c.cfg.Log.Info("the aggregator named its replicas: dialed when the name cannot be resolved", zap.String("host", host), zap.Strings("addresses", p.IPs))
		}
		c.resolved[host] = slices.Clone(p.IPs)
	}
}

// session runs one connection (a Session for Reconnect).
func (c *client) session(ctx context.Context, preferred string) (string, bool, error) {
	c.welcomed = false
	leader, err := c.connect(ctx, preferred)
	if leader != "" {
		c.cfg.Log.Info("following the aggregator leader", zap.String("leader", leader))
	}
	return leader, c.welcomed, err
}

// connect runs one connection. It returns the leader's address when the
// aggregator redirects, or the error that ended it.
func (c *client) connect(ctx context.Context, preferred string) (string, error) {
	addrs, err := c.addresses(ctx, preferred)
	if len(addrs) == 0 {
		return "", err
	}
	var conn net.Conn
	var errs []error
	for _, a := range addrs {
		d := net.Dialer{Timeout: 5 * time.Second}
		if c.cfg.TLS != nil {
			if c.cfg.CAFile != "" {
				if pool, err := tlsfile.LoadCA(c.cfg.CAFile); err == nil {
					c.cfg.TLS = c.cfg.TLS.Clone()
					c.cfg.TLS.RootCAs = pool
				} else {
					c.cfg.Log.Warn("cannot re-read the CA bundle: verifying with the one read before", zap.Error(err))
				}
			}
			conn, err = (&tls.Dialer{NetDialer: &d, Config: c.cfg.TLS}).DialContext(ctx, "tcp", a)
		} else {
			conn, err = d.DialContext(ctx, "tcp", a)
		}
		if err == nil {
			break
		}
		errs = append(errs, err)
	}
	if conn == nil {
		return "", fmt.Errorf("no aggregator reachable: %w", errors.Join(errs...))
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()

	token, err := c.credentials()
	if err != nil {
		return "", err
	}
	hello := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{
		Node: c.cfg.Node, Token: token, Version: c.cfg.Version, IntervalSeconds: c.cfg.Interval.Seconds(), Refs: true, Tops: true}}
	if err := stream.Write(conn, hello); err != nil {
		return "", err
	}
	conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	reply, _, err := stream.Read(conn, c.cfg.MaxMessageBytes)
	if err != nil {
		return "", fmt.Errorf("waiting for the aggregator's answer: %w", err)
	}
	conn.SetReadDeadline(time.Time{})
	// A follower's answer names the replicas too: while the Lease still
	// names a leader that is gone, a rollout can replace the follower
	// before this collector reaches any leader.
	if reply.Peers != nil {
		c.learnPeers(reply.Peers)
	}
	if leader, err := HelloOutcome(reply); leader != "" || err != nil {
		return leader, err
	}
	c.welcomed = true
	// refs: changed frontends go as their hashes; the aggregator asks for
	// the content of those no node sent it yet. An aggregator that does
	// not say so gets content.
	refs := reply.Welcome != nil && reply.Welcome.Refs
	// tops: a report of changes names the whole state it moves to; the
	// aggregator asks one level down (bucket names, changed frontends,
	// content) only for what no node's copy holds.
	tops := refs && reply.Welcome.Tops
	c.cfg.Log.Info("streaming to the aggregator", zap.String("aggregator", conn.RemoteAddr().String()), zap.Bool("refs", refs), zap.Bool("tops", tops))

	// The aggregator may ask for a resync or a read, or name a new leader,
	// at any time.
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
	sent := stream.NewState()
	c.lastKP, c.ctSent = nil, 0
	// full: the next report carries every frontend (a new stream, a
	// resync, or the full snapshot a read error kept from being sent).
	full := true
	// recent are what the last reports of changes moved the aggregator
	// from and to, newest last: a Want names a report, and a newer report
	// may have changed the state since.
	var recent []stream.Sent
	next := func(why stream.ReadReason) *stream.Report {
		before := *sent
		r := c.report(ctx, sent, full, why, refs)
		if r.ReadError == "" {
			full = false
			if refs && (r.Full || len(r.Frontends)+len(r.Refs)+len(r.Removed) > 0) {
				if r.Full {
					before = stream.State{} // a full snapshot moves the other end from nothing
				}
				recent = append(recent[max(0, len(recent)-wantHistory+1):], stream.Sent{Seq: r.Seq, Prev: before, Next: *sent})
				if tops {
					// A full snapshot too: after a leader change the whole
					// fleet sends one at once, and most name a state
					// another node's copy already holds.
					r = r.ByTop(sent)
				}
			}
		}
		return r
	}
	send := func(r *stream.Report) error {
		return stream.Write(conn, &stream.Message{Type: stream.TypeReport, Report: r})
	}
	// A new stream starts with a full snapshot: of what the last read saw
	// when nothing changed since (a leader change reconnects the fleet at
	// once; it must not make every node read), else of a new read.
	if err := send(next(c.due(stream.ReadResync))); err != nil {
		return "", err
	}
	tick := c.cfg.Clock.NewTicker(c.cfg.Interval)
	defer tick.Stop()
	var (
		settle  <-chan time.Time  // a change announced, waiting to settle
		pending stream.ReadReason // a read waiting out minReadGap
		soon    <-chan time.Time
	)
	// readOrWait reads for why now, or once the read gap has passed since
	// the last read began.
	readOrWait := func(why stream.ReadReason) *stream.Report {
		now := c.cfg.Clock.Now()
		if left := readWait(now.Sub(c.readAt), c.credit.wait(now), c.cfg.Interval); left > 0 && !c.readAt.IsZero() {
			if pending == "" {
				pending, soon = why, c.cfg.Clock.After(left)
			}
			return nil
		}
		pending, soon = "", nil
		return next(why)
	}
	for {
		var r *stream.Report
		select {
		case <-ctx.Done():
			return "", nil
		case err := <-readErr:
			return "", err
		case m := <-incoming:
			switch m.Type {
			case stream.TypeResync:
				full = true
				r = next(c.due(stream.ReadResync))
			case stream.TypeWant:
				if m.Want == nil {
					continue
				}
				if err := stream.Write(conn, &stream.Message{Type: stream.TypeContent, Content: stream.Reply(m.Want, recent)}); err != nil {
					return "", err
				}
				continue
			case stream.TypeFlush:
				if err := stream.Write(conn, &stream.Message{Type: stream.TypeFlushed, Flushed: c.flush(ctx, m.Flush)}); err != nil {
					return "", err
				}
				continue
			case stream.TypeReadNow:
				// Reads start at least minReadGap apart: a read costs
				// seconds of CPU at the anchors. A request inside the gap
				// is answered when it ends.
				r = readOrWait(stream.ReadAsked)
			case stream.TypePeers:
				c.learnPeers(m.Peers)
				continue
			case stream.TypeRedirect:
				if m.Redirect != nil && m.Redirect.Leader != "" {
					return m.Redirect.Leader, nil
				}
			case stream.TypeReject:
				if m.Reject != nil {
					return "", fmt.Errorf("aggregator ended the stream: %s", m.Reject.Reason)
				}
				return "", errors.New("aggregator ended the stream")
			}
		case <-c.events():
			if settle == nil {
				settle = c.cfg.Clock.After(settleDelay)
			}
		case <-settle:
			settle = nil
			if why := c.due(""); why != "" {
				r = readOrWait(why)
			}
		case <-soon:
			r = readOrWait(pending)
		case kp := <-c.scraped:
			c.kp, c.scraping = kp, false
			// On the legacy backend kube-proxy's sync time is part of the
			// change signal: a pod swap keeps the table's size.
			if c.legacy {
				if why := c.due(""); why != "" {
					r = readOrWait(why)
				}
			}
		case <-tick.C():
			// The heartbeat: a read when something changed or the backstop
			// is due, else a report of the last read (a steady node sends
			// its root digest). kube-proxy's metrics arrive on their own.
			c.scrapeAsync(ctx)
			// The kubelet rotates the projected token long before it
			// expires; the stream lives on with the new one.
			if fresh, err := c.credentials(); err != nil {
				c.cfg.Log.Warn("cannot re-read the token; the stream ends when the current one expires", zap.Error(err))
			} else if fresh != token {
				if err := stream.Write(conn, &stream.Message{Type: stream.TypeAuth, Auth: &stream.Auth{Token: fresh}}); err != nil {
					return "", err
				}
				token = fresh
			}
			if why := c.due(stream.ReadHeartbeat); why != "" {
				r = readOrWait(why)
			} else {
				r = next("")
			}
		}
		if r != nil {
			if err := send(r); err != nil {
				return "", err
			}
		}
	}
}

// flush acts on the aggregator's request to delete stale conntrack
// entries, deciding for itself what it may delete: a pair is refused when
// the frontend is neither in the node's rules as last read nor one that
// left them lately (ctGone), or when those rules still send it to the
// destination (a live endpoint: an aggregator
// that is wrong or compromised cannot cut flows the node serves). What is
// left is deleted as FlushTarget says: UDP, and TCP only for connection
// attempts never answered.
func (c *client) flush(ctx context.Context, f *stream.Flush) *stream.Flushed {
	if f == nil {
		return &stream.Flushed{Error: "an empty flush request"}
	}
	out := &stream.Flushed{ID: f.ID}
	del, ok := c.cfg.Conntrack.(ConntrackDeleter)
	switch {
	case !c.cfg.ConntrackDelete || !ok:
		out.Error = "conntrack deletion is off on this collector (--conntrack-delete; the chart's remediation.conntrack.enabled)"
	case c.cached == nil:
		out.Error = "no rules read yet on this node: nothing is deleted before they are"
	}
	if err := f.Check(); err != nil && out.Error == "" {
		out.Error = "invalid flush request: " + err.Error()
	}
	if out.Error != "" {
		c.cfg.Log.Warn("conntrack flush refused", zap.String("why", out.Error))
		return out
	}
	out.Results = make([]stream.FlushResult, len(f.Pairs))
	var targets []FlushTarget
	var index []int
	var explicit map[audit.FrontendKey]bool // the rules' frontends that are not node ports, for node ports' targets
	for i, p := range f.Pairs {
		fe, _ := stream.ParseKey(p.Frontend) // Check parsed both
		dest, _ := netip.ParseAddrPort(p.Dest)
		if why := c.serves(p.Frontend, dest); why != "" {
			out.Results[i].Refused = why
			continue
		}
		t := FlushTarget{Frontend: fe, Dest: dest, TCP: p.TCP}
		if fe.NodePort {
			if explicit == nil {
				explicit = map[audit.FrontendKey]bool{}
				c.cached.ParsedKeys(func(_ string, k audit.FrontendKey) {
					if !k.NodePort {
						explicit[audit.FrontendKey{IP: k.IP.Unmap(), Protocol: k.Protocol, Port: k.Port}] = true
					}
				})
			}
			t.Explicit = explicit
		}
		targets = append(targets, t)
		index = append(index, i)
	}
	if len(targets) > 0 {
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		deleted, err := del.Delete(dctx, targets)
		cancel()
		for j, n := range deleted {
			out.Results[index[j]].Deleted = n
		}
		if err != nil {
			out.Error = err.Error()
		}
		// The counts the aggregator judges change now, not at the next
		// conntrack interval.
		c.ct = nil
	}
	c.cfg.Log.Info("conntrack flush", zap.Uint64("id", f.ID), zap.Any("results", out.Results), zap.String("error", out.Error))
	return out
}

// serves says why the node's rules forbid deleting frontend's flows to
// dest ("" when they do not): the frontend is not one of the node's, or
// its rules still send it there.
func (c *client) serves(frontend string, dest netip.AddrPort) string {
	fe, ok := c.cached.Get(frontend)
	if !ok {
		if k, err := stream.ParseKey(frontend); err == nil {
			if _, gone := c.ctGone[k]; gone {
				return "" // left the rules: they send it nowhere
			}
		}
		return "not a frontend of this node's rules, now or in the last " + ctRemember.String()
	}
	for _, e := range fe.Endpoints {
		if ap, err := netip.ParseAddrPort(e); err == nil && ap.Addr().Unmap() == dest.Addr().Unmap() && ap.Port() == dest.Port() {
			return "this node's rules still send " + frontend + " to " + dest.String() + ": a live endpoint, never flushed"
		}
	}
	return ""
}

// wantHistory is how many recent reports of changes answer a Want: with
// the state the oldest moved from, four states are kept (at the anchors a
// state is a few MB of the collector's heap).
const wantHistory = 3

// credentials reads the projected ServiceAccount token ("" without a file).
func (c *client) credentials() (string, error) {
	if c.cfg.TokenFile == "" {
		return "", nil
	}
	b, err := os.ReadFile(c.cfg.TokenFile)
	if err != nil {
		return "", fmt.Errorf("read the token: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}

// DefaultFullReadInterval bounds how long a change a signal missed can go
// unseen.
const DefaultFullReadInterval = 5 * time.Minute

// exactBackstop stretches the backstop where the signal is exact (the
// nf_tables generation: nothing to miss): with the default
// FullReadInterval, one read an hour, as kube-proxy's own full resync. At
// the anchors one nftables read costs ~0.5 s of CPU: every 5 minutes that
// was most of a quiet node's cost.
const exactBackstop = 12

// minReadGap is the least time between the starts of two reads that the
// aggregator's read-now requests or announced changes can cause.
const minReadGap = time.Second

// readWait is how long a read that a change or a read-now request causes
// waits: until minReadGap has passed since the last read began and the
// read budget is out of debt, but never beyond the heartbeat interval
// after that read, so a node under churn still reports what it shows at
// least once an interval.
func readWait(sinceLast, budgetWait, interval time.Duration) time.Duration {
	left := max(minReadGap-sinceLast, budgetWait)
	return min(left, max(interval, minReadGap)-sinceLast)
}

// settleDelay lets a burst of announced commits (kube-proxy's sync of
// several tables, a partial restore) end before the read.
const settleDelay = 100 * time.Millisecond

// events are the change signal's announcements (nil: none).
func (c *client) events() <-chan struct{} {
	if c.signal == nil {
		return nil
	}
	return c.signal.Events()
}

// due says why the rules need a read now, or "" when the last read still
// shows them: its token unchanged and younger than FullReadInterval.
// orElse is the reason when there is no last read or no usable signal.
func (c *client) due(orElse stream.ReadReason) stream.ReadReason {
	if c.cached == nil || c.signal == nil {
		return orElse
	}
	backstop := c.cfg.FullReadInterval
	if c.signal.Exact() {
		backstop *= exactBackstop
	}
	if c.cfg.Clock.Since(c.readAt) >= backstop {
		return stream.ReadBackstop
	}
	tok, err := c.signal.Token()
	if err != nil {
		c.cfg.Log.Warn("cannot check whether the rules changed; reading them", zap.Error(err))
		return orElse
	}
	if tok != c.token {
		return stream.ReadChange
	}
	if c.legacy {
		// The legacy signal does not see a rewrite that keeps the table's
		// size, and kube-proxy replacing one pod by another is such a
		// rewrite: its own last-sync time says it wrote. Without its
		// metrics, every heartbeat reads.
		if c.kp == nil || c.kp.Error != "" || c.kp.LastSync == 0 {
			return orElse
		}
		if c.kp.LastSync != c.kpSyncAtRead {
			return stream.ReadChange
		}
	}
	return ""
}

// scrape reads kube-proxy's metrics (the second signal, and on the legacy
// backend part of the change signal).
func (c *client) scrape(ctx context.Context) {
	if c.cfg.KubeProxyMetrics != "" {
		c.kp = ScrapeKubeProxy(ctx, &c.http, c.cfg.KubeProxyMetrics)
	}
}

// scrapeAsync starts a scrape whose result arrives on c.scraped, unless
// one is still running (a frozen kube-proxy: one scrape at a time).
func (c *client) scrapeAsync(ctx context.Context) {
	if c.cfg.KubeProxyMetrics == "" || c.scraping {
		return
	}
	if c.scraped == nil {
		c.scraped = make(chan *stream.KubeProxy, 1)
	}
	c.scraping = true
	go func() { c.scraped <- ScrapeKubeProxy(ctx, &c.http, c.cfg.KubeProxyMetrics) }()
}

// report builds the next report against what was sent: of a new read when
// why is set, else of the last read.
func (c *client) report(ctx context.Context, sent *stream.State, full bool, why stream.ReadReason, refs bool) *stream.Report {
	c.seq++
	var r *stream.Report
	if why != "" || c.cached == nil {
		if why == "" {
			why = stream.ReadResync
		}
		if err := c.read(ctx, why); err != nil {
			c.cfg.Log.Warn("cannot read kube-proxy's rules", zap.Error(err))
			r = &stream.Report{Seq: c.seq, Root: sent.Root(), Mode: sent.Mode, ReadError: err.Error(), Reads: c.stats()}
		}
	}
	if r == nil {
		r = stream.Delta(sent, c.cached, c.seq, full, refs)
		if c.statsChanged {
			r.Reads, c.statsChanged = c.stats(), false
		}
	}
	if kp := c.kp; kp != nil && (c.lastKP == nil || *kp != *c.lastKP) {
		r.KubeProxy, c.lastKP = kp, kp
	}
	c.conntrack(ctx, r)
	return r
}

// conntrack reads the conntrack table when ConntrackInterval has passed
// since the last read, and puts the counts in r when they differ from
// those last sent on this stream by more than noise.
func (c *client) conntrack(ctx context.Context, r *stream.Report) {
	if c.cfg.Conntrack == nil || c.cached == nil {
		return
	}
	if now := c.cfg.Clock.Now(); c.ct == nil || now.Sub(c.ctAt) >= c.cfg.ConntrackInterval {
		keys := c.conntrackKeys(now)
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ct, err := c.cfg.Conntrack.Read(rctx, keys)
		cancel()
		c.ctAt = now
		if err != nil {
			c.cfg.Log.Warn("cannot read the conntrack table", zap.Error(err))
			c.ct = &stream.Conntrack{Error: err.Error()}
		} else {
			c.ct = stream.FromConntrack(ct)
		}
	}
	if d := c.ct.Digest(); d != c.ctSent {
		r.Conntrack, c.ctSent = c.ct, d
	}
}

// ctRemember is how long the flows of a frontend that left the node's
// rules are still counted (a statsd client pinned to a service scaled to
// zero sent into a gone pod for 13 hours: kubernetes#139628), and
// ctMaxGone how many such frontends are remembered.
const (
	ctRemember = 24 * time.Hour
	ctMaxGone  = 50_000
)

// conntrackKeys are the frontends whose flows a conntrack read counts:
// those of the rules as last read, and those that left them within
// ctRemember.
func (c *client) conntrackKeys(now time.Time) []audit.FrontendKey {
	cur := map[audit.FrontendKey]bool{}
	c.cached.ParsedKeys(func(_ string, k audit.FrontendKey) { cur[k] = true })
	if c.ctGone == nil {
		c.ctGone = map[audit.FrontendKey]time.Time{}
	}
	for k := range c.ctKeys {
		if !cur[k] && len(c.ctGone) < ctMaxGone {
			c.ctGone[k] = now
		}
	}
	keys := make([]audit.FrontendKey, 0, len(cur)+len(c.ctGone))
	for k, at := range c.ctGone {
		if cur[k] || now.Sub(at) > ctRemember {
			delete(c.ctGone, k)
			continue
		}
		keys = append(keys, k)
	}
	for k := range cur {
		keys = append(keys, k)
	}
	c.ctKeys = cur
	return keys
}

// read reads the rules once, with the token it reflects, and counts it.
func (c *client) read(ctx context.Context, why stream.ReadReason) error {
	if c.reader == nil {
		src, err := c.cfg.Host.Detect(ctx)
		if err != nil {
			return err
		}
		c.cfg.Log.Info("detected kube-proxy mode", zap.Stringer("mode", src))
		c.reader = c.cfg.Host.Reader(src)
		c.openSignal(src)
	}
	var tok uint64
	var tokErr error
	if c.signal != nil {
		// Before the read: a commit during it moves the token again.
		tok, tokErr = c.signal.Token()
	}
	rctx, cancel := context.WithTimeout(ctx, max(c.cfg.Interval, 30*time.Second))
	defer cancel()
	// kube-proxy's metrics as last scraped (each heartbeat scrapes once:
	// a frozen kube-proxy holds a scrape for its whole timeout): a sync
	// after them moves them again, and the legacy signal reads once more.
	if c.kp == nil {
		c.scrape(ctx)
	}
	var kpSync float64
	if c.kp != nil {
		kpSync = c.kp.LastSync
	}
	c.readAt = c.cfg.Clock.Now()
	before := cpuTime()
	start := time.Now()
	var obs *audit.Observed
	var changes *Changes
	var err error
	if cr, ok := c.reader.(ChangeReader); ok && c.cached != nil {
		// Only what changed since the last read (the reader says when it
		// read everything).
		changes, err = cr.ReadChanges(rctx)
		if err == nil && changes.Whole != nil {
			obs, changes = changes.Whole, nil
		}
	} else {
		obs, err = c.reader.Read(rctx)
	}
	c.cost.Reads[why]++
	c.cost.LastSeconds = time.Since(start).Seconds()
	spent := cpuTime() - before
	c.cost.LastCPUSeconds = spent.Seconds()
	c.credit.spend(c.cfg.Clock.Now(), spent)
	if b, ok := c.reader.(interface{ BytesRead() int64 }); ok {
		c.cost.LastBytes = b.BytesRead()
	}
	c.statsChanged = true
	if f, ok := c.reader.(interface{ Fallbacks() (uint64, string) }); ok {
		if n, why := f.Fallbacks(); n > c.fallbacksSeen {
			c.cfg.Log.Warn("the kernel reader could not decode a rule and read the rules with the text tool instead; this node's reads are slow until that rule goes",
				zap.String("reader", c.reader.String()), zap.String("why", why), zap.Uint64("fallbacks", n))
			c.fallbacksSeen = n
		}
	}
	if err != nil {
		return err
	}
	if changes != nil {
		c.cached = applyChanges(c.cached, changes)
	} else {
		c.cached = stream.FromModel(obs)
	}
	c.token, c.kpSyncAtRead = tok, kpSync
	if changes != nil && c.fed {
		// A read of notified changes shows the commits its notes
		// covered (see Changes.Through).
		c.token = changes.Through
	}
	if tokErr != nil {
		c.token = 0 // unknown: the next check reads again
	}
	return nil
}

// applyChanges is the state after a read of changes: the frontends that
// changed put, those gone removed, the rest shared with the state before.
func applyChanges(s *stream.State, ch *Changes) *stream.State {
	removed := make([]string, len(ch.Removed))
	for i, k := range ch.Removed {
		removed[i] = stream.KeyString(k)
	}
	fs := make([]stream.Frontend, len(ch.Frontends))
	for i, f := range ch.Frontends {
		fs[i] = stream.FromObserved(f)
	}
	next := s.With(removed, fs)
	next.Mode, next.NoRules, next.Families = string(ch.Mode), ch.NoRules, slices.Clone(ch.Families)
	return next
}

// openSignal opens the change signal of the detected (or configured)
// source, once. Without one every heartbeat reads.
func (c *client) openSignal(src Source) {
	if c.signalTried || c.cfg.Host.OpenSignal == nil {
		return
	}
	c.signalTried = true
	sig, err := c.cfg.Host.OpenSignal(src)
	switch {
	case err != nil:
		c.cfg.Log.Warn("no change signal for these rules: reading them every interval", zap.Stringer("mode", src), zap.Error(err))
	case sig == nil:
		c.cfg.Log.Info("this mode has no change signal: reading the rules every interval", zap.Stringer("mode", src))
	default:
		c.signal, c.legacy = sig, src.Legacy
		// The nftables reader learns new maps from the notifications the
		// signal receives anyway, instead of dumping each.
		if f, ok := sig.(interface{ Feed(NotificationSink) }); ok {
			if sink, ok := c.reader.(NotificationSink); ok {
				f.Feed(sink)
				c.fed = true
			}
		}
	}
}

// stats is the read cost as sent to the aggregator.
func (c *client) stats() *stream.ReadStats {
	rs := &stream.ReadStats{Reads: map[stream.ReadReason]uint64{}, LastSeconds: c.cost.LastSeconds, LastBytes: c.cost.LastBytes,
		LastCPUSeconds: c.cost.LastCPUSeconds, FullReadIntervalSeconds: c.cfg.FullReadInterval.Seconds()}
	if c.signal != nil {
		rs.SignalLost = c.signal.Lost()
	}
	if c.reader != nil {
		rs.Reader = clipText(c.reader.String())
	}
	if f, ok := c.reader.(interface{ Fallbacks() (uint64, string) }); ok {
		n, why := f.Fallbacks()
		rs.Fallbacks, rs.FallbackReason = n, clipText(why)
	}
	for k, v := range c.cost.Reads {
		rs.Reads[k] = v
	}
	return rs
}

// clipText keeps at most 500 bytes of a text the aggregator shows.
func clipText(s string) string {
	if len(s) > 500 {
		return s[:500]
	}
	return s
}

// cpuTime is the CPU this process and the children it waited for used.
func cpuTime() time.Duration {
	var self, kids syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &kids)
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}
