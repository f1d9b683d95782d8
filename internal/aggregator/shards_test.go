package aggregator

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap/zaptest"
	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth/authtest"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/shard"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// peer is another replica's internal API on a loopback address of its
// own (all replicas serve on one port, as pods do), answering as told.
type peer struct {
	identity string
	answer   atomic.Pointer[func(w http.ResponseWriter, r *http.Request)]
	handler  atomic.Pointer[http.Handler] // before answer, when set
}

// peersOn starts n peers on 127.0.0.2.. of the test's network sharing
// one port, and returns it and a client on that network (for Shards).
func peersOn(t *testing.T, n int) (string, *http.Client, []*peer) {
	var port string
	var out []*peer
	for i := range n {
		host := fmt.Sprintf("127.0.0.%d", i+2)
		ln, err := netOf(t).Listen(net.JoinHostPort(host, map[bool]string{true: "0", false: port}[port == ""]))
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ = net.SplitHostPort(ln.Addr().String())
		p := &peer{identity: host + ":9443"}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if h := p.handler.Load(); h != nil {
				(*h).ServeHTTP(w, r)
				return
			}
			if f := p.answer.Load(); f != nil {
				(*f)(w, r)
				return
			}
			http.Error(w, "nothing yet", http.StatusServiceUnavailable)
		})}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		out = append(out, p)
	}
	return port, netOf(t).HTTPClient(), out
}

func (p *peer) serve(f func(w http.ResponseWriter)) {
	p.answerWith(func(w http.ResponseWriter, _ *http.Request) { f(w) })
}

// answerWith is serve with the request.
func (p *peer) answerWith(f func(w http.ResponseWriter, r *http.Request)) {
	p.handler.Store(nil)
	p.answer.Store(&f)
}

// handle serves h as the peer's API: a real replica's.
func (p *peer) handle(h http.Handler) { p.handler.Store(&h) }

// partialAnswer answers with a partial of nodes as replica, claiming shards.
func partialAnswer(replica string, shards []int, nodes ...audit.NodeStatus) func(w http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		p := audit.Partial{Nodes: nodes, Drifted: map[string]time.Time{}}
		for _, n := range nodes {
			if n.State == audit.NodeStuck {
				f := audit.TimedFinding{Since: t0, Finding: audit.Finding{Node: n.Node, Kind: audit.StaleEndpoint}}
				p.Drift = append(p.Drift, f)
				p.Drifted[n.Node] = t0
			}
			if n.State != audit.NodeMissing && n.State != audit.NodePending {
				p.Reporting++
			}
		}
		json.NewEncoder(w).Encode(PartialResponse{Replica: replica, Shards: shards, Partial: p})
	}
}

// nodesIn returns count node names whose shard (of shards) is k.
func nodesIn(k, shards, count int) []string {
	var out []string
	for i := 0; len(out) < count; i++ {
		if name := fmt.Sprintf("node-%d", i); shard.Of(name, shards) == k {
			out = append(out, name)
		}
	}
	return out
}

func names(parts []audit.Partial) []string {
	var out []string
	for _, p := range parts {
		for _, n := range p.Nodes {
			out = append(out, n.Node)
		}
	}
	slices.Sort(out)
	return out
}

