package aggregator

import (
	"bytes"
	"context"
	"sync/atomic"

	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/cockroachdb/datadriven"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// TestProtocolScripts drives the aggregator's side of the stream
// protocol as data: testdata/protocol/*.txt deliver a collector's
// messages one at a time to sessions that never touch a socket (see
// session), on a clock that moves only when a script says "tick", and
// print what the aggregator answered and what it holds. The commands:
//
//	hello node=N [stream=S] [token=T] [interval=1s] [from=IP]
//	report stream=S [full] [tops] [refs] [drop=I,J] [seq=N] [wrong-root] [began=-Ns] [conntrack=N] [conntrack-error=WORDS-WITH-DASHES]
//	content stream=S [empty]           answers the stream's last want as a collector would
//	raw stream=S                       sends the JSON message in the input as it is
//	auth stream=S token=T              the collector's renewed token
//	wait stream=S                      the answer of a session that waited (warm-up)
//	flush stream=S pairs=N             the remediation asks the node to flush
//	flushed stream=S [id=N] [deleted=N] [error=E]
//	close stream=S                     the transport ends the stream
//	tick D                             the clock moves D
//	leader lead|none|follow=ADDR       this replica's leadership
//	node N                             what the aggregator holds of N
//	counts                             the protocol's counters (non-zero)
//
// Each stream is named by its node unless stream= names another (a
// second stream of the same node).
func TestProtocolScripts(t *testing.T) {
	datadriven.Walk(t, "testdata/protocol", func(t *testing.T, path string) {
		synctest.Test(t, func(t *testing.T) {
			s := newProtocolScript(t)
			datadriven.RunTest(t, path, s.run)
		})
	})
}

type protocolScript struct {
	t       *testing.T
	ctx     context.Context
	a       *Aggregator
	clk     *clocktesting.FakeClock
	streams map[string]*scriptStream
	flushes chan string
	// flushing counts the flushes sent whose result has not come.
	flushing int
	// parked hears a session begin to wait for a cold pool's warm-up.
	parked chan struct{}
}

// scriptStream is one collector as the script plays it: what it last
// sent (to answer wants as a collector does) and its session.
type scriptStream struct {
	node   string
	wire   *scriptWire
	c      *conn
	s      *session
	ended  bool
	seq    uint64
	prev   *stream.State
	recent []stream.Sent
	want   *stream.Want
	async  chan bool
}

// scriptWire is the transport's place in a script: what the aggregator
// writes is kept for the script to print; nothing is ever read from it.
type scriptWire struct {
	mu     sync.Mutex
	out    bytes.Buffer
	closed bool
	remote net.Addr
}

func (w *scriptWire) Read([]byte) (int, error) { return 0, io.EOF }
func (w *scriptWire) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return 0, net.ErrClosed
	}
	return w.out.Write(p)
}
func (w *scriptWire) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	return nil
}
func (w *scriptWire) LocalAddr() net.Addr {
	return &net.TCPAddr{IP: net.IPv4(198, 18, 0, 1), Port: 9443}
}
func (w *scriptWire) RemoteAddr() net.Addr             { return w.remote }
func (w *scriptWire) SetDeadline(time.Time) error      { return nil }
func (w *scriptWire) SetReadDeadline(time.Time) error  { return nil }
func (w *scriptWire) SetWriteDeadline(time.Time) error { return nil }

// take decodes what the aggregator wrote since the last take.
func (w *scriptWire) take(t *testing.T) []*stream.Message {
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []*stream.Message
	for w.out.Len() > 0 {
		m, _, err := stream.Read(&w.out, 64<<20)
		if err != nil {
			t.Fatalf("the aggregator wrote a frame that does not read back: %v", err)
		}
		out = append(out, m)
	}
	return out
}

// scriptAuth accepts "t-NODE" for NODE; "t-NODE@+60s" expires 60 s after
// the script's start (and is refused from then on); "busy" is a review
// the aggregator has no budget for.
type scriptAuth struct{ clk *clocktesting.FakeClock }

