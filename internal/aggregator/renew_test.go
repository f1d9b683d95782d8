package aggregator

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/collector/collectortest"
)

// expiring is an authenticator whose tokens say their node and their
// expiry: "NODE/SECONDS" holds until t0+SECONDS on clk. A token past its
// expiry or naming another node is refused, as a TokenReview would.
type expiring struct{ clk *clocktesting.FakeClock }

func (e expiring) Authenticate(_ context.Context, h auth.Hello) (time.Time, error) {
	node, secs, ok := strings.Cut(h.Token, "/")
	n, err := strconv.Atoi(secs)
	if !ok || err != nil {
		return time.Time{}, fmt.Errorf("%w: malformed token", auth.ErrUnauthenticated)
	}
	if node != h.Node {
		return time.Time{}, fmt.Errorf("%w: token is bound to node %q, not %q", auth.ErrUnauthenticated, node, h.Node)
	}
	until := t0.Add(time.Duration(n) * time.Second)
	if !e.clk.Now().Before(until) {
		return time.Time{}, fmt.Errorf("%w: token expired", auth.ErrUnauthenticated)
	}
	return until, nil
}

// The real collector re-reads its token file at each heartbeat and renews
// its stream when the kubelet rotated it: the stream is not cut when the
// first token expires.
func TestCollectorRenewsRotatedToken(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := startWith(t, 2*time.Second, nil, fakeCluster(), nil)
		var (
			mu   sync.Mutex
			seen []string
		)
		h.agg.cfg.Auth = authRecorder(func(ctx context.Context, hello auth.Hello) (time.Time, error) {
			mu.Lock()
			seen = append(seen, hello.Token)
			mu.Unlock()
			return expiring{h.clk}.Authenticate(ctx, hello)
		})
		file := filepath.Join(t.TempDir(), "token")
		write := func(tok string) {
			// As the kubelet does: a new file renamed over the old.
			tmp := file + ".new"
			if err := os.WriteFile(tmp, []byte(tok+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(tmp, file); err != nil {
				t.Fatal(err)
			}
		}
		write("n1/20")
		ctx, cancel := context.WithCancel(h.ctx)
		defer cancel()
		h.wg.Add(1)
		go func() {
			defer h.wg.Done()
			collector.Run(ctx, collector.Config{Node: "n1", Aggregator: h.addr, Interval: time.Second, CPUTime: noCPU, TokenFile: file, Clock: h.clk, Dial: h.net.Dial,
				Log:    zaptest.NewLogger(t).Named("n1"),
				Reader: &collectortest.Reader{Rules: func() (*audit.Observed, error) { return rules(t), nil }}})
		}()
		h.until(10*time.Second, "n1 reporting", func() bool {
			h.agg.mu.Lock()
			defer h.agg.mu.Unlock()
			return h.agg.fleet.nodes["n1"] != nil && h.agg.fleet.nodes["n1"].complete
		})
		write("n1/3600")
		h.advance(40*time.Second, nil)
		if got := testutil.ToFloat64(h.agg.cfg.Metrics.StreamRejected.WithLabelValues(string(ReasonAuth))); got != 0 {
			t.Errorf("%v streams rejected for authentication; the rotated token should have renewed the stream", got)
		}
		// One hello with the first token, one renewal with the second: a
		// reconnect would have shown as a second use of it.
		mu.Lock()
		defer mu.Unlock()
		if want := []string{"n1/20", "n1/3600"}; !slices.Equal(seen, want) {
			t.Errorf("tokens authenticated: %q, want %q", seen, want)
		}
		for _, f := range h.verdict().Findings {
			if f.Node != "n1" {
				continue // n2 and n3 have no collector here
			}
			t.Errorf("finding while renewing: %+v", f)
		}
	})
}

type authRecorder func(context.Context, auth.Hello) (time.Time, error)

func (f authRecorder) Authenticate(ctx context.Context, h auth.Hello) (time.Time, error) {
	return f(ctx, h)
}
