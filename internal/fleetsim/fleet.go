package fleetsim

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"k8s.io/utils/clock"
)

// Fleet is a set of simulated collectors, one per node, each streaming
// the rules its simulated kube-proxy shows: the Truth as of a per-node
// programming lag, or a frozen version while the node is stuck (the
// incident: kube-proxy's watch died, its syncs and health check go on).
type Fleet struct {
	truth    *Truth
	addrs    []string // every replica's stream address
	interval time.Duration
	// TLS, when set, is the streams' TLS (the chart's default): the
	// aggregators' CA and the name their certificate carries.
	TLS *tls.Config

	nodes []*simNode

	// reports caches encoded reports by transition (from → to version),
	// shared by every node making the same transition.
	rmu     sync.Mutex
	reports map[transitionKey]*transition

	// WriteBlocked is the longest a report waited for the aggregator to
	// read it (ns): a report read late is dated late.
	WriteBlocked atomic.Int64
	BytesSent    atomic.Int64
	// BytesSentRefs is what the nodes naming frontends by hash sent,
	// content asked of them included.
	BytesSentRefs atomic.Int64
	Wants         atomic.Int64 // wants received
	Reports       atomic.Int64
	Resyncs       atomic.Int64
	ReadNows      atomic.Int64 // read-now requests received
	Rejects       atomic.Int64
}

type simNode struct {
	f     *Fleet
	lag   time.Duration
	phase time.Duration
	src   net.IP // source address: the aggregator limits reviews per source

	mu    sync.Mutex
	name  string
	token string   // sent in the hello ("" without authentication)
	conn  net.Conn // the stream up, if any
	// welcomed is when the current stream was welcomed, heard when its
	// first report was written (zero until then).
	welcomed, heard time.Time
	streams         int      // welcomed streams so far
	refs            bool     // offers to name frontends by hash
	tops            bool     // offers to name its state by its top
	frozen          *Version // non-nil while stuck
	shown           *Version // what the node's last read saw
	readAt          time.Time
	sent            *Version // what the aggregator's copy holds
	seq             uint64
	syncs           float64
	last            string // last reject reason
	// built is the last report Report built, from the shared transition
	// t: written as t's encoding with this node's seq and kube-proxy.
	built *stream.Report
	t     *transition
}

// transition is the report moving the aggregator's copy from one version
// to another, shared by every node making it; rest is its encoding after
// `{"seq":0,`, made at its first write.
type transition struct {
	report *stream.Report
	once   sync.Once
	rest   []byte
	err    error
}

type transitionKey struct {
	from, to uint64
	refs     bool
}

// NewFleet prepares n nodes named name(i), reporting every interval to
// the aggregator's replicas at addrs (stream addresses; a follower
// redirects to the leader). Each node's kube-proxy lags the API by a
// programming latency drawn from minLag..maxLag. Each node connects from
// a loopback address of its own (127.64.0.0/10), as collectors come from
// their nodes' addresses.
func NewFleet(truth *Truth, addrs []string, n int, name func(int) string, interval, minLag, maxLag time.Duration) *Fleet {
	f := &Fleet{truth: truth, addrs: addrs, interval: interval, reports: map[transitionKey]*transition{}}
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	for i := range n {
		f.nodes = append(f.nodes, &simNode{
			f:     f,
			name:  name(i),
			lag:   minLag + time.Duration(rng.Int64N(int64(maxLag-minLag)+1)),
			phase: time.Duration(rng.Int64N(int64(interval))),
			src:   net.IPv4(127, 64+byte(i>>16&63), byte(i>>8), byte(i)),
		})
	}
	return f
}

// SetToken gives node i the token its hellos carry from its next
// connection on (the projected ServiceAccount token a collector reads).
func (f *Fleet) SetToken(i int, token string) {
	n := f.nodes[i]
	n.mu.Lock()
	n.token = token
	n.mu.Unlock()
}

// Replace makes node i a new node: the old one left the cluster (its
// stream ends), the new one, named name, connects with token (an
// autoscaler's replacement). Its kube-proxy follows the API.
func (f *Fleet) Replace(i int, name, token string) {
	n := f.nodes[i]
	n.mu.Lock()
	n.name, n.token, n.frozen = name, token, nil
	if n.conn != nil {
		n.conn.Close()
	}
	n.mu.Unlock()
}