func (sa scriptAuth) Authenticate(_ context.Context, h auth.Hello) (time.Time, error) {
	token, until, _ := strings.Cut(h.Token, "@")
	switch {
	case token == "busy":
		return time.Time{}, &auth.BusyError{RetryAfter: 3 * time.Second} // the review budget is spent
	case token != "t-"+h.Node:
		return time.Time{}, errors.New("unauthenticated: token is bound to another node")
	case until != "":
		d, err := time.ParseDuration(strings.TrimPrefix(until, "+"))
		if err != nil {
			return time.Time{}, err
		}
		if !sa.clk.Now().Before(t0.Add(d)) {
			return time.Time{}, errors.New("unauthenticated: token expired")
		}
		return t0.Add(d), nil
	}
	return time.Time{}, nil
}

func newProtocolScript(t *testing.T) *protocolScript {
	ctx, cancel := context.WithCancel(context.Background())
	log := zaptest.NewLogger(t)
	clk := clocktesting.NewFakeClock(t0)
	view := view.New(view.Config{Client: fakeCluster(), Keep: 8 * time.Second, Log: log, Clock: clk, Debounce: 50 * time.Millisecond})
	p := audit.DefaultPolicy()
	p.Grace, p.DefaultInterval = 2*time.Second, time.Second
	a := New(Config{Policy: p, Auth: scriptAuth{clk}, Self: "198.18.0.1:9443", Log: log, MaxMessageBytes: 1 << 20, Clock: clk}, view)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(cancel)
	wg.Add(1)
	go func() { defer wg.Done(); view.Run(ctx) }()
	a.StartedLeading()
	s := &protocolScript{t: t, ctx: ctx, a: a, clk: clk, streams: map[string]*scriptStream{}, flushes: make(chan string, 4),
		parked: make(chan struct{}, 4)}
	a.warmup.onWait = func() { s.parked <- struct{}{} }
	// In the bubble the informers' polling sleeps are the bubble's time,
	// not the machine's.
	testkit.Eventually(t, 10*time.Second, "the view's informers synced", func() bool { return view.Synced() == nil })
	return s
}

func (s *protocolScript) run(t *testing.T, d *datadriven.TestData) string {
	s.t = t
	before := s.rejected()
	var out []string
	switch d.Cmd {
	case "hello":
		out = s.hello(d)
	case "report":
		out = s.report(d)
	case "content":
		st := s.stream(d)
		ct := &stream.Content{Frontends: []stream.Frontend{}}
		if !d.HasArg("empty") {
			if st.want == nil {
				t.Fatalf("%s: no want to answer", d.Pos)
			}
			ct = stream.Reply(st.want, st.recent)
		}
		out = s.receive(st, &stream.Message{Type: stream.TypeContent, Content: ct}, time.Time{})
	case "raw":
		st := s.stream(d)
		m, err := stream.Decode([]byte(d.Input))
		if err != nil {
			return "does not decode: " + err.Error()
		}
		out = s.receive(st, m, time.Time{})
	case "auth":
		st := s.stream(d)
		out = s.receive(st, &stream.Message{Type: stream.TypeAuth, Auth: &stream.Auth{Token: arg(d, "token", "")}}, time.Time{})
	case "wait":
		st := s.stream(d)
		if st.async == nil {
			t.Fatalf("%s: nothing async on %s", d.Pos, d.CmdArgs[0].Vals)
		}
		synctest.Wait()
		select {
		case ok := <-st.async:
			st.async = nil
			out = s.answered(st, ok)
		default:
			t.Fatalf("%s: the report did not finish", d.Pos)
		}
	case "flush":
		out = s.flush(d)
	case "flushed":
		st := s.stream(d)
		id, _ := strconv.ParseUint(arg(d, "id", "1"), 10, 64)
		deleted, _ := strconv.Atoi(arg(d, "deleted", "1"))
		f := &stream.Flushed{ID: id, Error: arg(d, "error", "")}
		for range st.flushPairs(d) {
			f.Results = append(f.Results, stream.FlushResult{Deleted: deleted})
		}
		out = append(s.receive(st, &stream.Message{Type: stream.TypeFlushed, Flushed: f}, time.Time{}), s.flushResult()...)
	case "close":
		st := s.stream(d)
		st.wire.Close()
		st.s.close()
		st.ended = true
		out = append(append(out, "closed"), s.flushResult()...)
	case "tick":
		dur, err := time.ParseDuration(d.CmdArgs[0].Key)
		if err != nil {
			t.Fatalf("%s: %v", d.Pos, err)
		}
		s.clk.Step(dur)
		return fmt.Sprintf("+%s", s.clk.Since(t0))
	case "leader":
		switch k := d.CmdArgs[0]; {
		case k.Key == "lead":
			s.a.StartedLeading()
		case k.Key == "none":
			s.a.StoppedLeading()
			s.a.NewLeader("")
		case k.Key == "follow":
			s.a.StoppedLeading()
			s.a.NewLeader(k.Vals[0])
		}
		l, leading := s.a.Leader()
		return fmt.Sprintf("leader=%q leading=%v", l, leading)
	case "node":
		out := s.node(d.CmdArgs[0].Key)
		if d.HasArg("collector") {
			s.a.mu.Lock()
			c := s.a.fleet.judge.Cost(d.CmdArgs[0].Key)
			s.a.mu.Unlock()
			if c == nil {
				return out + " collector=none"
			}
			return fmt.Sprintf("%s collector=%s reads=%v", out, c.Version, c.Reads)
		}
		return out
	case "counts":
		return s.counts()
	default:
		t.Fatalf("%s: unknown command %q", d.Pos, d.Cmd)
	}
	out = append(out, s.rejections(before)...)
	if len(out) == 0 {
		return "(nothing)"
	}
	return strings.Join(out, "\n")
}

