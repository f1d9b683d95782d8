package auth

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// The replicas' internal API (partials, explain and flush forwarded to a
// node's holder) is theirs alone, and carries what decides repairs: it is
// served over TLS with the aggregator's serving pair, and a caller shows a
// token minted for the peers' audience only (DefaultPeerAudience: the
// chart projects it into the replica's pod), never the replica's
// API-server credential. A listener at a replica's address without the
// serving key learns nothing (the token goes only inside TLS verified
// against the chart's CA) and is believed in nothing.

// DefaultPeerAudience is the audience of the token a replica shows the
// others.
const DefaultPeerAudience = "proxyaudit-peers"

// PeerAuth admits the other replicas to the internal API: a bearer token
// that could be a peers token (a JWT for Audience, not expired: checked
// before anything is asked), which the API server authenticates for
// Audience as Username, the ServiceAccount every replica runs as. An
// admitted token is remembered until it expires (at most peerCacheMax),
// so a replica is reviewed once per token the kubelet rotates in; a
// refusal for readerCacheFor. Reviews of new tokens share a budget: the
// addresses of the replicas (Replicas) have one of their own, every other
// source a small share of the rest, so junk tokens from one pod can
// neither cost the API server much nor hold the replicas' reads back.
type PeerAuth struct {
	Client   kubernetes.Interface
	Username string
	Audience string
	Clock    clock.PassiveClock
	// Replicas are the replicas' addresses (host or host:port) as last
	// known: the shard holders and the peers Service's endpoints.
	Replicas func() []string

	once                sync.Once
	replicas, strangers *Budget
	mu                  sync.Mutex
	cache               map[[32]byte]peerDecision
}

type peerDecision struct {
	err     error
	expires time.Time
}

// peerCacheMax bounds how long an admission stands without a review (a
// projected token lives an hour by default).
const peerCacheMax = time.Hour

// Wrap returns next behind the check.
func (pa *PeerAuth) Wrap(next http.Handler) http.Handler {
	pa.once.Do(func() {
		if pa.Audience == "" {
			pa.Audience = DefaultPeerAudience
		}
		pa.replicas = NewBudget(20, 40, 5, 10)
		pa.strangers = NewBudget(2, 4, 0.5, 1)
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || token == "" {
			writeError(w, http.StatusUnauthorized, "the internal API is for the aggregator's replicas: send a token for audience "+pa.Audience+" as Authorization: Bearer")
			return
		}
		if code, err := pa.decide(r.Context(), token, sourceOf(r.RemoteAddr)); err != nil {
			if code == http.StatusTooManyRequests {
				w.Header().Set("Retry-After", "1")
			}
			writeError(w, code, err.Error())
			return
		}
		next.ServeHTTP(w, r)
	})
}

// replica says whether source is a replica's address.
func (pa *PeerAuth) replica(source string) bool {
	if pa.Replicas == nil {
		return false
	}
	for _, r := range pa.Replicas() {
		if host, _, err := net.SplitHostPort(r); err == nil {
			r = host
		}
		if r == source {
			return true
		}
	}
	return false
}

