package auth

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"
)

// The HTTP API's reader check, against a fake API server that knows three
// tokens: a reader's, a token for another audience, and one of a user the
// RBAC does not allow. The real API server's answers are in
// TestE2ELiveSystem.
func TestReaderAuth(t *testing.T) {
	client := fake.NewClientset()
	var reviews, down atomic.Int32
	client.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		reviews.Add(1)
		if down.Load() == 1 {
			return true, nil, errors.New("connection refused")
		}
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		switch nameOf(tr.Spec.Token) {
		case "reader", "stranger":
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences,
				User: authnv1.UserInfo{Username: "system:serviceaccount:pa:" + nameOf(tr.Spec.Token)}}
		case "other-audience":
			tr.Status = authnv1.TokenReviewStatus{Error: "token audiences [\"api\"] is invalid for the target audiences"}
		default:
			tr.Status = authnv1.TokenReviewStatus{Error: "invalid bearer token"}
		}
		return true, tr, nil
	})
	client.PrependReactor("create", "subjectaccessreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		sar := a.(k8stesting.CreateAction).GetObject().(*authzv1.SubjectAccessReview)
		ra := sar.Spec.ResourceAttributes
		sar.Status.Allowed = sar.Spec.User == "system:serviceaccount:pa:reader" &&
			ra.Namespace == "pa" && ra.Resource == "services" && ra.Subresource == "proxy" && ra.Name == "agg" && ra.Verb == "get"
		return true, sar, nil
	})
	clk := clocktesting.NewFakeClock(time.Now())
	reader := named("reader", api.DefaultReaderAudience)
	denied := map[DenyReason]int{}
	ra := &ReaderAuth{Client: client, Audience: api.DefaultReaderAudience, Namespace: "pa", Service: "agg", Clock: clk,
		Denied: func(r DenyReason) { denied[r]++ }}
	h := ra.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("findings")) }))
	get := func(header, value string) (int, string) {
		r := httptest.NewRequest("GET", "/api/v1/findings", nil)
		if header != "" {
			r.Header.Set(header, value)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code, w.Body.String()
	}
	for _, tc := range []struct {
		name, header, value string
		code                int
		says                string
	}{
		{"no token", "", "", 401, "findings are for readers only"},
		{"garbage token", api.TokenHeader, "nonsense", 401, "not a ServiceAccount token"},
		{"a JWT the API server does not know", api.TokenHeader, named("forged", api.DefaultReaderAudience), 401, "invalid bearer token"},
		{"token for another audience", "Authorization", "Bearer " + named("other-audience", "api"), 401, "audience"},
		{"authenticated, not allowed", api.TokenHeader, named("stranger", api.DefaultReaderAudience), 403, "system:serviceaccount:pa:stranger may not read findings"},
		{"reader through the service proxy header", api.TokenHeader, reader, 200, "findings"},
		{"reader with Authorization", "Authorization", "Bearer " + reader, 200, "findings"},
	} {
		code, body := get(tc.header, tc.value)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s: %d %s, want %d saying %q", tc.name, code, body, tc.code, tc.says)
		}
	}
	if denied[DenyNoToken] != 1 || denied[DenyUnauthenticated] != 3 || denied[DenyForbidden] != 1 {
		t.Errorf("denials counted %v", denied)
	}
	n := reviews.Load()
	get(api.TokenHeader, reader)
	if reviews.Load() != n {
		t.Error("a decision was not cached")
	}

	// The API server goes away: the reader allowed a minute ago reads on,
	// a token never seen is refused with 503 (ask again), not 401.
	down.Store(1)
	clk.Step(time.Minute)
	if code, body := get(api.TokenHeader, reader); code != 200 {
		t.Errorf("allowed reader during an API outage: %d %s", code, body)
	}
	if code, body := get(api.TokenHeader, named("stranger-2", api.DefaultReaderAudience)); code != 503 || !strings.Contains(body, "retry") {
		t.Errorf("unknown token during an outage: %d %s", code, body)
	}
	clk.Step(readerKeepFor)
	if code, _ := get(api.TokenHeader, reader); code != 503 {
		t.Errorf("a reader still allowed %s into an outage: %d", readerKeepFor+time.Minute, code)
	}
}