func arg(d *datadriven.TestData, key, def string) string {
	for _, a := range d.CmdArgs {
		if a.Key == key && len(a.Vals) > 0 {
			return a.Vals[0]
		}
	}
	return def
}

func (s *protocolScript) stream(d *datadriven.TestData) *scriptStream {
	name := arg(d, "stream", "")
	st := s.streams[name]
	if st == nil {
		s.t.Fatalf("%s: no stream %q", d.Pos, name)
	}
	return st
}

func (s *protocolScript) hello(d *datadriven.TestData) []string {
	node := arg(d, "node", "")
	name := arg(d, "stream", node)
	interval, err := time.ParseDuration(arg(d, "interval", "1s"))
	if err != nil {
		s.t.Fatalf("%s: %v", d.Pos, err)
	}
	from := netip.MustParseAddr(arg(d, "from", "198.18.0.11"))
	w := &scriptWire{remote: &net.TCPAddr{IP: from.AsSlice(), Port: 40000 + len(s.streams)}}
	st := &scriptStream{node: node, wire: w, prev: stream.NewState()}
	st.c = &conn{Conn: w, authenticated: func() {}}
	s.streams[name] = st
	m := &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, Token: arg(d, "token", "t-"+node),
		IntervalSeconds: interval.Seconds(), Refs: true, Tops: true, Version: "script"}}
	st.s = s.a.open(s.ctx, st.c, m, s.a.cfg.Log)
	out := s.said(st)
	if st.s == nil {
		st.ended = true
		out = append(out, "refused")
	}
	return out
}

// report sends the next report of a collector whose rules are the synth
// cluster's (drop: those services lose an endpoint).
func (s *protocolScript) report(d *datadriven.TestData) []string {
	st := s.stream(d)
	var drop []int
	if v := arg(d, "drop", ""); v != "" {
		for _, f := range strings.Split(v, ",") {
			i, err := strconv.Atoi(f)
			if err != nil {
				s.t.Fatalf("%s: drop: %v", d.Pos, err)
			}
			drop = append(drop, i)
		}
	}
	next := stream.FromModel(rules(s.t, drop...))
	full := d.HasArg("full")
	st.seq++
	if v := arg(d, "seq", ""); v != "" {
		st.seq, _ = strconv.ParseUint(v, 10, 64)
	}
	prev := st.prev
	if full {
		prev = stream.NewState()
	}
	before := *prev // Delta makes prev next
	r := stream.Delta(prev, next, st.seq, full, d.HasArg("refs") || d.HasArg("tops"))
	if d.HasArg("tops") {
		r = r.ByTop(next)
	}
	if d.HasArg("wrong-root") {
		r.Root++
	}
	if v := arg(d, "conntrack", ""); v != "" {
		n, _ := strconv.Atoi(v)
		ct := &stream.Conntrack{Entries: n, Families: []int{4}}
		for i := range n {
			ct.Pairs = append(ct.Pairs, stream.ConntrackPair{Frontend: fmt.Sprintf("%s:80/TCP", synth.VIP(i)), Dest: "198.18.9.9:8080", TCP: map[string]int{"ESTABLISHED": 1}})
		}
		r.Conntrack = ct
	}
	if v := arg(d, "conntrack-error", ""); v != "" {
		r.Conntrack = &stream.Conntrack{Error: strings.ReplaceAll(v, "-", " ")}
	}
	st.recent = append(st.recent, stream.Sent{Seq: st.seq, Prev: before, Next: *next})
	if len(st.recent) > 4 {
		st.recent = st.recent[1:]
	}
	st.prev = next
	began := s.clk.Now()
	if v := arg(d, "began", ""); v != "" {
		ago, err := time.ParseDuration(v)
		if err != nil {
			s.t.Fatalf("%s: began: %v", d.Pos, err)
		}
		began = began.Add(ago)
	}
	m := &stream.Message{Type: stream.TypeReport, Report: r}
	return s.receive(st, m, began)
}