// Heard returns, for each node, how long after since the first report of
// a stream welcomed after since was written; nodes not heard since then
// are left out.
func (f *Fleet) Heard(since time.Time) []time.Duration {
	var out []time.Duration
	for _, d := range f.Reconnected(since) {
		out = append(out, d)
	}
	return out
}

// Reconnected is Heard by node name.
func (f *Fleet) Reconnected(since time.Time) map[string]time.Duration {
	out := map[string]time.Duration{}
	for _, n := range f.nodes {
		n.mu.Lock()
		if !n.welcomed.Before(since) && !n.heard.IsZero() {
			out[n.name] = n.heard.Sub(since)
		}
		n.mu.Unlock()
	}
	return out
}

// UseRefs makes the nodes pick says name changed frontends by hash where
// the aggregator accepts it (the others send content, as collectors before
// refs did), and with tops their whole state by its top, as collectors do
// now. Call before Run.
func (f *Fleet) UseRefs(pick func(i int) bool, tops bool) {
	for i, n := range f.nodes {
		n.refs = pick(i)
		n.tops = n.refs && tops
	}
}

// Run connects every node (spread over rampUp) and streams until ctx ends.
func (f *Fleet) Run(ctx context.Context, rampUp time.Duration) {
	var wg sync.WaitGroup
	for i, n := range f.nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The fleet spreads over the interval, as nodes started at
			// different times do.
			delay := time.Duration(int64(rampUp)*int64(i)/int64(len(f.nodes))) + n.phase
			select {
			case <-ctx.Done():
				return
			case <-time.After(delay):
			}
			// The collector's own reconnect policy: redirects, busy slots,
			// backoff with jitter.
			collector.Reconnect(ctx, clock.RealClock{}, func(ctx context.Context, preferred string) (string, bool, error) {
				return f.session(ctx, n, i, preferred)
			}, func(err error, _ time.Duration) {
				if err != nil {
					n.mu.Lock()
					n.last = err.Error()
					n.mu.Unlock()
				}
			})
		}()
	}
	wg.Wait()
}

// Freeze makes node i's kube-proxy stop following the API: its rules stay
// at the version it shows now. It returns that version.
func (f *Fleet) Freeze(i int) *Version {
	n := f.nodes[i]
	v := f.truth.At(time.Now(), n.lag)
	n.mu.Lock()
	n.frozen = v
	n.mu.Unlock()
	return v
}

// Thaw lets node i follow the API again (kube-proxy restarted).
func (f *Fleet) Thaw(i int) {
	n := f.nodes[i]
	n.mu.Lock()
	n.frozen = nil
	n.mu.Unlock()
}

// Sent returns the version node name last reported (nil before any).
func (f *Fleet) Sent(name string) *Version {
	for _, n := range f.nodes {
		n.mu.Lock()
		if n.name == name {
			defer n.mu.Unlock()
			return n.sent
		}
		n.mu.Unlock()
	}
	return nil
}

// Name returns node i's name.
func (f *Fleet) Name(i int) string {
	n := f.nodes[i]
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.name
}

// LastErrors returns the last stream error of nodes that had one.
func (f *Fleet) LastErrors() map[string]string {
	out := map[string]string{}
	for _, n := range f.nodes {
		n.mu.Lock()
		if n.last != "" {
			out[n.name] = n.last
		}
		n.mu.Unlock()
	}
	return out
}