func (pa *PeerAuth) decide(ctx context.Context, token, source string) (int, error) {
	key := sha256.Sum256([]byte(token))
	now := pa.Clock.Now()
	pa.mu.Lock()
	d, ok := pa.cache[key]
	pa.mu.Unlock()
	if ok && now.Before(d.expires) {
		if d.err != nil {
			return http.StatusForbidden, d.err
		}
		return http.StatusOK, nil
	}
	if err := precheck(token, pa.Audience, "", now); err != nil {
		return http.StatusUnauthorized, err
	}
	budget := pa.strangers
	if pa.replica(source) {
		budget = pa.replicas
	}
	if err := budget.take(ctx, source, 0); err != nil {
		return http.StatusTooManyRequests, errors.New("too many tokens to review at once; retry in a second")
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tr, err := pa.Client.AuthenticationV1().TokenReviews().Create(rctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: token, Audiences: []string{pa.Audience}}}, metav1.CreateOptions{})
	if err != nil {
		return http.StatusServiceUnavailable, fmt.Errorf("cannot review the token with the API server (retry): %v", err)
	}
	expires := now.Add(readerCacheFor)
	switch {
	case !tr.Status.Authenticated:
		err = fmt.Errorf("token not valid: %s", safetext.Clean(tr.Status.Error, 80))
	case !slices.Contains(tr.Status.Audiences, pa.Audience):
		err = fmt.Errorf("the token is not for audience %s", pa.Audience)
	case tr.Status.User.Username != pa.Username:
		err = fmt.Errorf("%s is not an aggregator replica (%s): the internal API is theirs alone", safetext.Clean(tr.Status.User.Username, 80), pa.Username)
	default:
		expires = now.Add(peerCacheMax)
		if exp := tokenExpiry(token); !exp.IsZero() && exp.Before(expires) {
			expires = exp
		}
	}
	pa.mu.Lock()
	if pa.cache == nil || len(pa.cache) >= 1024 {
		pa.cache = map[[32]byte]peerDecision{}
	}
	pa.cache[key] = peerDecision{err: err, expires: expires}
	pa.mu.Unlock()
	if err != nil {
		return http.StatusForbidden, err
	}
	return http.StatusOK, nil
}

// PeerClientConfig is how a replica calls the others.
type PeerClientConfig struct {
	// Roots are the CAs a replica's certificate must chain to, as of now
	// (the TLS Secret's ca.crt, re-read when it changes).
	Roots func() *x509.CertPool
	// ServerName is the name the replicas' certificate carries for them
	// (the peers Service's), checked whatever address is dialed.
	ServerName string
	// TokenFile holds the peers token (projected by the kubelet, which
	// rotates it); it is read again when it changes.
	TokenFile string
	Timeout   time.Duration
}

// NewPeerClient is the HTTP client of a replica's calls to the others:
// TLS verified against Roots and ServerName (a listener at a replica's
// address without the serving key fails the handshake, before the token
// is sent), the peers token as Authorization: Bearer, no redirects.
func NewPeerClient(cfg PeerClientConfig) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12,
		// Verified below against the roots as they are at each handshake
		// (a rotated CA is trusted without a restart).
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			roots := cfg.Roots()
			if roots == nil {
				return errors.New("no CA to verify the replicas' certificate with (the TLS Secret's ca.crt)")
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("the replica presented no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: cfg.ServerName,
				KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
			return err
		}}
	return &http.Client{Timeout: cfg.Timeout, Transport: &peerToken{base: tr, file: cfg.TokenFile},
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return errors.New("a replica answered with a redirect: not followed")
		}}
}

// peerToken adds the peers token to each request.
type peerToken struct {
	base http.RoundTripper
	file string

	mu    sync.Mutex
	token string
	stamp string
}

func (p *peerToken) RoundTrip(r *http.Request) (*http.Response, error) {
	tok, err := p.current()
	if err != nil {
		return nil, err
	}
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+tok)
	return p.base.RoundTrip(r)
}

// current is the token file's content, read again when the file changed.
func (p *peerToken) current() (string, error) {
	fi, err := os.Stat(p.file)
	if err != nil {
		return "", fmt.Errorf("the peers token (%s): %w", p.file, err)
	}
	stamp := fmt.Sprint(fi.ModTime().UnixNano(), fi.Size())
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.token != "" && stamp == p.stamp {
		return p.token, nil
	}
	b, err := os.ReadFile(p.file)
	if err != nil {
		return "", fmt.Errorf("the peers token (%s): %w", p.file, err)
	}
	if p.token, p.stamp = strings.TrimSpace(string(b)), stamp; p.token == "" {
		return "", fmt.Errorf("the peers token file %s is empty", p.file)
	}
	return p.token, nil
}
