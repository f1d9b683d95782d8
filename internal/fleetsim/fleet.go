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
	reports map[transitionKey]*encoded

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
	sent            *Version // what the aggregator's copy holds
	before          *Version // what it held before the last report
	full            bool     // the next report is a full snapshot
	seq             uint64
	changed         uint64 // seq of the last report that changed the state
	changedFull     bool   // and whether it was a full snapshot
	syncs           float64
	last            string // last reject reason
}

// encoded is a report without its seq: the frame is prefix + seq + rest.
type encoded struct {
	rest []byte // the report's JSON after `{"seq":0,`
}

type transitionKey struct {
	from, to   uint64
	refs, tops bool
}

// NewFleet prepares n nodes named name(i), reporting every interval to
// the aggregator's replicas at addrs (stream addresses; a follower
// redirects to the leader). Each node's kube-proxy lags the API by a
// programming latency drawn from minLag..maxLag. Each node connects from
// a loopback address of its own (127.64.0.0/10), as collectors come from
// their nodes' addresses.
func NewFleet(truth *Truth, addrs []string, n int, name func(int) string, interval, minLag, maxLag time.Duration) *Fleet {
	f := &Fleet{truth: truth, addrs: addrs, interval: interval, reports: map[transitionKey]*encoded{}}
	rng := rand.New(rand.NewPCG(1, uint64(n)))
	for i := range n {
		f.nodes = append(f.nodes, &simNode{
			name:  name(i),
			lag:   minLag + time.Duration(rng.Int64N(int64(maxLag-minLag)+1)),
			phase: time.Duration(rng.Int64N(int64(interval))),
			full:  true,
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
			delay := time.Duration(int64(rampUp) * int64(i) / int64(len(f.nodes)))
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
	first := n.streams == 1
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		if n.conn == c {
			n.conn = nil
		}
		n.mu.Unlock()
	}()
	return "", true, f.stream(ctx, c, n, m, first)
}

// stream runs a welcomed stream until it ends.
func (f *Fleet) stream(ctx context.Context, c net.Conn, n *simNode, m *stream.Message, first bool) error {
	w := bufio.NewWriterSize(c, 64<<10)
	refs := n.refs && m.Welcome != nil && m.Welcome.Refs
	tops := refs && n.tops && m.Welcome.Tops
	n.mu.Lock()
	n.full, n.sent, n.before = true, nil, nil
	n.mu.Unlock()
	// The aggregator asks for a full snapshot when its copy differs, and
	// for a read at once when a change the node missed crosses grace.
	errc := make(chan error, 1)
	readNow := make(chan struct{}, 1)
	wants := make(chan *stream.Want, 4)
	go func() {
		for {
			m, _, err := stream.Read(c, 1<<20)
			if err != nil {
				errc <- err
				return
			}
			switch m.Type {
			case stream.TypeResync:
				f.Resyncs.Add(1)
				n.mu.Lock()
				n.full = true
				n.mu.Unlock()
			case stream.TypeWant:
				f.Wants.Add(1)
				if m.Want != nil {
					select {
					case wants <- m.Want:
					case <-ctx.Done():
						return
					}
				}
			case stream.TypeReadNow:
				f.ReadNows.Add(1)
				select {
				case readNow <- struct{}{}:
				default:
				}
			case stream.TypeReject:
				f.Rejects.Add(1)
				errc <- fmt.Errorf("rejected: %s", m.Reject.Reason)
				return
			}
		}
	}()
	// The first stream starts at the node's phase in the interval (the
	// fleet spreads); a collector whose stream was replaced resends what
	// it read last at once.
	if first {
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case <-time.After(n.phase):
		}
	}
	tick := time.NewTicker(f.interval)
	defer tick.Stop()
	sent := func(frame []byte) {
		f.BytesSent.Add(int64(len(frame)))
		if refs {
			f.BytesSentRefs.Add(int64(len(frame)))
		}
	}
	for {
		frame, err := f.report(n, time.Now(), refs, tops)
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
		sent(frame)
		f.Reports.Add(1)
		n.mu.Lock()
		if n.heard.IsZero() {
			n.heard = time.Now()
		}
		n.mu.Unlock()
	wait:
		select {
		case <-ctx.Done():
			return nil
		case err := <-errc:
			return err
		case want := <-wants:
			// As the collector: the next level down of what the last
			// report of a change named, from the versions it moved the
			// aggregator from and to.
			n.mu.Lock()
			var recent []stream.Sent
			if n.before != nil {
				recent = append(recent, stream.Sent{Next: *n.before.State})
			}
			if n.sent != nil {
				last := stream.Sent{Seq: n.changed, Next: *n.sent.State}
				if n.before != nil && !n.changedFull {
					last.Prev = *n.before.State
				}
				recent = append(recent, last)
			}
			n.mu.Unlock()
			m := &stream.Message{Type: stream.TypeContent, Content: stream.Reply(want, recent)}
			body, err := json.Marshal(m)
			if err != nil {
				return err
			}
			frame := append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
			if _, err := w.Write(frame); err != nil {
				return err
			}
			if err := w.Flush(); err != nil {
				return err
			}
			sent(frame)
			goto wait
		case <-tick.C:
		case <-readNow:
			// As the collector: reads start at least a second apart.
			if left := time.Second - time.Since(began); left > 0 {
				time.Sleep(left)
			}
		}
	}
}

// report builds node n's next frame: the transition from what the
// aggregator holds to what the node shows now, with the node's own seq and
// kube-proxy signal (its syncs go on while stuck: the health check stays
// green).
func (f *Fleet) report(n *simNode, now time.Time, refs, tops bool) ([]byte, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	show := n.frozen
	if show == nil {
		show = f.truth.At(now, n.lag)
	}
	var from uint64
	if !n.full && n.sent != nil {
		from = n.sent.Seq
	}
	e, err := f.transition(n.sent, show, from == 0, refs, tops)
	if err != nil {
		return nil, err
	}
	n.seq++
	if from == 0 || n.sent != show {
		n.changed, n.changedFull = n.seq, from == 0
	}
	if n.sent == nil || n.sent.Seq != show.Seq || n.full {
		n.syncs++
	}
	if n.sent != show {
		n.before = n.sent
	}
	n.sent, n.full = show, false
	kp, _ := json.Marshal(&stream.KubeProxy{LastSync: float64(now.Add(-n.lag).UnixNano()) / 1e9, EndpointChangesTotal: n.syncs})
	body := make([]byte, 0, 64+len(kp)+len(e.rest))
	body = append(body, `{"type":"report","report":{"seq":`...)
	body = strconv.AppendUint(body, n.seq, 10)
	body = append(body, `,"kubeProxy":`...)
	body = append(body, kp...)
	body = append(body, ',')
	body = append(body, e.rest...)
	body = append(body, '}')
	frame := make([]byte, 4, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	return append(frame, body...), nil
}

// transition encodes the report moving the aggregator's copy from one
// version to another (a full snapshot when full), once per pair.
func (f *Fleet) transition(from, to *Version, full, refs, tops bool) (*encoded, error) {
	key := transitionKey{to: to.Seq, refs: refs, tops: tops}
	if !full {
		key.from = from.Seq
	}
	f.rmu.Lock()
	defer f.rmu.Unlock()
	if e, ok := f.reports[key]; ok {
		return e, nil
	}
	prev := stream.NewState()
	if !full {
		cp := *from.State // Delta overwrites *prev: hand it a copy
		prev = &cp
	}
	r := stream.Delta(prev, to.State, 0, full, refs)
	if tops && (full || from != to) {
		r = r.ByTop(prev)
	}
	b, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	const head = `{"seq":0,`
	if string(b[:len(head)]) != head {
		return nil, fmt.Errorf("report encoding starts %q, not %q", b[:len(head)], head)
	}
	e := &encoded{rest: b[len(head):]}
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
	f.reports[key] = e
	return e, nil
}

func (t *Truth) oldest() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.versions[0].Seq
}
