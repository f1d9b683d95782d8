// Package authtest holds the fakes the tests of the aggregator's
// authentication share: tokens shaped like projected ServiceAccount
// tokens, and an API server that reviews them.
package authtest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"
)

// NodeNameExtra is the review's extra field naming the node a token was
// issued for (auth.NodeNameExtra; a test there keeps them one).
const NodeNameExtra = "authentication.kubernetes.io/node-name"

// JWT makes a token shaped like a projected ServiceAccount token for
// audience aud, bound to node (none: ""), expiring at exp. It is not
// signed: only the API server's review decides, and these fakes review.
func JWT(aud, node string, exp time.Time) string {
	claims := map[string]any{"aud": []string{aud}, "exp": exp.Unix(), "sub": "system:serviceaccount:pa:proxyaudit-collector"}
	if node != "" {
		claims["kubernetes.io"] = map[string]any{"node": map[string]string{"name": node}}
	}
	b, _ := json.Marshal(claims)
	return "eyJhbGciOiJSUzI1NiJ9." + base64.RawURLEncoding.EncodeToString(b) + ".c2ln"
}

// Review answers tr as the API server would for a JWT token: the
// collectors' ServiceAccount, bound to the token's node; tokens without a
// node, and those of nodes named junk*, are invalid.
func Review(tr *authnv1.TokenReview) {
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

// ReviewingAPI is a fake clientset answering TokenReviews with Review,
// counting them.
func ReviewingAPI(count *atomic.Int32) *fake.Clientset {
	client := fake.NewClientset()
	client.PrependReactor("create", "tokenreviews", func(a k8stesting.Action) (bool, runtime.Object, error) {
		count.Add(1)
		tr := a.(k8stesting.CreateAction).GetObject().(*authnv1.TokenReview)
		Review(tr)
		return true, tr, nil
	})
	return client
}

// Network is where ReviewingServer serves (testkit.MemNet).
type Network interface {
	HTTPServer(t interface{ Cleanup(func()) }, h http.Handler) (string, *http.Client)
	Dial(ctx context.Context, addr string) (net.Conn, error)
}

// ReviewingServer is ReviewingAPI as an API server's HTTP endpoint on
// network, for a testing/synctest bubble: each review takes delay of the
// bubble's time, one at a time (an API server of finite capacity). The
// fake clientset holds a mutex while it answers, which a bubble does not
// see: a review taking the bubble's time there would stop the bubble;
// here the reviews queue on a channel.
func ReviewingServer(t *testing.T, network Network, delay time.Duration, count *atomic.Int32) kubernetes.Interface {
	capacity := make(chan struct{}, 1)
	url, hc := network.HTTPServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
		Review(&tr)
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