// receive hands m to st's session as if it began to arrive at began
// (zero: now). A session that waits (for another stream to warm a cold
// pool) is left waiting (the warm-up says so): "wait" takes its answer.
func (s *protocolScript) receive(st *scriptStream, m *stream.Message, began time.Time) []string {
	if st.ended {
		return []string{"(the stream has ended)"}
	}
	if st.async != nil {
		return []string{"(the session still waits: the script must say wait first)"}
	}
	if began.IsZero() {
		began = s.clk.Now()
	}
	var released atomic.Bool
	done := make(chan bool, 1)
	go func() {
		done <- st.s.receive(s.ctx, frame{m: m, size: 200, release: func() { released.Store(true) }, at: began})
	}()
	// The session runs until it answers or parks: nothing in the bubble
	// moves after that until the script's next step.
	synctest.Wait()
	select {
	case ok := <-done:
		if !released.Load() {
			s.t.Fatalf("the session kept the decode budget of a %s", m.Type)
		}
		return s.answered(st, ok)
	case <-s.parked:
		st.async = done
		return append(s.said(st), "(waiting)")
	default:
		s.t.Fatalf("the session of %s neither answered nor waited", st.node)
		return nil
	}
}

func (s *protocolScript) answered(st *scriptStream, ok bool) []string {
	out := s.said(st)
	if !ok {
		st.ended = true
		st.wire.Close()
		st.s.close()
		out = append(out, "stream ends")
	}
	return out
}

// said prints what the aggregator wrote on st, keeping its last want.
func (s *protocolScript) said(st *scriptStream) []string {
	var out []string
	for _, m := range st.wire.take(s.t) {
		out = append(out, describe(m))
		if m.Want != nil {
			st.want = m.Want
		}
	}
	return out
}

func describe(m *stream.Message) string {
	var b strings.Builder
	b.WriteString(m.Type)
	switch {
	case m.Welcome != nil:
		fmt.Fprintf(&b, " refs=%v tops=%v", m.Welcome.Refs, m.Welcome.Tops)
	case m.Want != nil:
		fmt.Fprintf(&b, " seq=%d", m.Want.Seq)
		switch w := m.Want; {
		case w.Buckets:
			b.WriteString(" bucket-names")
		case len(w.Delta) > 0:
			fmt.Fprintf(&b, " changes-of-buckets=%d", len(w.Delta))
		default:
			fmt.Fprintf(&b, " frontends=%d", len(w.Sums))
		}
	case m.Resync != nil:
		b.WriteString(": " + m.Resync.Reason)
	case m.Reject != nil:
		b.WriteString(": " + m.Reject.Reason)
		if m.Reject.RetryAfterSeconds > 0 {
			fmt.Fprintf(&b, " (retry after %gs)", m.Reject.RetryAfterSeconds)
		}
	case m.Redirect != nil:
		b.WriteString(" to " + m.Redirect.Leader)
	case m.Flush != nil:
		fmt.Fprintf(&b, " id=%d pairs=%d", m.Flush.ID, len(m.Flush.Pairs))
	case m.ReadNow != nil:
		b.WriteString(": " + m.ReadNow.Reason)
	}
	if m.Peers != nil {
		fmt.Fprintf(&b, " peers=%s", strings.Join(m.Peers.IPs, ","))
	}
	return b.String()
}

var allReasons = []RejectReason{ReasonAuth, ReasonTooLarge, ReasonMalformed, ReasonProtocol, ReasonInvalid, ReasonReplay, ReasonRate,
	ReasonTimeout, ReasonBusy, ReasonUnauthenticatedLimit}