// The leader reads every holder's partial and takes each shard once,
// from the replica the Leases name, whatever the others send: a peer
// still showing a shard it handed over, one answering garbage, too much,
// as someone else, or not at all. A shard nobody answers for is counted
// unheard; a holder's last good partial stands for 10 s, no longer.
func TestGatherTakesEachShardOnceFromItsHolder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 4
		port, client, peers := peersOn(t, 2)
		a, b := peers[0], peers[1]
		clk := clocktesting.NewFakeClock(t0)
		holders := []string{"127.0.0.1:9443", a.identity, b.identity, ""}
		agg := New(Config{Self: "127.0.0.1:9443", Log: zaptest.NewLogger(t), Clock: clk,
			Shards: &Shards{Count: shards, Port: port, Client: client, Holders: func() []string { return holders }}}, view.New(view.Config{Client: fake.NewClientset()}))
		in := func(k int) []string { return nodesIn(k, shards, 2) }
		status := func(names []string, st audit.NodeState) []audit.NodeStatus {
			var out []audit.NodeStatus
			for _, n := range names {
				out = append(out, audit.NodeStatus{Node: n, State: st})
			}
			return out
		}
		agg.publishPartial(audit.Partial{Nodes: status(in(0), audit.NodeInSync), Reporting: 2}, []int{0})
		// a holds shard 1, and still shows shard 2's nodes it handed to b.
		a.serve(partialAnswer(a.identity, []int{1, 2}, append(status(in(1), audit.NodeInSync), status(in(2), audit.NodeStuck)...)...))
		b.serve(partialAnswer(b.identity, []int{2}, status(in(2), audit.NodeInSync)...))

		parts, unheard := agg.gatherPartials(context.Background(), clk.Now())
		want := slices.Sorted(slices.Values(slices.Concat(in(0), in(1), in(2))))
		if got := names(parts); !slices.Equal(got, want) {
			t.Errorf("nodes gathered %v, want %v (each shard once, from its holder)", got, want)
		}
		if !slices.Equal(unheard, []int{3}) {
			t.Errorf("unheard %v, want [3] (nobody holds it)", unheard)
		}
		v := audit.Conclude(audit.DefaultPolicy(), parts...)
		for _, n := range v.Nodes {
			if n.State != audit.NodeInSync {
				t.Errorf("%s %s: a shard's former holder's view was taken over its holder's", n.Node, n.State)
			}
		}

		hostile := []struct {
			name string
			f    func(w http.ResponseWriter)
		}{
			{"garbage", func(w http.ResponseWriter) { w.Write([]byte("{\"replica\": [1,2")) }},
			{"another replica's name", partialAnswer("10.0.0.9:9443", []int{1}, status(in(1), audit.NodeStuck)...)},
			{"an error", func(w http.ResponseWriter) { http.Error(w, "no", http.StatusForbidden) }},
			{"more than 64 MiB", func(w http.ResponseWriter) {
				w.Write([]byte(`{"replica":"` + a.identity + `","partial":{"nodes":[`))
				chunk := []byte(strings.Repeat(`{"node":"x"},`, 1<<12))
				for written := 0; written <= maxPartialBytes; written += len(chunk) {
					if _, err := w.Write(chunk); err != nil {
						return
					}
				}
			}},
			{"silence", nil}, // answers nothing until the leader gives up
		}
		// One after another in the bubble (no subtests in a bubble).
		for _, h := range hostile {
			func() {
				a.serve(h.f)
				if h.f == nil {
					a.answerWith(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
				}
				failed := testutil.ToFloat64(agg.cfg.Metrics.PartialReads.WithLabelValues("failed"))
				clk.Step(time.Second)
				start := time.Now()
				parts, unheard := agg.gatherPartials(context.Background(), clk.Now())
				// The bubble's time: exactly what the leader waited.
				if took := time.Since(start); took > 2*time.Second {
					t.Errorf("a peer's %s held the leader %s (bound: 2 s)", h.name, took)
				}
				if testutil.ToFloat64(agg.cfg.Metrics.PartialReads.WithLabelValues("failed")) != failed+1 {
					t.Errorf("a peer's %s was not counted as a failed read", h.name)
				}
				// Its last good partial stands (within 10 s).
				if got := names(parts); !slices.Equal(got, want) || !slices.Equal(unheard, []int{3}) {
					t.Errorf("after a peer's %s: nodes %v, unheard %v; want %v and [3] (its last good partial)", h.name, got, unheard, want)
				}
			}()
		}
		a.serve(func(w http.ResponseWriter) { http.Error(w, "gone", http.StatusServiceUnavailable) })
		clk.Step(partialStale + time.Second)
		parts, unheard = agg.gatherPartials(context.Background(), clk.Now())
		if got := names(parts); slices.ContainsFunc(got, func(n string) bool { return slices.Contains(in(1), n) }) || !slices.Equal(unheard, []int{1, 3}) {
			t.Errorf("a holder silent for over 10 s: nodes %v, unheard %v; want its shard 1 unheard", got, unheard)
		}
	})
}

