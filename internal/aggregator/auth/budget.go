package auth

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// ErrBusy refuses a hello while the budget of token reviews is spent: the
// collector retries with its jittered backoff, and the reviews the API
// server sees stay at the budget's rate.
var ErrBusy = errors.New("busy: the aggregator is reviewing as many tokens as it may; retry shortly")

// BusyError is an ErrBusy that says when a review is likely free: the
// collector comes back then (with jitter) instead of doubling its backoff,
// so a fleet reconnecting after a leader change is admitted at the
// budget's rate, not at the pace of the longest backoffs.
type BusyError struct {
	RetryAfter time.Duration
	why        string
}

func (e *BusyError) Error() string {
	return fmt.Sprintf("%v%s (retry in %s)", ErrBusy, e.why, e.RetryAfter.Round(100*time.Millisecond))
}

// Unwrap makes a BusyError an ErrBusy.
func (e *BusyError) Unwrap() error { return ErrBusy }

// Budget bounds the token reviews (and access reviews) one kind of caller
// costs the API server: a rate over all of them, and a smaller one per
// source address, so that one host sending junk tokens spends its own
// share, not everyone's. Collectors and HTTP readers have budgets of their
// own: a flood of reader tokens cannot delay a collector's admission.
type Budget struct {
	all       *rate.Limiter
	perSource rate.Limit
	burst     int

	mu      sync.Mutex
	sources map[string]*rate.Limiter
	// promised is the latest slot handed to a refused caller: each
	// refusal gets the next one, so a crowd told to come back returns
	// spread at the budget's rate, not all at once.
	promised time.Time
}

// NewBudget allows perSecond reviews (bursting to burst) over all callers,
// and perSource a second (bursting to sourceBurst) from one address; 0
// leaves sources unbounded.
func NewBudget(perSecond float64, burst int, perSource float64, sourceBurst int) *Budget {
	return &Budget{all: rate.NewLimiter(rate.Limit(perSecond), burst), perSource: rate.Limit(perSource), burst: sourceBurst,
		sources: map[string]*rate.Limiter{}}
}

// maxSources bounds the per-source limiters kept; beyond it they start
// afresh (a source then gets a new burst, not the whole budget).
const maxSources = 65536

// take reserves one review for source, waiting up to wait; ErrBusy when
// none is free by then. A nil budget allows everything.
func (b *Budget) take(ctx context.Context, source string, wait time.Duration) error {
	if b == nil {
		return nil
	}
	if b.perSource > 0 && source != "" {
		b.mu.Lock()
		l := b.sources[source]
		if l == nil {
			if len(b.sources) >= maxSources {
				clear(b.sources)
			}
			l = rate.NewLimiter(b.perSource, b.burst)
			b.sources[source] = l
		}
		b.mu.Unlock()
		if !l.Allow() {
			return &BusyError{RetryAfter: time.Duration(float64(time.Second) / float64(b.perSource)), why: " (more hellos from " + source + " than it may send)"}
		}
	}
	r := b.all.Reserve()
	if d := r.Delay(); d > wait {
		r.Cancel()
		return &BusyError{RetryAfter: b.slot(d, wait)}
	} else if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			r.Cancel()
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// slot hands a refused caller the next free slot after the delay d the
// limiter named, and says how long before it to come back (the caller
// then waits up to wait for it).
func (b *Budget) slot(d, wait time.Duration) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	if earliest := now.Add(d); b.promised.Before(earliest) {
		b.promised = earliest
	}
	b.promised = b.promised.Add(time.Duration(float64(time.Second) / float64(b.all.Limit())))
	return max(100*time.Millisecond, b.promised.Sub(now)-wait/2)
}

// precheck refuses, without asking the API server, a token that could
// never pass its review: not a JWT, not for audience, expired, or bound to
// another node than the one claimed (node "": a reader, bound to none). It trusts nothing it reads: a token
// it lets through is reviewed as before.
func precheck(token, audience, node string, now time.Time) error {
	parts := strings.Split(token, ".")
	if len(parts) != 3 || len(parts[1]) > 8192 {
		return fmt.Errorf("%w: the token is not a ServiceAccount token (a JWT)", ErrUnauthenticated)
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return fmt.Errorf("%w: the token is not a ServiceAccount token (its claims are not base64url)", ErrUnauthenticated)
	}
	var claims struct {
		Aud audiences `json:"aud"`
		Exp *float64  `json:"exp"`
		K8s struct {
			Node struct {
				Name string `json:"name"`
			} `json:"node"`
		} `json:"kubernetes.io"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		return fmt.Errorf("%w: the token is not a ServiceAccount token (its claims are not JSON)", ErrUnauthenticated)
	}
	if !slices.Contains(claims.Aud, audience) {
		return fmt.Errorf("%w: token audiences %v do not include %q", ErrUnauthenticated, []string(claims.Aud), audience)
	}
	// A minute of clock skew between this replica and the API server.
	if claims.Exp != nil && time.Unix(int64(*claims.Exp), 0).Before(now.Add(-time.Minute)) {
		return fmt.Errorf("%w: the token expired at %s (the kubelet rotates a projected token; is the collector re-reading its --token-file?)",
			ErrUnauthenticated, time.Unix(int64(*claims.Exp), 0).UTC().Format(time.RFC3339))
	}
	if n := claims.K8s.Node.Name; node != "" && n != "" && n != node {
		return fmt.Errorf("%w: token is bound to node %q, not %q", ErrUnauthenticated, n, node)
	}
	return nil
}

// audiences is a JWT's aud: one string or a list.
type audiences []string

func (a *audiences) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*a = []string{one}
		return nil
	}
	var many []string
	err := json.Unmarshal(b, &many)
	*a = many
	return err
}

// tokenExpiry is a JWT's exp (zero when it has none or is not a JWT).
func tokenExpiry(token string) time.Time {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return time.Time{}
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return time.Time{}
	}
	var claims struct {
		Exp *float64 `json:"exp"`
	}
	if json.Unmarshal(payload, &claims) != nil || claims.Exp == nil {
		return time.Time{}
	}
	return time.Unix(int64(*claims.Exp), 0)
}
