// Package auth decides who may talk to the aggregator: collectors (their
// tokens reviewed by the API server, bound to their node and, optionally,
// to the collector DaemonSet's pods), readers of the HTTP API, and the other
// replicas on the internal API; and the review budgets that keep a flood
// of junk tokens from the API server and from the collectors' admissions.
// It knows nothing of streams or judging: the aggregator asks it.
package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"
)

// Authenticator decides whether a stream may report for the node its hello
// names. An error is the reason, told to the collector and logged.
type Authenticator interface {
	// Authenticate returns until when the credentials hold (zero: no
	// end): the stream must be renewed in-band before then.
	Authenticate(ctx context.Context, h Hello) (time.Time, error)
}

// Hello is what a collector's hello claims, and where it came from.
type Hello struct {
	Node, Token string
	// Source is the stream's remote host.
	Source string
}

// ErrUnauthenticated wraps every refusal, so callers can count them apart
// from API failures.
var ErrUnauthenticated = errors.New("unauthenticated")

// NodeNameExtra is the TokenReview extra the API server fills from a
// pod-bound ServiceAccount token: the node the pod runs on.
const NodeNameExtra = "authentication.kubernetes.io/node-name"

// TokenReviewAuth accepts a projected ServiceAccount token when a
// TokenReview says it is valid for Audience, belongs to one of
// ServiceAccounts, and is bound to a pod on the very node the collector
// claims: a collector cannot report for another node.
type TokenReviewAuth struct {
	Client   kubernetes.Interface
	Audience string
	// ServiceAccounts are "namespace/name" of the collector's accounts.
	ServiceAccounts []string
	Clock           clock.PassiveClock
	// CacheFor keeps a positive review (the token re-sent on a reconnect
	// is not reviewed again); zero means one minute.
	CacheFor time.Duration
	// Budget bounds the reviews of collectors' tokens: a hello waits up to
	// BudgetWait for one, then is refused as busy (the collector retries
	// with its backoff). Nil: unbounded.
	Budget     *Budget
	BudgetWait time.Duration
	// Binding, when set, admits only pods of the collector DaemonSet.
	Binding *DaemonSetBinding

	mu    sync.Mutex
	cache map[[32]byte]cached
}

type cached struct {
	node    string
	expires time.Time
	token   time.Time // the token's own expiry
}

// Authenticate implements Authenticator.
func (a *TokenReviewAuth) Authenticate(ctx context.Context, h Hello) (time.Time, error) {
	node, token := h.Node, h.Token
	if token == "" {
		return time.Time{}, fmt.Errorf("%w: no token in hello (mount a projected ServiceAccount token with audience %q and pass --token-file)", ErrUnauthenticated, a.Audience)
	}
	key := sha256.Sum256([]byte(token))
	now := a.Clock.Now()
	a.mu.Lock()
	if c, ok := a.cache[key]; ok && now.Before(c.expires) {
		a.mu.Unlock()
		if c.node != node {
			return time.Time{}, fmt.Errorf("%w: token is bound to node %q, not %q", ErrUnauthenticated, c.node, node)
		}
		return c.token, nil
	}
	a.mu.Unlock()
	// What could never pass is refused without asking the API server.
	if err := precheck(token, a.Audience, node, now); err != nil {
		return time.Time{}, err
	}
	if err := a.Budget.take(ctx, h.Source, a.BudgetWait); err != nil {
		return time.Time{}, err
	}
	user, err := reviewToken(ctx, a.Client, token, a.Audience)
	if err != nil {
		return time.Time{}, err
	}
	sa, ok := strings.CutPrefix(user.Username, "system:serviceaccount:")
	sa = strings.Replace(sa, ":", "/", 1)
	if !ok || !slices.Contains(a.ServiceAccounts, sa) {
		return time.Time{}, fmt.Errorf("%w: %s is not a collector service account (allowed: %s)", ErrUnauthenticated, user.Username, strings.Join(a.ServiceAccounts, ", "))
	}
	bound := user.Extra[NodeNameExtra]
	if len(bound) != 1 {
		return time.Time{}, fmt.Errorf("%w: token of %s is not bound to a pod on a node (use a projected ServiceAccount token from the collector pod)", ErrUnauthenticated, sa)
	}
	if bound[0] != node {
		return time.Time{}, fmt.Errorf("%w: token is bound to node %q, not %q", ErrUnauthenticated, bound[0], node)
	}
	if a.Binding != nil {
		if err := a.Binding.Check(ctx, user.Extra, node); err != nil {
			return time.Time{}, fmt.Errorf("%w: %v", ErrUnauthenticated, err)
		}
	}
	// The API server verified the token's signature: its expiry is
	// the API server's word.
	expires := tokenExpiry(token)
	keep := a.CacheFor
	if keep <= 0 {
		keep = time.Minute
	}
	a.mu.Lock()
	if a.cache == nil || len(a.cache) > 100_000 {
		a.cache = map[[32]byte]cached{}
	}
	until := now.Add(keep)
	if !expires.IsZero() && expires.Before(until) {
		until = expires
	}
	a.cache[key] = cached{node: bound[0], expires: until, token: expires}
	a.mu.Unlock()
	return expires, nil
}

// ErrReviewUnavailable wraps a TokenReview the API server could not answer:
// the token is neither good nor bad yet.
var ErrReviewUnavailable = errors.New("cannot review the token with the API server (the aggregator needs create on tokenreviews)")

// reviewToken asks the API server who token belongs to, accepting it only
// for audience. Errors wrap ErrUnauthenticated (the token is refused) or
// ErrReviewUnavailable (the API server could not say).
func reviewToken(ctx context.Context, client kubernetes.Interface, token, audience string) (authnv1.UserInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tr, err := client.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{
		Spec: authnv1.TokenReviewSpec{Token: token, Audiences: []string{audience}},
	}, metav1.CreateOptions{})
	if err != nil {
		return authnv1.UserInfo{}, fmt.Errorf("%w: %v", ErrReviewUnavailable, err)
	}
	s := tr.Status
	switch {
	case !s.Authenticated:
		reason := s.Error
		if reason == "" {
			reason = "token not valid"
		}
		return authnv1.UserInfo{}, fmt.Errorf("%w: %s (expired, revoked, or not issued for audience %q)", ErrUnauthenticated, reason, audience)
	case !slices.Contains(s.Audiences, audience):
		return authnv1.UserInfo{}, fmt.Errorf("%w: token audiences %v do not include %q", ErrUnauthenticated, s.Audiences, audience)
	}
	return s.User, nil
}

// InsecureNoAuth accepts every stream. For local experiments only: the
// aggregator warns on every connection.
type InsecureNoAuth struct{}

// Authenticate implements Authenticator.
func (InsecureNoAuth) Authenticate(context.Context, Hello) (time.Time, error) {
	return time.Time{}, nil
}

// AuthFunc adapts a function that grants no end to an Authenticator.
type AuthFunc func(ctx context.Context, h Hello) error

// Authenticate implements Authenticator.
func (f AuthFunc) Authenticate(ctx context.Context, h Hello) (time.Time, error) {
	return time.Time{}, f(ctx, h)
}