// The mass-divergence guard sees the fleet, not a shard: every node of
// one shard drifted is 2 of 6 nodes here, under the 50 % share, so it is
// reported node by node; the same drift over most shards is one
// MassDivergence and no node finding.
func TestConcludeOverShardsGuardsTheFleet(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 3
		port, client, peers := peersOn(t, 2)
		clk := clocktesting.NewFakeClock(t0)
		holders := []string{"127.0.0.1:9443", peers[0].identity, peers[1].identity}
		agg := New(Config{Self: "127.0.0.1:9443", Log: zaptest.NewLogger(t), Clock: clk, Policy: audit.Policy{MassShare: 0.5, MassMinNodes: 3},
			Shards: &Shards{Count: shards, Port: port, Client: client, Holders: func() []string { return holders }}}, view.New(view.Config{Client: fake.NewClientset()}))
		st := func(k int, s audit.NodeState) []audit.NodeStatus {
			var out []audit.NodeStatus
			for _, n := range nodesIn(k, shards, 2) {
				out = append(out, audit.NodeStatus{Node: n, State: s})
			}
			return out
		}
		own := func(s audit.NodeState) {
			rec := httptest.NewRecorder()
			partialAnswer(agg.cfg.Self, []int{0}, st(0, s)...)(rec)
			var p PartialResponse
			json.Unmarshal(rec.Body.Bytes(), &p)
			agg.publishPartial(p.Partial, []int{0})
		}
		own(audit.NodeInSync)
		peers[0].serve(partialAnswer(peers[0].identity, []int{1}, st(1, audit.NodeStuck)...))
		peers[1].serve(partialAnswer(peers[1].identity, []int{2}, st(2, audit.NodeInSync)...))
		parts, _ := agg.gatherPartials(context.Background(), clk.Now())
		v := audit.Conclude(agg.cfg.Policy, parts...)
		if kinds := kindsOf(v); strings.Contains(kinds, string(audit.MassDivergence)) || strings.Count(kinds, string(audit.StaleEndpoint)) != 2 {
			t.Errorf("one shard's 2 of 6 nodes drifted: %s; want their 2 findings", kinds)
		}
		own(audit.NodeStuck)
		peers[1].serve(partialAnswer(peers[1].identity, []int{2}, st(2, audit.NodeStuck)...))
		clk.Step(time.Second)
		parts, _ = agg.gatherPartials(context.Background(), clk.Now())
		v = audit.Conclude(agg.cfg.Policy, parts...)
		if kinds := kindsOf(v); kinds != ":"+string(audit.MassDivergence) {
			t.Errorf("every shard's nodes drifted: %s; want one MassDivergence", kinds)
		}
	})
}

// The internal API admits the aggregator's own ServiceAccount, with a
// token for the peers' audience only: no token, a string that is no JWT
// or not for that audience (refused unreviewed), a token of another user,
// one the API server rejects. An admitted token is reviewed once until it
// expires. A flood of junk from one pod costs the API server its small
// share and never holds back the replicas (trust review 4, item 3: 151 of
// 180 partial reads were refused under 20 forged tokens a second).
func TestPeerAuth(t *testing.T) {
	const me = "system:serviceaccount:proxyaudit:proxyaudit-aggregator"
	client := fake.NewClientset()
	var mu sync.Mutex
	reviews := 0
	exp := t0.Add(time.Hour)
	replicaToken, readerToken := authtest.JWT(auth.DefaultPeerAudience, "", exp)+"replica", authtest.JWT(auth.DefaultPeerAudience, "", exp)+"reader"
	client.PrependReactor("create", "tokenreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		reviews++
		mu.Unlock()
		tr := action.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		aud := tr.Spec.Audiences
		switch {
		case tr.Spec.Token == replicaToken:
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: aud, User: authnv1.UserInfo{Username: me}}
		case tr.Spec.Token == readerToken:
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: aud, User: authnv1.UserInfo{Username: "system:serviceaccount:proxyaudit:proxyaudit-reader"}}
		default:
			tr.Status = authnv1.TokenReviewStatus{Error: "invalid bearer token"}
		}
		return true, tr, nil
	})
	clk := clocktesting.NewFakeClock(t0)
	pa := &auth.PeerAuth{Client: client, Username: me, Clock: clk, Replicas: func() []string { return []string{"198.18.0.2:9443"} }}
	h := pa.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("partial")) }))
	get := func(token, from string) int {
		r := httptest.NewRequest(http.MethodGet, "/internal/v1/partial", nil)
		r.RemoteAddr = from + ":40000"
		if token != "" {
			r.Header.Set("Authorization", "Bearer "+token)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		return rec.Code
	}
	const replica, pod = "198.18.0.2", "198.18.0.66"
	for _, c := range []struct {
		token string
		want  int
	}{{"", http.StatusUnauthorized}, {"not-a-jwt", http.StatusUnauthorized}, {authtest.JWT("proxyaudit", "", exp), http.StatusUnauthorized},
		{replicaToken, http.StatusOK}, {replicaToken, http.StatusOK}, {readerToken, http.StatusForbidden}, {authtest.JWT(auth.DefaultPeerAudience, "", exp) + "forged", http.StatusForbidden}} {
		if got := get(c.token, replica); got != c.want {
			t.Errorf("token %q: %d, want %d", c.token, got, c.want)
		}
	}
	if reviews != 3 {
		t.Errorf("%d reviews; want 3 (the replica's once, the reader's, the forged one; the rest refused unreviewed)", reviews)
	}
	clk.Step(50 * time.Minute)
	if get(replicaToken, replica) != http.StatusOK || reviews != 3 {
		t.Errorf("an admitted token was reviewed again before it expired (%d reviews)", reviews)
	}
	clk.Step(12 * time.Minute) // past its exp and a minute of clock skew
	if code := get(replicaToken, replica); code != http.StatusUnauthorized || reviews != 3 {
		t.Errorf("an expired token: %d after %d reviews; want refused unreviewed", code, reviews)
	}
	// A flood of forged JWTs from one pod: a small share reviewed, the
	// replica's new token admitted throughout.
	fresh := authtest.JWT(auth.DefaultPeerAudience, "", clk.Now().Add(time.Hour)) + "replica"
	replicaToken = fresh
	before, busy := reviews, 0
	for i := range 200 {
		if get(authtest.JWT(auth.DefaultPeerAudience, "", clk.Now().Add(time.Hour))+fmt.Sprint(i), pod) == http.StatusTooManyRequests {
			busy++
		}
		if i%20 == 0 && get(fresh, replica) != http.StatusOK {
			t.Fatalf("the replica was refused during a flood of forged tokens from another pod")
		}
	}
	if reviews-before > 3 || busy < 195 {
		t.Errorf("200 forged tokens from one pod cost %d reviews (%d told to retry): want its burst only", reviews-before-1, busy)
	}
}

