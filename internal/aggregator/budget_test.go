package aggregator

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/internal/api"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

// jwt makes a token shaped like a projected ServiceAccount token (not
// signed: only the API server's review decides; these tests fake it).
func jwt(aud, node string, exp time.Time) string {
	claims := map[string]any{"aud": []string{aud}, "exp": exp.Unix(), "sub": "system:serviceaccount:pa:proxyaudit-collector"}
	if node != "" {
		claims["kubernetes.io"] = map[string]any{"node": map[string]string{"name": node}}
	}
	b, _ := json.Marshal(claims)
	return "eyJhbGciOiJSUzI1NiJ9." + base64.RawURLEncoding.EncodeToString(b) + ".c2ln"
}

// reviewingAPI answers TokenReviews as the API server would for jwt
// tokens (review), counting them.
func reviewingAPI(count *atomic.Int32) *fake.Clientset {
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		count.Add(1)
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		review(tr)
		return true, tr, nil
	})
	return client
}

// review answers tr as the API server would for a jwt token: junk-*
// nodes and tokens without a node are invalid.
func review(tr *authnv1.TokenReview) {
	parts := strings.Split(tr.Spec.Token, ".")
	var claims struct {
		K8s struct {
			Node struct{ Name string } `json:"node"`
		} `json:"kubernetes.io"`
	}
	if len(parts) == 3 {
		b, _ := base64.RawURLEncoding.DecodeString(parts[1])
		json.Unmarshal(b, &claims)
	}
	if claims.K8s.Node.Name == "" || strings.HasPrefix(claims.K8s.Node.Name, "junk") {
		tr.Status = authnv1.TokenReviewStatus{Error: "invalid bearer token"}
		return
	}
	tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences, User: authnv1.UserInfo{
		Username: "system:serviceaccount:pa:proxyaudit-collector",
		Extra:    map[string]authnv1.ExtraValue{NodeNameExtra: {claims.K8s.Node.Name}}}}
}

// reviewingServer is reviewingAPI as an HTTP API server on mn, for a
// synctest bubble: the fake clientset holds a mutex while it answers,
// which a bubble does not see, so a review that takes the bubble's time
// there would stop it. Here the reviews queue on a channel.
func reviewingServer(t *testing.T, mn *testkit.MemNet, delay time.Duration, count *atomic.Int32) kubernetes.Interface {
	capacity := make(chan struct{}, 1)
	url, hc := mn.HTTPServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/apis/authentication.k8s.io/v1/tokenreviews" {
			http.Error(w, "not served here", http.StatusNotFound)
			return
		}
		var tr authnv1.TokenReview
		if err := json.NewDecoder(r.Body).Decode(&tr); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		count.Add(1)
		capacity <- struct{}{}
		time.Sleep(delay) // the bubble's time
		<-capacity
		review(&tr)
		tr.APIVersion, tr.Kind = "authentication.k8s.io/v1", "TokenReview"
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(&tr)
	}))
	client, err := kubernetes.NewForConfigAndClient(&rest.Config{Host: url, QPS: -1, ContentConfig: rest.ContentConfig{ContentType: "application/json"}}, hc)
	if err != nil {
		t.Fatal(err)
	}
	return client
}

// What could never pass is refused before the API server is asked.
func TestPrecheck(t *testing.T) {
	now := time.Unix(2_000_000_000, 0)
	for _, tc := range []struct {
		name, token, says string
	}{
		{"good", jwt("proxyaudit", "n1", now.Add(time.Hour)), ""},
		{"no node claim (older API servers)", jwt("proxyaudit", "", now.Add(time.Hour)), ""},
		{"expired within the skew", jwt("proxyaudit", "n1", now.Add(-30*time.Second)), ""},
		{"not a JWT", "t-n1", "not a ServiceAccount token"},
		{"garbage claims", "a.!!!.c", "not base64url"},
		{"claims not JSON", "a." + base64.RawURLEncoding.EncodeToString([]byte("nope")) + ".c", "not JSON"},
		{"another audience", jwt("kubernetes", "n1", now.Add(time.Hour)), "do not include"},
		{"expired", jwt("proxyaudit", "n1", now.Add(-time.Hour)), "expired"},
		{"another node", jwt("proxyaudit", "n2", now.Add(time.Hour)), `bound to node "n2"`},
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

// A follower sends a collector to the leader without reviewing its token:
// the redirect carries nothing secret.
func TestFollowerRedirectsBeforeReviewing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		client := reviewingAPI(&reviews)
		auth := &TokenReviewAuth{Client: client, Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"},
			Clock: clocktesting.NewFakeClock(time.Now())}
		h := start(t, 2*time.Second, auth)
		h.agg.StoppedLeading()
		h.agg.NewLeader("198.18.1.2:9443")
		for range 20 {
			c := h.dial("")
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n1", IntervalSeconds: 1,
				Token: jwt("proxyaudit", "n1", time.Now().Add(time.Hour))}})
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			m, _, err := stream.Read(c, 1<<20)
			if err != nil || m.Type != stream.TypeRedirect || m.Redirect.Leader != "198.18.1.2:9443" {
				t.Fatalf("follower answered %+v, %v", m, err)
			}
		}
		if n := reviews.Load(); n != 0 {
			t.Fatalf("a follower asked for %d TokenReviews before redirecting", n)
		}
		// The leader reviews (once per token: the reconnect is cached).
		h.agg.StartedLeading()
		for range 2 {
			c := h.dial("")
			stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: "n1", IntervalSeconds: 1,
				Token: jwt("proxyaudit", "n1", time.Unix(4_000_000_000, 0))}})
			expect(t, c, stream.TypeWelcome, "")
		}
		if n := reviews.Load(); n != 1 {
			t.Fatalf("the leader asked for %d reviews of one token", n)
		}
	})
}