func (s *protocolScript) rejected() map[RejectReason]float64 {
	out := map[RejectReason]float64{}
	for _, r := range allReasons {
		out[r] = testutil.ToFloat64(s.a.cfg.Metrics.StreamRejected.WithLabelValues(string(r)))
	}
	return out
}

// rejections names the reasons counted since before.
func (s *protocolScript) rejections(before map[RejectReason]float64) []string {
	var out []string
	for r, n := range s.rejected() {
		if n > before[r] {
			out = append(out, fmt.Sprintf("counted rejected{reason=%s}", r))
		}
	}
	slices.Sort(out)
	return out
}

func (st *scriptStream) flushPairs(d *datadriven.TestData) []remediate.StalePair {
	n, _ := strconv.Atoi(arg(d, "pairs", "1"))
	out := make([]remediate.StalePair, n)
	for i := range out {
		out[i] = remediate.StalePair{Frontend: fmt.Sprintf("%s:53/UDP", synth.VIP(i)), Dest: "198.18.9.9:53", Protocol: "UDP"}
	}
	return out
}

// flush starts a remediation's flush of the stream's node; its result
// is printed when the collector's answer comes (flushed).
func (s *protocolScript) flush(d *datadriven.TestData) []string {
	st := s.stream(d)
	pairs := st.flushPairs(d)
	go func() {
		rs, err := s.a.Flush(s.ctx, st.node, pairs)
		if err != nil {
			s.flushes <- "flush result: " + err.Error()
			return
		}
		s.flushes <- fmt.Sprintf("flush result: %+v", rs)
	}()
	synctest.Wait()
	if out := s.said(st); len(out) > 0 {
		s.flushing++
		return out
	}
	select {
	case r := <-s.flushes:
		return []string{r}
	default:
		s.t.Fatal("the flush was not sent")
		return nil
	}
}

// flushResult is the result of a flush the last step answered or
// ended, when one was waiting.
func (s *protocolScript) flushResult() []string {
	if s.flushing == 0 {
		return nil
	}
	synctest.Wait()
	select {
	case r := <-s.flushes:
		s.flushing--
		return []string{r}
	default:
		s.t.Fatal("a flush waiting for its answer got no result")
		return nil
	}
}

// node prints what the aggregator holds of a node.
func (s *protocolScript) node(name string) string {
	a := s.a
	a.mu.Lock()
	defer a.mu.Unlock()
	n := a.fleet.nodes[name]
	if n == nil {
		return "unknown"
	}
	streaming := "none"
	for sname, st := range s.streams {
		if st.c == n.conn && n.conn != nil {
			streaming = sname
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "stream=%s complete=%v seq=%d frontends=%d", streaming, n.complete, n.lastSeq, n.state.Len())
	if !n.heard.IsZero() {
		fmt.Fprintf(&b, " heard=+%s", n.heard.Sub(t0))
	}
	if n.conntrack != nil {
		fmt.Fprintf(&b, " conntrack-entries=%d", n.conntrack.Entries)
	}
	if n.conntrackErr != "" {
		fmt.Fprintf(&b, " conntrack-error=%q", n.conntrackErr)
	}
	if n.noRules {
		b.WriteString(" no-rules")
	}
	return b.String()
}

// counts prints the protocol's counters that are not zero.
func (s *protocolScript) counts() string {
	m := s.a.cfg.Metrics
	var out []string
	add := func(name string, v float64) {
		if v != 0 {
			out = append(out, fmt.Sprintf("%s %g", name, v))
		}
	}
	for _, k := range []string{"known", "wanted"} {
		add("refs{"+k+"}", testutil.ToFloat64(m.Refs.WithLabelValues(k)))
		add("named{top,"+k+"}", testutil.ToFloat64(m.Named.WithLabelValues("top", k)))
		add("named{bucket,"+k+"}", testutil.ToFloat64(m.Named.WithLabelValues("bucket", k)))
	}
	add("resyncs", testutil.ToFloat64(m.Resyncs))
	for _, r := range allReasons {
		add("rejected{"+string(r)+"}", testutil.ToFloat64(m.StreamRejected.WithLabelValues(string(r))))
	}
	if len(out) == 0 {
		return "(none)"
	}
	return strings.Join(out, "\n")
}
