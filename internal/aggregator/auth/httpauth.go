package auth

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	authzv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/api"
)

// ReaderAuth decides who may read findings over the HTTP API: a caller
// with a token the API server authenticates for Audience, whom the API
// server allows to GET the aggregator's Service through its proxy
// (services/proxy on Namespace/Service). That is the permission the
// API server itself checks on the way in through its service proxy, which
// strips the caller's credentials; so `proxyaudit report` mints a
// short-lived token for a reader ServiceAccount (allowed by the chart's
// report-reader Role) and sends it in the api.TokenHeader, and a pod that
// reaches the port directly gets nothing without such a token.
type ReaderAuth struct {
	Client             kubernetes.Interface
	Audience           string
	Namespace, Service string
	Clock              clock.Clock
	// Denied observes every refusal by reason (metrics).
	Denied func(reason DenyReason)
	// Budget bounds the reviews of tokens not decided yet (a budget of the
	// readers' own: their flood cannot delay a collector); a reader over
	// it gets 429 and Retry-After. Nil: unbounded.
	Budget *Budget

	mu    sync.Mutex
	cache map[[32]byte]readerDecision
}

type readerDecision struct {
	err     error
	code    int
	expires time.Time
	// keepUntil: a reader allowed before goes on reading while the API
	// server cannot be asked (an outage is when findings matter most).
	keepUntil time.Time
}

// readerCacheFor is how long a decision stands: a revoked binding or token
// stops working within it. readerKeepFor is how long an allowed reader
// may go on reading while the API server cannot review tokens.
const (
	readerCacheFor = 30 * time.Second
	readerKeepFor  = 10 * time.Minute
)

// Wrap returns next behind the check.
func (ra *ReaderAuth) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token := r.Header.Get(api.TokenHeader)
		if token == "" {
			if h := r.Header.Get("Authorization"); strings.HasPrefix(h, "Bearer ") {
				token = strings.TrimPrefix(h, "Bearer ")
			}
		}
		if token == "" {
			ra.deny(w, http.StatusUnauthorized, DenyNoToken, fmt.Sprintf(
				"findings are for readers only: send a token with audience %q in %s or Authorization: Bearer "+
					"(`proxyaudit report` mints one for the reader ServiceAccount when you are bound to the proxyaudit report-reader Role)",
				ra.Audience, api.TokenHeader))
			return
		}
		code, err := ra.decide(r.Context(), token, sourceOf(r.RemoteAddr))
		if code == http.StatusTooManyRequests {
			w.Header().Set("Retry-After", "1")
		}
		if err != nil {
			reason := map[int]DenyReason{http.StatusUnauthorized: DenyUnauthenticated, http.StatusForbidden: DenyForbidden,
				http.StatusTooManyRequests: DenyBusy}[code]
			if reason == "" {
				reason = DenyReviewFailed
			}
			ra.deny(w, code, reason, err.Error())
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (ra *ReaderAuth) deny(w http.ResponseWriter, code int, reason DenyReason, msg string) {
	if ra.Denied != nil {
		ra.Denied(reason)
	}
	writeError(w, code, msg)
}

// decide reviews the token and the access, or answers from the cache. A
// token that cannot be one (not a JWT for Audience, or expired) is refused
// here, at no cost to the API server or the budget; the reviews the rest
// cost are shared out by source address, so one pod sending tokens cannot
// spend every reader's (genuine readers come through the API server's
// service proxy: its address is their source).
func (ra *ReaderAuth) decide(ctx context.Context, token, source string) (int, error) {
	key := sha256.Sum256([]byte(token))
	now := ra.Clock.Now()
	ra.mu.Lock()
	d, ok := ra.cache[key]
	ra.mu.Unlock()
	if ok && now.Before(d.expires) {
		return d.code, d.err
	}
	if err := precheck(token, ra.Audience, "", now); err != nil {
		return http.StatusUnauthorized, err
	}
	if err := ra.Budget.take(ctx, source, 0); err != nil {
		return http.StatusTooManyRequests, errors.New("too many reader tokens to review at once; retry in a second")
	}
	code, err := ra.review(ctx, token)
	if code == http.StatusServiceUnavailable {
		// The API's trouble, not the caller's: ask again next time, and
		// let a reader allowed shortly before go on reading.
		if ok && d.code == http.StatusOK && now.Before(d.keepUntil) {
			return http.StatusOK, nil
		}
		return code, err
	}
	nd := readerDecision{err: err, code: code, expires: now.Add(readerCacheFor)}
	if code == http.StatusOK {
		nd.keepUntil = now.Add(readerKeepFor)
	}
	ra.mu.Lock()
	if ra.cache == nil || len(ra.cache) >= 4096 {
		ra.cache = map[[32]byte]readerDecision{}
	}
	ra.cache[key] = nd
	ra.mu.Unlock()
	return code, err
}

func (ra *ReaderAuth) review(ctx context.Context, token string) (int, error) {
	u, err := reviewToken(ctx, ra.Client, token, ra.Audience)
	if errors.Is(err, ErrReviewUnavailable) {
		return http.StatusServiceUnavailable, fmt.Errorf("%v (retry)", err)
	} else if err != nil {
		return http.StatusUnauthorized, err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	extra := map[string]authzv1.ExtraValue{}
	for k, v := range u.Extra {
		extra[k] = authzv1.ExtraValue(v)
	}
	sar, err := ra.Client.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
		User: u.Username, Groups: u.Groups, UID: u.UID, Extra: extra,
		ResourceAttributes: &authzv1.ResourceAttributes{Namespace: ra.Namespace, Verb: "get", Resource: "services", Subresource: "proxy", Name: ra.Service},
	}}, metav1.CreateOptions{})
	if err != nil {
		return http.StatusServiceUnavailable, fmt.Errorf("cannot check %s's access with the API server (retry): %v", u.Username, err)
	}
	if !sar.Status.Allowed {
		return http.StatusForbidden, fmt.Errorf("%s may not read findings: it needs get on services/proxy %s/%s (the proxyaudit report-reader Role)",
			u.Username, ra.Namespace, ra.Service)
	}
	return http.StatusOK, nil
}

// sourceOf is a request's source address without its port.
func sourceOf(remote string) string {
	if h, _, err := net.SplitHostPort(remote); err == nil {
		return h
	}
	return remote
}

// DenyReason is why the HTTP API refused a reader: the value of
// proxyaudit_http_denied_total's reason label.
type DenyReason string

// Reasons a reader is refused.
const (
	DenyNoToken         DenyReason = "no_token"
	DenyUnauthenticated DenyReason = "unauthenticated"
	DenyForbidden       DenyReason = "forbidden"
	DenyReviewFailed    DenyReason = "review_failed"
	// DenyBusy: the readers' review budget is spent (429).
	DenyBusy DenyReason = "busy"
)

// writeError answers a refused reader as the HTTP API answers errors.
func writeError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(map[string]string{"error": msg})
}