// A sharded replica takes the streams of the nodes of the shards it
// holds, sends the others to their shard's holder, asks them to retry
// while nobody holds it, and on giving a shard up closes only that
// shard's streams (sending them on) and forgets only its nodes.
func TestShardAdmission(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 3
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		holders := []string{"127.0.0.1:1", "127.0.0.9:9443", ""}
		var hmu sync.Mutex
		h := startView(t, 2*time.Second, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: 50 * time.Millisecond}, func(c *Config) {
			c.Shards = &Shards{Count: shards, Port: "1", Holders: func() []string { hmu.Lock(); defer hmu.Unlock(); return slices.Clone(holders) }}
		})
		agg := h.agg
		shardCtx, give := context.WithCancel(ctx)
		held := make(chan struct{})
		go func() { agg.HoldShard(shardCtx, 0); close(held) }()
		h.eventually(5*time.Second, "shard 0 held", func() bool { agg.mu.Lock(); defer agg.mu.Unlock(); return agg.fleet.held[0] })

		mine, theirs, free := nodesIn(0, shards, 2), nodesIn(1, shards, 1)[0], nodesIn(2, shards, 1)[0]
		var conns []net.Conn
		for _, n := range mine {
			c := h.dial(n)
			expect(t, c, stream.TypeWelcome, "")
			conns = append(conns, c)
		}
		c := h.dial(theirs)
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if m, _, err := stream.Read(c, 1<<20); err != nil || m.Type != stream.TypeRedirect || m.Redirect.Leader != holders[1] {
			t.Errorf("a node of another replica's shard: %+v, %v; want a redirect to %s", m, err, holders[1])
		}
		expect(t, h.dial(free), stream.TypeReject, "no aggregator replica holds this node's shard")

		// The shard is given up (its new holder known): its streams are sent
		// on, and the replica keeps nothing of its nodes.
		hmu.Lock()
		holders[0] = "127.0.0.9:9443"
		hmu.Unlock()
		give()
		<-held
		for i, c := range conns {
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			m, _, err := stream.Read(c, 1<<20)
			if err != nil || m.Type != stream.TypeRedirect || m.Redirect.Leader != "127.0.0.9:9443" {
				t.Errorf("%s's stream when its shard was given up: %+v, %v; want a redirect to the new holder", mine[i], m, err)
			}
		}
		agg.mu.Lock()
		left := len(agg.fleet.nodes)
		agg.mu.Unlock()
		if left != 0 {
			t.Errorf("%d nodes remembered after their shard was given up", left)
		}
	})
}

