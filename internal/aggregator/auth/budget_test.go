package auth

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth/authtest"
	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// What could never pass is refused before the API server is asked.
func TestPrecheck(t *testing.T) {
	now := time.Unix(2_000_000_000, 0)
	for _, tc := range []struct {
		name, token, says string
	}{
		{"good", authtest.JWT("proxyaudit", "n1", now.Add(time.Hour)), ""},
		{"no node claim (older API servers)", authtest.JWT("proxyaudit", "", now.Add(time.Hour)), ""},
		{"expired within the skew", authtest.JWT("proxyaudit", "n1", now.Add(-30*time.Second)), ""},
		{"not a JWT", "t-n1", "not a ServiceAccount token"},
		{"garbage claims", "a.!!!.c", "not base64url"},
		{"claims not JSON", "a." + base64.RawURLEncoding.EncodeToString([]byte("nope")) + ".c", "not JSON"},
		{"another audience", authtest.JWT("kubernetes", "n1", now.Add(time.Hour)), "do not include"},
		{"expired", authtest.JWT("proxyaudit", "n1", now.Add(-time.Hour)), "expired"},
		{"another node", authtest.JWT("proxyaudit", "n2", now.Add(time.Hour)), `bound to node "n2"`},
	} {
		err := precheck(tc.token, "proxyaudit", "n1", now)
		switch {
		case tc.says == "" && err != nil:
			t.Errorf("%s: refused: %v", tc.name, err)
		case tc.says != "" && (err == nil || !errors.Is(err, ErrUnauthenticated) || !strings.Contains(err.Error(), tc.says)):
			t.Errorf("%s: %v, want %q", tc.name, err, tc.says)
		}
	}
}

// A flood of junk reader tokens spends the readers' budget, never the
// collectors': collectors are admitted as fast as with no flood, while
// the flood gets 429.
func TestJunkReaderTokensCannotDelayCollectors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		mn := testkit.NewMemNet()
		client := authtest.ReviewingServer(t, mn, 5*time.Millisecond, &reviews) // a review takes the API server 5 ms
		clk := clocktesting.NewFakeClock(time.Now())
		ta := &TokenReviewAuth{Client: client, Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"}, Clock: clk,
			Budget: NewBudget(200, 400, 1, 5), BudgetWait: 5 * time.Second}
		readers := &ReaderAuth{Client: client, Audience: api.DefaultReaderAudience, Namespace: "pa", Service: "agg", Clock: clk,
			Budget: NewBudget(10, 20, 0, 0)}
		srvURL, _ := mn.HTTPServer(t, readers.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("{}")) })))

		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var flood, busy atomic.Int32
		var wg sync.WaitGroup
		// Sixteen clients on kept-alive connections send hundreds of requests a
		// second against a budget of ten: a flood, without the test's own
		// connection churn starving the collectors' goroutine of CPU (64
		// clients on http.DefaultClient's two idle connections did, under the
		// race detector on two cores: 29 s for 0.5 s of reviews).
		flooder := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16,
			DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) { return mn.Dial(ctx, addr) }}}
		defer flooder.CloseIdleConnections()
		for w := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// A request every millisecond of the bubble's time each
				// (16,000 a second): unpaced, the flood would never let the
				// bubble's clock move.
				tick := time.NewTicker(time.Millisecond)
				defer tick.Stop()
				for k := 0; ctx.Err() == nil; k++ {
					select {
					case <-ctx.Done():
						return
					case <-tick.C:
					}
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srvURL+"/api/v1/findings", nil)
					req.Header.Set(api.TokenHeader, authtest.JWT(api.DefaultReaderAudience, fmt.Sprintf("junk-%d-%d", w, k), time.Now().Add(time.Hour)))
					resp, err := flooder.Do(req)
					if err != nil {
						continue
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					flood.Add(1)
					if resp.StatusCode == http.StatusTooManyRequests {
						busy.Add(1)
					}
				}
			}()
		}
		time.Sleep(200 * time.Millisecond) // the flood is on (the bubble's time)
		start := time.Now()
		for i := range 100 {
			node := fmt.Sprintf("n%d", i)
			_, err := ta.Authenticate(ctx, Hello{Node: node, Token: authtest.JWT("proxyaudit", node, time.Now().Add(time.Hour)), Source: fmt.Sprintf("198.18.0.%d", i)})
			if err != nil {
				t.Fatalf("collector %s refused during the flood: %v", node, err)
			}
		}
		took := time.Since(start)
		cancel()
		wg.Wait()
		t.Logf("100 collectors admitted in %s while %d junk reader requests came (%d got 429)", took.Round(time.Millisecond), flood.Load(), busy.Load())
		// 100 reviews of 5 ms one after the other: half a second of the
		// bubble's time, however loaded the machine. The readers' budget
		// (a burst of 20, 10 a second) may put theirs between them, no
		// more: the flood must not add the rest in front of them.
		if took > (100+20+10)*5*time.Millisecond {
			t.Errorf("collectors waited %s behind junk reader tokens", took)
		}
		if busy.Load() == 0 {
			t.Error("the readers' budget never ran out: the flood was not a flood")
		}
	})
}

// One source sending hellos spends its own share; a fleet reconnecting at
// once beyond the budget is told to retry, not queued without end.
func TestBudgetPerSourceAndBusy(t *testing.T) {
	b := NewBudget(1000, 1000, 1, 3)
	ctx := context.Background()
	for range 3 {
		if err := b.take(ctx, "198.18.0.9", 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.take(ctx, "198.18.0.9", 0); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), "198.18.0.9") {
		t.Fatalf("a fourth hello at once from one source: %v", err)
	}
	if err := b.take(ctx, "198.18.0.10", 0); err != nil {
		t.Fatalf("another source: %v", err)
	}
	small := NewBudget(1, 2, 0, 0)
	small.take(ctx, "", 0)
	small.take(ctx, "", 0)
	if err := small.take(ctx, "", 100*time.Millisecond); !errors.Is(err, ErrBusy) {
		t.Fatalf("over the budget: %v", err)
	}
	var nilBudget *Budget
	if err := nilBudget.take(ctx, "x", 0); err != nil {
		t.Fatal(err)
	}

}
