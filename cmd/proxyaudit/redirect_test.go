package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"
)

// Whatever answers behind the aggregator's Service may answer with a
// redirect to a host of its choosing, and the API server's service proxy
// passes it through. Followed by client-go's transport, the user's own
// kubeconfig token and the reader token would go there (seen on the code
// before: the admin's Authorization header and the reader token at an
// outside listener). No verb follows it, through the real client-go
// transport to a real listener: report, report across contexts, explain,
// the direct --aggregator URL, and ui's proxy; each says why it stopped.
func TestNoVerbFollowsTheAggregatorsRedirect(t *testing.T) {
	var mu sync.Mutex
	var leaked []string
	outside := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		leaked = append(leaked, fmt.Sprintf("%s %s Authorization=%q reader=%q", r.Method, r.URL.Path, r.Header.Get("Authorization"), r.Header.Get(api.TokenHeader)))
		mu.Unlock()
		io.WriteString(w, `{}`)
	}))
	defer outside.Close()
	const proxy = "/api/v1/namespaces/proxyaudit/services/http:proxyaudit-aggregator:http/proxy"
	apiServer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/serviceaccounts/proxyaudit-reader/token"):
			w.Header().Set("Content-Type", "application/json")
			json.NewEncoder(w).Encode(map[string]any{"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
				"status": map[string]any{"token": "reader-token", "expirationTimestamp": time.Now().Add(time.Hour).Format(time.RFC3339)}})
		case strings.HasPrefix(r.URL.Path, proxy+"/"):
			// The service proxy passing the backend's answer through.
			http.Redirect(w, r, outside.URL+strings.TrimPrefix(r.URL.Path, proxy), http.StatusFound)
		default:
			http.NotFound(w, r)
		}
	}))
	defer apiServer.Close()
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	os.WriteFile(kubeconfig, []byte("apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: "+apiServer.URL+"}}]\n"+
		"users: [{name: u, user: {token: admins-token}}]\ncontexts: [{name: a, context: {cluster: c, user: u}}, {name: b, context: {cluster: c, user: u}}]\ncurrent-context: a\n"), 0o600)
	direct := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, outside.URL+r.URL.Path, http.StatusTemporaryRedirect)
	}))
	defer direct.Close()
	tokenFile := filepath.Join(dir, "token")
	os.WriteFile(tokenFile, []byte("direct-token"), 0o600)

	for _, args := range [][]string{
		{"report", "--kubeconfig", kubeconfig},
		{"report", "--kubeconfig", kubeconfig, "--all-contexts"},
		{"explain", "node", "n1", "--kubeconfig", kubeconfig},
		{"report", "--aggregator", direct.URL, "--token-file", tokenFile},
	} {
		var out, errb bytes.Buffer
		code := run(args, &out, &errb)
		said := errb.String() + out.String() // across contexts each cluster's failure is in the report
		if code == exitClean || code == exitFindings || !strings.Contains(said, "redirect") {
			t.Errorf("%v: exit %d, %q: want a refusal naming the redirect", args, code, said)
		}
		t.Logf("%v: %s", args[1:], strings.TrimSpace(said))
	}

	for _, args := range [][]string{{"--kubeconfig", kubeconfig}, {"--aggregator", direct.URL, "--token-file", tokenFile}} {
		srv := httptest.NewServer(uiProxy(t, args...))
		client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		r, err := client.Get(srv.URL + "/ui/")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		srv.Close()
		if r.StatusCode != http.StatusBadGateway || r.Header.Get("Location") != "" || !strings.Contains(string(b), "redirect") {
			t.Errorf("ui %v: %s, Location %q, %q: want 502 naming the redirect, and no Location for the browser", args, r.Status, r.Header.Get("Location"), b)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(leaked) > 0 {
		t.Errorf("the outside listener was reached:\n%s", strings.Join(leaked, "\n"))
	}
}
