package aggregator

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
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
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// recorder is a listener at a replica's address that is not a replica:
// it keeps every byte it is sent.
type recorder struct {
	mu   sync.Mutex
	seen bytes.Buffer
}

func (r *recorder) keep(c net.Conn) net.Conn { return &recordingConn{Conn: c, r: r} }

type recordingConn struct {
	net.Conn
	r *recorder
}

func (c *recordingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.r.mu.Lock()
	c.r.seen.Write(b[:n])
	c.r.mu.Unlock()
	return n, err
}

type recordingListener struct {
	net.Listener
	r *recorder
}

func (l recordingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return l.r.keep(c), nil
}

// The replicas' internal API carried their API-server credential in clear
// and believed any answer: a listener at the holder's address took the
// token and had its forged flush answer ("deleted 1000") taken as the
// result (trust review 4, item 2). Through the real peer client: a
// genuine replica (TLS with the chart's CA and the peers' name, its
// peers token admitted) is read; a listener at its address, plain or
// with a certificate of its own for the right name, learns nothing (no
// token in the bytes it receives) and is believed in nothing (neither its
// partial nor its flush answer).
func TestPeersTrustOnlyTheReplicas(t *testing.T) {
	const name = "proxyaudit-aggregator-headless.proxyaudit.svc"
	const me = "system:serviceaccount:proxyaudit:proxyaudit-aggregator"
	roots, cert := testkit.ServingPair(t, name)
	_, impostorCert := testkit.ServingPair(t, name) // the right name, another CA
	exp := time.Now().Add(time.Hour)
	token := authtest.JWT(auth.DefaultPeerAudience, "", exp)
	tokenFile := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tokenFile, []byte(token+"\n"), 0o600)
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		tr := action.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		if tr.Spec.Token == token {
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences, User: authnv1.UserInfo{Username: me}}
		}
		return true, tr, nil
	})

	// The genuine replica, and two impostors on the same port of other
	// addresses (the leader dials host:Port of whatever the Leases name).
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	clk := clocktesting.NewFakeClock(time.Now())
	replica := New(Config{Self: "127.0.0.2:9443", Log: zaptest.NewLogger(t), Clock: clk, Shards: &Shards{Count: 2, Port: port,
		Auth: &auth.PeerAuth{Client: client, Username: me, Clock: clk}}}, view.New(view.Config{Client: fake.NewClientset()}))
	replica.partials.publish(audit.Partial{Nodes: []audit.NodeStatus{{Node: "n1", State: audit.NodeInSync}}, Drifted: map[string]time.Time{}}, []int{1}, clk.Now())
	genuine := &http.Server{Handler: replica.InternalHandler()}
	go genuine.Serve(tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}}))
	defer genuine.Close()

	forged := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/flush") {
			writeJSON(w, http.StatusOK, []remediate.FlushResult{{Deleted: 1000}})
			return
		}
		writeJSON(w, http.StatusOK, PartialResponse{Replica: "127.0.0." + r.Host[8:9] + ":9443", Shards: []int{0, 1},
			Partial: audit.Partial{Nodes: []audit.NodeStatus{{Node: "n1", State: audit.NodeStuck}}}})
	})
	var plainSeen, tlsSeen recorder
	plainLn, err := net.Listen("tcp", "127.0.0.3:"+port)
	if err != nil {
		t.Fatal(err)
	}
	plain := &http.Server{Handler: forged}
	go plain.Serve(recordingListener{plainLn, &plainSeen})
	defer plain.Close()
	tlsLn, err := net.Listen("tcp", "127.0.0.4:"+port)
	if err != nil {
		t.Fatal(err)
	}
	impostor := &http.Server{Handler: forged}
	go impostor.Serve(tls.NewListener(recordingListener{tlsLn, &tlsSeen}, &tls.Config{Certificates: []tls.Certificate{impostorCert}}))
	defer impostor.Close()

	leader := New(Config{Self: "127.0.0.1:9443", Log: zaptest.NewLogger(t), Clock: clk, Shards: &Shards{Count: 2, Port: port, TLS: true,
		Holders: func() []string { return []string{"127.0.0.2:9443", "127.0.0.2:9443"} },
		// A generous timeout: what is tested is whom the leader believes,
		// and under -race beside the end-to-end stage (make test) the
		// genuine replica's first answer took over 5 s once.
		Client: auth.NewPeerClient(auth.PeerClientConfig{Roots: func() *x509.CertPool { return roots }, ServerName: name, TokenFile: tokenFile, Timeout: time.Minute})}},
		view.New(view.Config{Client: fake.NewClientset()}))
	ctx := context.Background()
	if p, _, err := leader.fetchPartial(ctx, "127.0.0.2:9443", ""); err != nil || len(p.Partial.Nodes) != 1 {
		t.Fatalf("the genuine replica's partial: %+v, %v", p, err)
	}
	for _, addr := range []string{"127.0.0.3:9443", "127.0.0.4:9443"} {
		if p, _, err := leader.fetchPartial(ctx, addr, ""); err == nil {
			t.Errorf("%s, not a replica, was believed: %+v", addr, p)
		} else {
			t.Logf("%s: %v", addr, err)
		}
		leader.cfg.Shards.Holders = func() []string { return []string{addr, addr} }
		if res, err := leader.flushOnHolder(ctx, "n1", []remediate.StalePair{{}}); err == nil {
			t.Errorf("%s's flush answer was believed: %+v", addr, res)
		}
	}
	for what, r := range map[string]*recorder{"a plain listener": &plainSeen, "a TLS listener with a certificate of its own": &tlsSeen} {
		r.mu.Lock()
		got := r.seen.String()
		r.mu.Unlock()
		if strings.Contains(got, token) || strings.Contains(got, "Bearer") {
			t.Errorf("%s at a replica's address received the peers token", what)
		}
		if what == "a TLS listener with a certificate of its own" && len(got) == 0 {
			t.Errorf("%s was never dialed: the test proves nothing", what)
		}
	}
}