// A sharded leader holding every shard itself goes the whole way through
// real collector clients: each node judged in its shard, the replica's
// partial published for the others, and the fleet's verdict concluded
// from it, with a divergent node found on that node only.
func TestShardedLeaderJudgesThroughItsPartial(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 2
		h := startView(t, 2*time.Second, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: 50 * time.Millisecond}, func(c *Config) {
			c.Shards = &Shards{Count: shards, Port: "1", Holders: func() []string { return []string{"127.0.0.1:1", "127.0.0.1:1"} }}
		})
		for k := range shards {
			h.holdShard(k)
		}
		for _, n := range []string{"n1", "n2"} {
			h.collector(h.ctx, n, func() *audit.Observed { return rules(t) })
		}
		h.collector(h.ctx, "n3", func() *audit.Observed { return rules(t, 0) })
		h.until(20*time.Second, "n3 found, n1 and n2 in sync", func() bool {
			v := h.verdict()
			states := map[string]audit.NodeState{}
			for _, n := range v.Nodes {
				states[n.Node] = n.State
			}
			return len(v.Findings) > 0 && len(findings.Only(v.Findings, "n3")) == len(v.Findings) && states["n1"] == audit.NodeInSync && states["n2"] == audit.NodeInSync
		})
		own := h.agg.own.Load()
		if own == nil || !slices.Equal(own.Shards, []int{0, 1}) || len(own.Partial.Nodes) != 3 || own.Partial.Reporting != 3 || len(own.Partial.Drifted) != 1 {
			t.Errorf("the replica's partial: %+v", own)
		}
	})
}

// One decider: a replica that judges a drifted node but does not lead
// never remediates it (no lookup of its kube-proxy, no page); the leader,
// which holds no shard of its own here, finds the drift in the holder's
// partial read over HTTP and alone acts on it. Budgets are spent in one
// place, however many replicas judge.
func TestOnlyTheLeaderActsOnAShardsDrift(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const shards = 2
		ln, err := netOf(t).Listen("127.0.0.3:0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		holder := "127.0.0.3:9443"
		lookups := func(c *fake.Clientset) *atomic.Int32 {
			var n atomic.Int32
			c.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
				n.Add(1)
				return false, nil, nil // no kube-proxy pod: the node is paged
			})
			return &n
		}
		withRemediation := func(client *fake.Clientset, rec *notes) func(*Config) {
			return func(c *Config) {
				ex := &effect.Executor{Client: client, Policy: remediate.DefaultPolicy(), Notifier: rec, Log: zaptest.NewLogger(t)}
				c.Remediation = &Remediation{Policy: remediate.DefaultPolicy(), Executor: ex}
			}
		}
		hClient, lClient := fakeCluster(), fakeCluster()
		hLookups, lLookups := lookups(hClient), lookups(lClient)
		hNotes, lNotes := &notes{open: map[string]bool{}}, &notes{open: map[string]bool{}}
		h := startView(t, 2*time.Second, auth.InsecureNoAuth{}, hClient, view.Config{Debounce: 50 * time.Millisecond}, withRemediation(hClient, hNotes), func(c *Config) {
			c.Self = holder
			c.Shards = &Shards{Count: shards, Port: port, Holders: func() []string { return []string{holder, holder} }}
		})
		h.agg.StoppedLeading() // it holds shards, the other replica leads
		srv := &http.Server{Handler: h.agg.InternalHandler()}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		for k := range shards {
			h.holdShard(k)
		}
		l := startView(t, 2*time.Second, auth.InsecureNoAuth{}, lClient, view.Config{Debounce: 50 * time.Millisecond}, withRemediation(lClient, lNotes), func(c *Config) {
			c.Self = "127.0.0.2:9443"
			c.Shards = &Shards{Count: shards, Port: port, Holders: func() []string { return []string{holder, holder} }}
		})
		h.collector(h.ctx, "n1", func() *audit.Observed { return rules(t, 0) })
		h.collector(h.ctx, "n2", func() *audit.Observed { return rules(t) })
		h.until(30*time.Second, "the leader remediating n1", func() bool {
			l.clk.Step(step)
			l.agg.Evaluate()
			return len(findings.Only(l.verdict().Findings, "n1")) > 0 && lLookups.Load() > 0
		})
		h.advance(5*time.Second, func() { l.clk.Step(step); l.agg.Evaluate() })
		if n := hLookups.Load(); n != 0 || h.agg.Verdict() != nil {
			t.Errorf("the replica that judges n1 but does not lead looked its kube-proxy up %d times (verdict %v): only the leader acts", n, h.agg.Verdict())
		}
		hNotes.mu.Lock()
		defer hNotes.mu.Unlock()
		if hNotes.noticed != 0 {
			t.Errorf("the replica that does not lead paged %d times", hNotes.noticed)
		}
	})
}