// session is one connection of node n (the i-th): to preferred first,
// then to every replica, starting at one of its own so the fleet spreads.
func (f *Fleet) session(ctx context.Context, n *simNode, i int, preferred string) (string, bool, error) {
	addrs := []string{}
	if preferred != "" {
		addrs = append(addrs, preferred)
	}
	for k := range f.addrs {
		addrs = append(addrs, f.addrs[(i+k)%len(f.addrs)])
	}
	var c net.Conn
	var err error
	for _, a := range addrs {
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: n.src}}
		if c, err = d.DialContext(ctx, "tcp", a); err == nil {
			break
		}
	}
	if c == nil {
		return "", false, err
	}
	if f.TLS != nil {
		tc := tls.Client(c, f.TLS)
		hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := tc.HandshakeContext(hctx)
		cancel()
		if err != nil {
			c.Close()
			return "", false, fmt.Errorf("TLS: %w", err)
		}
		c = tc
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	n.mu.Lock()
	name, token := n.name, n.token
	n.mu.Unlock()
	hello := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: name, Token: token, Version: "fleetsim", IntervalSeconds: f.interval.Seconds(), Refs: n.refs, Tops: n.tops}}
	if err := stream.Write(c, hello); err != nil {
		return "", false, err
	}
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	m, _, err := stream.Read(c, 1<<20)
	if err != nil {
		return "", false, fmt.Errorf("hello: %w", err)
	}
	c.SetReadDeadline(time.Time{})
	if leader, err := collector.HelloOutcome(m); leader != "" || err != nil {
		if m.Type == stream.TypeReject {
			f.Rejects.Add(1)
		}
		return leader, false, err
	}
	n.mu.Lock()
	if n.name != name { // replaced while connecting
		n.mu.Unlock()
		return "", true, errors.New("replaced")
	}
	n.conn, n.welcomed, n.heard = c, time.Now(), time.Time{}
	n.streams++
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		if n.conn == c {
			n.conn = nil
		}
		n.mu.Unlock()
	}()
	// The collector's own session: what it answers, when it reads, its
	// pace, what it keeps to answer wants.
	leader, err := collector.Serve(ctx, n, hello.Hello, m, collector.Stream{
		Conn: c, Interval: f.interval, MaxMessageBytes: 1 << 20,
		Write: f.writer(c, n), Received: f.received,
	})
	return leader, true, err
}

// received counts what the aggregator asks of the fleet.
func (f *Fleet) received(m *stream.Message) {
	switch m.Type {
	case stream.TypeResync:
		f.Resyncs.Add(1)
	case stream.TypeWant:
		f.Wants.Add(1)
	case stream.TypeReadNow:
		f.ReadNows.Add(1)
	case stream.TypeReject:
		f.Rejects.Add(1)
	}
}

