package collector

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
	"go.uber.org/zap/zaptest"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/synth"
)

// TestSessionScripts drives the collector's side of the stream protocol
// as data: testdata/session/*.txt feed one session the aggregator's
// messages and the node's events (a change announced, the heartbeat, the
// clock) and print the messages it returns to send. The session never
// touches a connection; its rules come from a reader the script sets.
//
//	welcome [refs] [tops]          the aggregator welcomed the stream: the first report
//	rules [drop=I,J]               the node's rules from now on (the synth cluster's)
//	change                         the kernel announces a commit (the signal's token moves)
//	settle                         the announced change has settled
//	tick                           the heartbeat
//	clock D                        the clock moves D; a read that waited is made if due
//	token T                        the kubelet rotates the token file
//	recv                           the aggregator's message, JSON in the input
//	resync | read-now | want-last K   shorthand messages (want-last: the level K of the last report)
//	debt D                         the read budget spends D of CPU
//	flush                          the node's rules are flushed: none, and the reader's probe says so
//	poll                           the flush probe's tick (a reader without a change signal)
func TestSessionScripts(t *testing.T) {
	datadriven.Walk(t, "testdata/session", func(t *testing.T, path string) {
		s := newSessionScript(t)
		datadriven.RunTest(t, path, s.run)
	})
}

type sessionScript struct {
	t     *testing.T
	clk   *clocktesting.FakeClock
	c     *client
	s     *session
	rules *audit.Observed
	sig   *scriptSignal
	// flushed is what the reader's FlushProbe says.
	flushed bool
	token   string
	last    *stream.Report // the last report sent
}

// scriptSignal is a change signal whose token the script moves.
type scriptSignal struct {
	tok    atomic.Uint64
	events chan struct{}
}

func (g *scriptSignal) Token() (uint64, error)  { return g.tok.Load(), nil }
func (g *scriptSignal) Events() <-chan struct{} { return g.events }
func (g *scriptSignal) Lost() uint64            { return 0 }
func (g *scriptSignal) Exact() bool             { return true }
func (g *scriptSignal) Close()                  {}

// scriptReader reads the rules the script set; its flush probe says
// what the script says.
type scriptReader struct{ ss *sessionScript }

func (r scriptReader) Read(context.Context) (*audit.Observed, error) {
	r.ss.flushed = false // the read shows the flush
	return r.ss.rules, nil
}
func (r scriptReader) String() string               { return "script" }
func (r scriptReader) Flushed(context.Context) bool { return r.ss.flushed }

var sessionSpec = synth.Spec{Services: 8, EndpointsPerService: 3}

func sessionRules(t *testing.T, drop ...int) *audit.Observed {
	o, err := sessionSpec.Observed()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range drop {
		for k := range o.Frontends {
			if o.Frontends[k].IP == synth.VIP(i) {
				o.Frontends[k].Endpoints = o.Frontends[k].Endpoints[:len(o.Frontends[k].Endpoints)-1]
			}
		}
	}
	return o
}

func newSessionScript(t *testing.T) *sessionScript {
	clk := clocktesting.NewFakeClock(time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC))
	ss := &sessionScript{t: t, clk: clk, sig: &scriptSignal{events: make(chan struct{}, 1)}, rules: sessionRules(t), token: "t1"}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(ss.token), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Node: "n1", Interval: 10 * time.Second, FullReadInterval: time.Hour, Clock: clk, Log: zaptest.NewLogger(t), TokenFile: tokenFile}
	ss.c = &client{cfg: cfg, reader: scriptReader{ss}, signal: ss.sig,
		credit: newReadCredit(DefaultReadBudget, time.Duration(DefaultReadBudget*float64(DefaultReadBurstWindow)), cfg.Interval)}
	ss.c.cost.Reads = map[stream.ReadReason]uint64{}
	return ss
}

