package collector

import (
	"context"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Under kube-proxy's syncs once a second a collector reads a change each
// second; its reports must still fit what the aggregator takes on a
// stream (four an interval, a burst of eight: aggregator.admit), or the
// stream is ended every few seconds. A flush in the middle is still sent
// at once.
func TestReportsKeepTheAggregatorsPace(t *testing.T) {
	ss := newSessionScript(t)
	ctx := context.Background()
	interval := ss.c.cfg.Interval
	aggregator := rate.NewLimiter(rate.Every(interval/4), 8) // as the aggregator admits a stream
	ss.s = &session{n: ss.c, clock: ss.clk, log: ss.c.cfg.Log, token: ss.token, sent: stream.NewState(), full: true, pace: newPace(interval, ss.clk.Now())}
	ss.c.credit = newReadCredit(1, time.Minute, interval) // the read budget out of the way
	sent, refused := 0, 0
	send := func(out []*stream.Message) {
		for _, m := range out {
			if m.Report == nil {
				continue
			}
			sent++
			if !aggregator.AllowN(ss.clk.Now(), 1) {
				refused++
			}
		}
	}
	send(ss.s.start(ctx))
	flushedAt := 60 * time.Second
	var flushSent time.Duration = -1
	for el := time.Duration(0); el < 3*time.Minute; el += 100 * time.Millisecond {
		ss.clk.Step(100 * time.Millisecond)
		if el%time.Second == 0 {
			// kube-proxy's sync: the signal moves and settles.
			ss.sig.tok.Add(1)
			send(ss.s.settled(ctx))
		}
		if el == flushedAt {
			ss.rules, ss.flushed = &audit.Observed{Mode: audit.ModeIPTables, NoRules: true, Families: []int{4, 6}}, true
			ss.sig.tok.Add(1)
			before := sent
			send(ss.s.settled(ctx))
			if sent > before {
				flushSent = 0
			}
		}
		select {
		case <-ss.s.soon:
			before := sent
			send(ss.s.readOrWait(ctx, ss.s.pending))
			if flushSent < 0 && el > flushedAt && sent > before {
				flushSent = el - flushedAt
			}
		default:
		}
		if el%interval == 0 {
			send(ss.s.heartbeat(ctx))
		}
	}
	t.Logf("%d reports in 3 minutes at a %s interval; the flush sent %s after it was noticed", sent, interval, flushSent)
	if refused > 0 {
		t.Errorf("the aggregator would have refused %d of %d reports (and ended the stream at the first)", refused, sent)
	}
	if sent < 3*60/int(interval.Seconds())*4*8/10 {
		t.Errorf("only %d reports in 3 minutes: reads of changes are held back more than the pace needs", sent)
	}
	if flushSent != 0 {
		t.Errorf("the flush was sent %s after it was noticed, not at once", flushSent)
	}
}
