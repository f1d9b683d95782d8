package aggregator

import (
	"errors"
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
		switch tr.Spec.Token {
		case "reader", "stranger":
			tr.Status = authnv1.TokenReviewStatus{Authenticated: true, Audiences: tr.Spec.Audiences,
				User: authnv1.UserInfo{Username: "system:serviceaccount:pa:" + tr.Spec.Token}}
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
	clk := clocktesting.NewFakeClock(time.Unix(1000, 0))
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
		{"garbage token", api.TokenHeader, "nonsense", 401, "invalid bearer token"},
		{"token for another audience", "Authorization", "Bearer other-audience", 401, "audience"},
		{"authenticated, not allowed", api.TokenHeader, "stranger", 403, "system:serviceaccount:pa:stranger may not read findings"},
		{"reader through the service proxy header", api.TokenHeader, "reader", 200, "findings"},
		{"reader with Authorization", "Authorization", "Bearer reader", 200, "findings"},
	} {
		code, body := get(tc.header, tc.value)
		if code != tc.code || !strings.Contains(body, tc.says) {
			t.Errorf("%s: %d %s, want %d saying %q", tc.name, code, body, tc.code, tc.says)
		}
	}
	if denied[DenyNoToken] != 1 || denied[DenyUnauthenticated] != 2 || denied[DenyForbidden] != 1 {
		t.Errorf("denials counted %v", denied)
	}
	n := reviews.Load()
	get(api.TokenHeader, "reader")
	if reviews.Load() != n {
		t.Error("a decision was not cached")
	}

	// The API server goes away: the reader allowed a minute ago reads on,
	// a token never seen is refused with 503 (ask again), not 401.
	down.Store(1)
	clk.Step(time.Minute)
	if code, body := get(api.TokenHeader, "reader"); code != 200 {
		t.Errorf("allowed reader during an API outage: %d %s", code, body)
	}
	if code, body := get(api.TokenHeader, "stranger-2"); code != 503 || !strings.Contains(body, "retry") {
		t.Errorf("unknown token during an outage: %d %s", code, body)
	}
	clk.Step(readerKeepFor)
	if code, _ := get(api.TokenHeader, "reader"); code != 503 {
		t.Errorf("a reader still allowed %s into an outage: %d", readerKeepFor+time.Minute, code)
	}
}