// BenchmarkPartialReadOverTheWire is the leader's read of one holder's
// partial as it is made (6,250 nodes under BenchmarkPartialRead's churn):
// the holder's internal handler behind auth.PeerAuth, an HTTP GET on a kept
// connection, the bounded decode and the mirror's apply; over plain HTTP
// (as before trust review 4) and over TLS with the peers token (now), side
// by side: the ratio is what TLS costs a read.
func BenchmarkPartialReadOverTheWire(b *testing.B) {
	const name = "proxyaudit-aggregator-headless.proxyaudit.svc"
	const me = "system:serviceaccount:proxyaudit:proxyaudit-aggregator"
	roots, cert := testkit.ServingPair(b, name)
	token := authtest.JWT(auth.DefaultPeerAudience, "", time.Now().Add(time.Hour))
	tokenFile := filepath.Join(b.TempDir(), "token")
	os.WriteFile(tokenFile, []byte(token+"\n"), 0o600)
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		tr := action.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		tr.Status = authnv1.TokenReviewStatus{Authenticated: tr.Spec.Token == token, Audiences: tr.Spec.Audiences, User: authnv1.UserInfo{Username: me}}
		return true, tr, nil
	})
	for _, kind := range []string{"plain", "tls"} {
		b.Run(kind, func(b *testing.B) {
			r := mrand.New(mrand.NewPCG(1, 2))
			clk := clocktesting.NewFakeClock(t0)
			replica := New(Config{Self: "127.0.0.2:9443", Log: zap.NewNop(), Clock: clk, Shards: &Shards{Count: 2, Port: "0",
				Auth: &auth.PeerAuth{Client: client, Username: me, Clock: clk}}}, view.New(view.Config{Client: fake.NewClientset()}))
			var p audit.Partial
			for i := range 6250 {
				p.Nodes = append(p.Nodes, audit.NodeStatus{Node: fmt.Sprintf("ip-10-1-%d-%d.ec2.internal", i/250, i%250), State: audit.NodeInSync, Mode: audit.ModeIPTables})
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			// The replicas' client carries the token either way; its TLS
			// settings count only for https.
			hc := auth.NewPeerClient(auth.PeerClientConfig{Roots: func() *x509.CertPool { return roots }, ServerName: name, TokenFile: tokenFile, Timeout: 5 * time.Second})
			scheme := "http"
			if kind == "tls" {
				ln = tls.NewListener(ln, &tls.Config{Certificates: []tls.Certificate{cert}})
				scheme = "https"
			}
			srv := &http.Server{Handler: replica.InternalHandler()}
			go srv.Serve(ln)
			defer srv.Close()
			u := scheme + "://" + ln.Addr().String() + "/internal/v1/partial"
			var m partialMirror
			var size int
			read := func() {
				clk.Step(time.Second)
				p = churn(r, p, clk.Now())
				replica.partials.publish(p, []int{1}, clk.Now())
				resp, err := hc.Get(u + m.query())
				if err != nil {
					b.Fatal(err)
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				if err != nil || resp.StatusCode != http.StatusOK {
					b.Fatalf("%v: %s", err, body)
				}
				got, err := decodePartial(body, 7000)
				if err != nil {
					b.Fatal(err)
				}
				if err := m.apply(got); err != nil {
					b.Fatal(err)
				}
				size = len(body)
			}
			for range 30 { // past detailEvery, as BenchmarkPartialRead
				read()
			}
			for b.Loop() {
				read()
			}
			b.ReportMetric(float64(size), "bytes/read")
		})
	}
}