func (ss *sessionScript) run(t *testing.T, d *datadriven.TestData) string {
	ss.t = t
	ctx := context.Background()
	var out []*stream.Message
	switch d.Cmd {
	case "welcome":
		ss.s = &session{n: ss.c, clock: ss.clk, log: ss.c.cfg.Log, token: ss.token, sent: stream.NewState(), full: true, refs: d.HasArg("refs"), tops: d.HasArg("tops")}
		out = ss.s.start(ctx)
	case "rules":
		var drop []int
		for _, a := range d.CmdArgs {
			if a.Key == "drop" {
				for _, v := range a.Vals {
					for _, f := range strings.Split(v, ",") {
						i, err := strconv.Atoi(f)
						if err != nil {
							t.Fatalf("%s: drop: %v", d.Pos, err)
						}
						drop = append(drop, i)
					}
				}
			}
		}
		ss.rules = sessionRules(t, drop...)
		return "ok"
	case "change":
		ss.sig.tok.Add(1)
		ss.s.changed()
		return fmt.Sprintf("settling: %v", ss.s.settle != nil)
	case "settle":
		if ss.s.settle == nil {
			t.Fatalf("%s: nothing settling", d.Pos)
		}
		out = ss.s.settled(ctx)
	case "tick":
		out = ss.s.heartbeat(ctx)
	case "debt":
		dur, err := time.ParseDuration(d.CmdArgs[0].Key)
		if err != nil {
			t.Fatal(err)
		}
		ss.c.credit.spend(ss.clk.Now(), dur)
		return fmt.Sprintf("wait %s", ss.c.credit.wait(ss.clk.Now()))
	case "flush":
		ss.rules, ss.flushed = &audit.Observed{Mode: audit.ModeIPTables, NoRules: true, Families: []int{4, 6}}, true
		return "ok"
	case "poll":
		out = ss.s.polled(ctx)
	case "clock":
		dur, err := time.ParseDuration(d.CmdArgs[0].Key)
		if err != nil {
			t.Fatal(err)
		}
		ss.clk.Step(dur)
		select {
		case <-ss.s.soon:
			out = ss.s.readOrWait(ctx, ss.s.pending)
		default:
		}
	case "token":
		ss.token = d.CmdArgs[0].Key
		if err := os.WriteFile(ss.c.cfg.TokenFile, []byte(ss.token), 0o600); err != nil {
			t.Fatal(err)
		}
		return "ok"
	case "recv", "resync", "read-now", "want-last":
		m := &stream.Message{}
		switch d.Cmd {
		case "recv":
			var err error
			if m, err = stream.Decode([]byte(d.Input)); err != nil {
				return "does not decode: " + err.Error()
			}
		case "resync":
			m = &stream.Message{Type: stream.TypeResync, Resync: &stream.Resync{Reason: "script"}}
		case "read-now":
			m = &stream.Message{Type: stream.TypeReadNow, ReadNow: &stream.ReadNow{Reason: "script"}}
		case "want-last":
			w := &stream.Want{Seq: ss.last.Seq}
			switch d.CmdArgs[0].Key {
			case "buckets":
				w.Buckets = true
			case "frontends":
				for _, r := range ss.last.Refs {
					w.Sums = append(w.Sums, r.Sum)
				}
			}
			m = &stream.Message{Type: stream.TypeWant, Want: w}
		}
		var leader string
		var err error
		out, leader, err = ss.s.receive(ctx, m)
		switch {
		case err != nil:
			return "ends: " + err.Error()
		case leader != "":
			return "ends: follow the leader at " + leader
		}
	default:
		t.Fatalf("%s: unknown command %q", d.Pos, d.Cmd)
	}
	if len(out) == 0 {
		return "(nothing)"
	}
	var lines []string
	for _, m := range out {
		lines = append(lines, ss.describe(m))
	}
	return strings.Join(lines, "\n")
}

// describe prints a message the session returned, keeping the last
// report.
func (ss *sessionScript) describe(m *stream.Message) string {
	switch {
	case m.Report != nil:
		r := m.Report
		ss.last = r
		var b strings.Builder
		fmt.Fprintf(&b, "report seq=%d", r.Seq)
		if r.Full {
			b.WriteString(" full")
		}
		if r.Top != "" {
			b.WriteString(" top")
		}
		if len(r.Frontends) > 0 {
			fmt.Fprintf(&b, " frontends=%d", len(r.Frontends))
		}
		if len(r.Refs) > 0 {
			fmt.Fprintf(&b, " refs=%d", len(r.Refs))
		}
		if len(r.Removed) > 0 {
			fmt.Fprintf(&b, " removed=%d", len(r.Removed))
		}
		if r.Reads != nil {
			fmt.Fprintf(&b, " reads=%v", r.Reads.Reads)
		}
		return b.String()
	case m.Content != nil:
		ct := m.Content
		return fmt.Sprintf("content bucket-names=%v refs=%d removed=%d frontends=%d", ct.Buckets != "", len(ct.Refs), len(ct.Removed), len(ct.Frontends))
	case m.Auth != nil:
		return "auth token=" + m.Auth.Token
	case m.Flushed != nil:
		return fmt.Sprintf("flushed id=%d results=%d error=%q", m.Flushed.ID, len(m.Flushed.Results), m.Flushed.Error)
	}
	return m.Type
}