// named is a JWT-shaped reader token for audience whose signature part
// names who it is (the fake API server's reviews key on it).
func named(name, audience string) string {
	b, _ := json.Marshal(map[string]any{"aud": []string{audience}, "exp": time.Now().Add(time.Hour).Unix()})
	return "eyJhbGciOiJSUzI1NiJ9." + base64.RawURLEncoding.EncodeToString(b) + "." + base64.RawURLEncoding.EncodeToString([]byte(name))
}

func nameOf(token string) string {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return ""
	}
	b, _ := base64.RawURLEncoding.DecodeString(parts[2])
	return string(b)
}

// One pod with no credentials floods the reader check from one address:
// strings that cannot be tokens cost neither the API server nor the
// budget, and tokens that look like them spend only that address's
// share; the readers, who come through the API server's service proxy
// (another address), are served. Before, the flood spent the whole
// budget and every reader got 429 (0 of 50 in the review that found it).
func TestReaderFloodFromOneAddress(t *testing.T) {
	client := fake.NewClientset()
	var reviews atomic.Int32
	client.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		reviews.Add(1)
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		if strings.HasPrefix(nameOf(tr.Spec.Token), "reader-") {
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences,
				User: authnv1.UserInfo{Username: "system:serviceaccount:pa:reader"}}
		} else {
			tr.Status = authnv1.TokenReviewStatus{Error: "invalid bearer token"}
		}
		return true, tr, nil
	})
	client.PrependReactor("create", "subjectaccessreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		sar := a.(k8stesting.CreateAction).GetObject().(*authzv1.SubjectAccessReview)
		sar.Status.Allowed = sar.Spec.User == "system:serviceaccount:pa:reader"
		return true, sar, nil
	})
	// The aggregator's reader budget as main.go sets it (10 a second).
	ra := &ReaderAuth{Client: client, Audience: api.DefaultReaderAudience, Namespace: "pa", Service: "agg",
		Clock: clocktesting.NewFakeClock(time.Now()), Budget: NewBudget(10, 20, 5, 10)}
	h := ra.Wrap(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("findings")) }))
	get := func(from, token string) int {
		r := httptest.NewRequest("GET", "/api/v1/findings", nil)
		r.RemoteAddr = from + ":40000"
		r.Header.Set(api.TokenHeader, token)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code
	}
	const pod, apiserver = "198.18.7.7", "198.18.0.1"
	for i := range 5000 {
		if code := get(pod, fmt.Sprintf("junk-%d", i)); code != http.StatusUnauthorized {
			t.Fatalf("junk token %d: %d", i, code)
		}
	}
	if n := reviews.Load(); n != 0 {
		t.Errorf("strings that are not tokens cost %d reviews", n)
	}
	busy := 0
	for i := range 1000 {
		if get(pod, named(fmt.Sprintf("forged-%d", i), api.DefaultReaderAudience)) == http.StatusTooManyRequests {
			busy++
		}
	}
	served := 0
	for i := range 10 {
		if get(apiserver, named(fmt.Sprintf("reader-%d", i), api.DefaultReaderAudience)) == http.StatusOK {
			served++
		}
	}
	t.Logf("flood: 5000 junk strings (0 reviews), 1000 forged JWTs (%d refused as busy, %d reviewed); readers served: %d of 10", busy, reviews.Load()-int32(served), served)
	if served != 10 {
		t.Errorf("%d of 10 readers served under one address's flood", served)
	}
	if busy < 980 {
		t.Errorf("the flooding address was refused %d times of 1000: its share is not bounded", busy)
	}
}