// A flood of junk reader tokens spends the readers' budget, never the
// collectors': collectors are admitted as fast as with no flood, while
// the flood gets 429.
func TestJunkReaderTokensCannotDelayCollectors(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		mn := testkit.NewMemNet()
		client := reviewingServer(t, mn, 5*time.Millisecond, &reviews) // a review takes the API server 5 ms
		clk := clocktesting.NewFakeClock(time.Now())
		auth := &TokenReviewAuth{Client: client, Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"}, Clock: clk,
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
					req.Header.Set(api.TokenHeader, jwt(api.DefaultReaderAudience, fmt.Sprintf("junk-%d-%d", w, k), time.Now().Add(time.Hour)))
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
			_, err := auth.Authenticate(ctx, Hello{Node: node, Token: jwt("proxyaudit", node, time.Now().Add(time.Hour)), Source: fmt.Sprintf("198.18.0.%d", i)})
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

// A fleet reconnecting at once (the leader died) is admitted at the
// budget's rate: those the budget cannot take yet are told when to come
// back, which costs the API server nothing, and every token is reviewed
// exactly once.
func TestFleetReconnectPacedByBudget(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var reviews atomic.Int32
		const fleet, qps, burst = 60, 20, 5
		auth := &TokenReviewAuth{Client: reviewingAPI(&reviews), Audience: "proxyaudit", ServiceAccounts: []string{"pa/proxyaudit-collector"},
			Clock: clocktesting.NewFakeClock(time.Now()), Budget: NewBudget(qps, burst, 0, 0), BudgetWait: 100 * time.Millisecond}
		h := start(t, 2*time.Second, auth)
		start := time.Now()
		var (
			wg         sync.WaitGroup
			busy       atomic.Int32
			maxRetry   atomic.Int64
			admittedAt = make([]time.Duration, fleet)
		)
		for i := range fleet {
			wg.Add(1)
			go func() {
				defer wg.Done()
				node := fmt.Sprintf("n%d", i+1)
				token := jwt("proxyaudit", node, time.Now().Add(time.Hour))
				for attempt := 0; ; attempt++ {
					c := h.dial("")
					stream.Write(c, &stream.Message{Type: stream.TypeHello, Hello: &stream.Hello{Node: node, IntervalSeconds: 1, Token: token}})
					c.SetReadDeadline(time.Now().Add(10 * time.Second))
					m, _, err := stream.Read(c, 1<<20)
					c.Close()
					switch {
					case err != nil:
						t.Errorf("%s: %v", node, err)
						return
					case m.Type == stream.TypeWelcome:
						admittedAt[i] = time.Since(start)
						return
					case m.Type == stream.TypeReject && m.Reject.RetryAfterSeconds > 0 && attempt < 50:
						busy.Add(1)
						after := time.Duration(m.Reject.RetryAfterSeconds * float64(time.Second))
						if int64(after) > maxRetry.Load() {
							maxRetry.Store(int64(after))
						}
						time.Sleep(after + time.Duration(rand.Int64N(int64(after)/10+int64(100*time.Millisecond)))) // as the collector does
					default:
						t.Errorf("%s: answered %+v", node, m.Reject)
						return
					}
				}
			}()
		}
		wg.Wait()
		took := slices.Max(admittedAt)
		t.Logf("%d collectors admitted in %s at %d reviews/s: %d busy refusals (longest retry-after %s), %d reviews",
			fleet, took.Round(10*time.Millisecond), qps, busy.Load(), time.Duration(maxRetry.Load()), reviews.Load())
		if n := reviews.Load(); n != fleet {
			t.Errorf("%d TokenReviews for %d collectors: a refusal must cost none, an admission one", n, fleet)
		}
		if busy.Load() == 0 {
			t.Errorf("no collector was told to come back: the budget did not bind")
		}
		// Each refused collector was given a slot of its own: it is refused
		// about once, not again and again with a herd that came back together.
		if n := busy.Load(); n > fleet {
			t.Errorf("%d busy refusals for %d collectors: the refused came back as a herd", n, fleet)
		}
		// The budget admits the burst at once, then qps a second; coming
		// back at the slot told (with the collector's jitter), the fleet is in
		// a little after that pace (and never faster than the budget).
		ideal := time.Duration(float64(fleet-burst) / qps * float64(time.Second))
		if took < ideal*8/10 || took > ideal*14/10+500*time.Millisecond {
			t.Errorf("fleet admitted in %s; the budget's pace is %s", took, ideal)
		}
	})
}