// writer writes node n's messages on c: a report it built from a shared
// transition as that transition's encoding with its own seq and
// kube-proxy (one encoding for every node making it), others as the
// collector writes them.
func (f *Fleet) writer(c net.Conn, n *simNode) func([]*stream.Message) error {
	w := bufio.NewWriterSize(c, 64<<10)
	return func(out []*stream.Message) error {
		for _, m := range out {
			frame, err := n.frame(m)
			if err != nil {
				return err
			}
			c.SetWriteDeadline(time.Now().Add(30 * time.Second))
			began := time.Now()
			if _, err := w.Write(frame); err != nil {
				return err
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if d := int64(time.Since(began)); d > f.WriteBlocked.Load() {
				f.WriteBlocked.Store(d)
			}
			f.BytesSent.Add(int64(len(frame)))
			n.mu.Lock()
			if n.refs {
				f.BytesSentRefs.Add(int64(len(frame)))
			}
			if m.Type == stream.TypeReport {
				f.Reports.Add(1)
				if n.heard.IsZero() {
					n.heard = time.Now()
				}
			}
			n.mu.Unlock()
		}
		return nil
	}
}

// frame encodes m as stream.Write does.
func (n *simNode) frame(m *stream.Message) ([]byte, error) {
	n.mu.Lock()
	built, t := n.built, n.t
	n.mu.Unlock()
	var body []byte
	if m.Type == stream.TypeReport && m.Report == built {
		rest, err := t.encoded()
		if err != nil {
			return nil, err
		}
		kp, _ := json.Marshal(built.KubeProxy)
		body = make([]byte, 0, 64+len(kp)+len(rest))
		body = append(body, `{"type":"report","report":{"seq":`...)
		body = strconv.AppendUint(body, built.Seq, 10)
		body = append(body, `,"kubeProxy":`...)
		body = append(body, kp...)
		body = append(body, ',')
		body = append(body, rest...)
		body = append(body, '}')
	} else {
		var err error
		if body, err = json.Marshal(m); err != nil {
			return nil, err
		}
	}
	frame := make([]byte, 4, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	return append(frame, body...), nil
}

// encoded is the transition's report encoded once, without its seq.
func (t *transition) encoded() ([]byte, error) {
	t.once.Do(func() {
		b, err := json.Marshal(t.report)
		const head = `{"seq":0,`
		switch {
		case err != nil:
			t.err = err
		case string(b[:len(head)]) != head:
			t.err = fmt.Errorf("report encoding starts %q, not %q", b[:len(head)], head)
		default:
			t.rest = b[len(head):]
		}
	})
	return t.rest, t.err
}

// Report is the simulated node's read and report (collector.Node): its
// rules are the Truth as of its kube-proxy's lag, or the version it froze
// at while stuck; the report is the shared transition from what the
// aggregator holds, with the node's own seq and kube-proxy signal (its
// syncs go on while stuck: the health check stays green).
func (n *simNode) Report(_ context.Context, sent *stream.State, full bool, why stream.ReadReason, refs bool) *stream.Report {
	now := time.Now()
	n.mu.Lock()
	defer n.mu.Unlock()
	if why != "" || n.shown == nil {
		n.shown, n.readAt = n.frozen, now
		if n.shown == nil {
			n.shown = n.f.truth.At(now, n.lag)
		}
	}
	show := n.shown
	if full || n.sent == nil || n.sent.Seq != show.Seq {
		n.syncs++
	}
	t := n.f.transition(n.sent, show, full, refs)
	*sent = *show.State // as stream.Delta leaves it: the shared version, unchanged
	n.sent = show
	n.seq++
	r := *t.report
	r.Seq = n.seq
	r.KubeProxy = &stream.KubeProxy{LastSync: float64(now.Add(-n.lag).UnixNano()) / 1e9, EndpointChangesTotal: n.syncs}
	n.built, n.t = &r, t
	return &r
}

// Due: a simulated node has no change signal; it reads at every
// heartbeat, as a collector without one does.
func (n *simNode) Due(orElse stream.ReadReason) stream.ReadReason { return orElse }

// ReadWait keeps reads a second apart (the collector's read gap); a
// simulated read costs nothing, so no read budget holds it.
func (n *simNode) ReadWait(now time.Time) time.Duration {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.readAt.IsZero() {
		return 0
	}
	return max(0, time.Second-now.Sub(n.readAt))
}

// Flushed: no flush to see (a simulated node's rules are never flushed).
func (n *simNode) Flushed(context.Context) bool { return false }

// Flush refuses, as a collector without --conntrack-delete does.
func (n *simNode) Flush(_ context.Context, fl *stream.Flush) *stream.Flushed {
	out := &stream.Flushed{Error: "conntrack deletion is off on simulated nodes"}
	if fl != nil {
		out.ID = fl.ID
	}
	return out
}

// LearnPeers: the fleet dials the replicas it was given.
func (n *simNode) LearnPeers(*stream.Peers) {}

// Token is the token SetToken gave (the stream keeps it).
func (n *simNode) Token() (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.token, nil
}

// StartScrape and Scraped: the kube-proxy signal rides in every report.
func (n *simNode) StartScrape(context.Context)    {}
func (n *simNode) Scraped(*stream.KubeProxy) bool { return false }

// transition is the report moving the aggregator's copy from one version
// to another (a full snapshot when full), made once per pair.
func (f *Fleet) transition(from, to *Version, full, refs bool) *transition {
	key := transitionKey{to: to.Seq, refs: refs}
	if !full {
		key.from = from.Seq
	}
	f.rmu.Lock()
	defer f.rmu.Unlock()
	if t, ok := f.reports[key]; ok {
		return t
	}
	prev := stream.NewState()
	if !full {
		cp := *from.State // Delta overwrites *prev: hand it a copy
		prev = &cp
	}
	t := &transition{report: stream.Delta(prev, to.State, 0, full, refs)}
	// Transitions to versions no longer kept are not asked for again.
	// A full snapshot at 100k endpoints is 3 MB: the cache stays small.
	if len(f.reports) > 256 {
		oldest := f.truth.oldest()
		for k := range f.reports {
			if k.to < oldest {
				delete(f.reports, k)
			}
		}
		if len(f.reports) > 256 {
			clear(f.reports)
		}
	}
	f.reports[key] = t
	return t
}

func (t *Truth) oldest() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.versions[0].Seq
}