// Two replicas that each believe the other holds a node (Leases read at
// different moments): the leader's flush is passed to the one it believes
// holds the node, which answers from its own streams only, never passing
// it back: one request, and an error saying where the stream is not.
func TestFlushIsPassedOnOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ln, err := netOf(t).Listen("127.0.0.5:0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(ln.Addr().String())
		lnA, err := netOf(t).Listen(net.JoinHostPort("127.0.0.4", port))
		if err != nil {
			t.Fatal(err)
		}
		a, b := "127.0.0.4:9443", "127.0.0.5:9443"
		var served [2]atomic.Int32
		serve := func(h *harness, l net.Listener, n *atomic.Int32) {
			inner := h.agg.InternalHandler()
			srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { n.Add(1); inner.ServeHTTP(w, r) })}
			go srv.Serve(l)
			t.Cleanup(func() { srv.Close() })
		}
		believes := func(self, other string) func(*Config) {
			return func(c *Config) {
				c.Self = self
				c.Shards = &Shards{Count: 1, Port: port, Holders: func() []string { return []string{other} }}
			}
		}
		ha := startView(t, 2*time.Second, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: 50 * time.Millisecond}, believes(a, b))
		hb := startView(t, 2*time.Second, auth.InsecureNoAuth{}, fakeCluster(), view.Config{Debounce: 50 * time.Millisecond}, believes(b, a))
		serve(ha, lnA, &served[0])
		serve(hb, ln, &served[1])
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err = ha.agg.Flush(ctx, "n1", []remediate.StalePair{{Service: "synth/svc-00000", Port: "http", Protocol: "UDP", Frontend: "198.19.192.0:80/UDP", Dest: "198.18.0.18:8080", Flows: 1}})
		if err == nil || !strings.Contains(err.Error(), "replica "+b) || !strings.Contains(err.Error(), "no collector of node n1") {
			t.Errorf("flush of a node neither replica streams: %v; want the holder's answer that it has no stream", err)
		}
		if served[0].Load() != 0 || served[1].Load() != 1 {
			t.Errorf("requests: %d to the leader, %d to the replica it believes holds the node; want 0 and 1", served[0].Load(), served[1].Load())
		}
	})
}

// Sharded, the leader remediates nodes other replicas judge: it forgets
// a node when the node leaves the fleet's verdict, whoever held it, and
// not while the node's shard is unheard (its absence there says nothing).
func TestLeaderForgetsNodesThatLeftTheFleet(t *testing.T) {
	const shards = 4
	c := concluder{policy: audit.DefaultPolicy(), shards: shards}
	a, b, cn, d := nodesIn(0, shards, 1)[0], nodesIn(1, shards, 1)[0], nodesIn(2, shards, 1)[0], nodesIn(3, shards, 1)[0]
	part := func(names ...string) audit.Partial {
		p := audit.Partial{At: t0}
		for _, n := range names {
			p.Nodes = append(p.Nodes, audit.NodeStatus{Node: n, State: audit.NodeInSync})
		}
		return p
	}
	conclude := func(unheard []int, parts ...audit.Partial) []string {
		v, departed := c.conclude(t0, parts, unheard, false)
		if len(v.Nodes) == 0 {
			t.Fatal("an empty verdict")
		}
		return departed
	}
	if got := conclude(nil, part(a, b), part(cn, d)); len(got) != 0 {
		t.Fatalf("forgot %v of a fleet that lost nobody", got)
	}
	if got := conclude([]int{2}, part(a, b)); !slices.Equal(got, []string{d}) { // c's shard unheard, d gone
		t.Errorf("forgot %v, want [%s] (%s's shard is unheard)", got, d, cn)
	}
	if got := conclude(nil, part(a, b)); !slices.Equal(got, []string{cn}) { // c's shard heard: c is gone
		t.Errorf("forgot %v once its shard was heard, want [%s]", got, cn)
	}
	if got := conclude(nil, part(a, b)); len(got) != 0 {
		t.Errorf("forgot %v twice", got)
	}
}
