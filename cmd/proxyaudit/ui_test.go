package main

import (
	"github.com/spf13/pflag"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/internal/api"
)

// proxyaudit ui forwards the status page's GETs to the aggregator with the
// reader's token, and nothing else: no other path, no other method, no
// cookie of the browser's.
func TestUIProxy(t *testing.T) {
	var seen http.Header
	agg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = r.Header.Clone()
		w.Header().Set("Content-Security-Policy", "default-src 'self'")
		io.WriteString(w, "page "+r.URL.Path)
	}))
	defer agg.Close()
	tok := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tok, []byte("reader-token\n"), 0o600)
	h := uiProxy(t, "--aggregator", agg.URL, "--token-file", tok)
	srv := httptest.NewServer(h)
	defer srv.Close()
	req, _ := http.NewRequest("GET", srv.URL+"/ui/nodes/n1", nil)
	req.Header.Set("Cookie", "session=secret")
	r, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if string(b) != "page /ui/nodes/n1" || r.Header.Get("Content-Security-Policy") == "" {
		t.Errorf("GET /ui/nodes/n1: %q %v", b, r.Header)
	}
	if seen.Get("Authorization") != "Bearer reader-token" || seen.Get("Cookie") != "" {
		t.Errorf("the aggregator was sent %v", seen)
	}
	for method, path := range map[string]string{"POST": "/ui/", "GET": "/api/v1/findings"} {
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader("x"))
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		r.Body.Close()
		if r.StatusCode < 400 {
			t.Errorf("%s %s: %d, want refused", method, path, r.StatusCode)
		}
	}
	if _, err := (&access{url: ptr("ftp://x"), tokenFile: ptr("")}).uiProxy(io.Discard); err == nil {
		t.Error("an ftp aggregator URL was taken")
	}
}

func ptr(s string) *string { return &s }

// uiProxy is proxyaudit ui's handler for these flags.
func uiProxy(t *testing.T, args ...string) http.Handler {
	t.Helper()
	fs := pflag.NewFlagSet("ui", pflag.ContinueOnError)
	a := accessFlags(fs, true)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	h, err := a.uiProxy(io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// Through the API server: the page's path under the aggregator Service's
// proxy, with a reader token minted for it (here a stand-in API server
// that records both).
func TestUIProxyThroughTheAPIServer(t *testing.T) {
	var paths []string
	var tokenHeader string
	apiserver := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.Method+" "+r.URL.Path)
		if strings.HasSuffix(r.URL.Path, "/token") {
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"kind":"TokenRequest","apiVersion":"authentication.k8s.io/v1","status":{"token":"minted","expirationTimestamp":"2030-01-01T00:00:00Z"}}`)
			return
		}
		tokenHeader = r.Header.Get(api.TokenHeader)
		io.WriteString(w, "page")
	}))
	defer apiserver.Close()
	kc := filepath.Join(t.TempDir(), "kubeconfig")
	os.WriteFile(kc, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "`+apiserver.URL+`"}}]
users: [{name: u, user: {token: admin}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600)
	h := uiProxy(t, "--kubeconfig", kc, "-n", "pa")
	srv := httptest.NewServer(h)
	defer srv.Close()
	r, err := http.Get(srv.URL + "/ui/nodes/n1")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r.Body)
	r.Body.Close()
	want := []string{"POST /api/v1/namespaces/pa/serviceaccounts/proxyaudit-reader/token", "GET /api/v1/namespaces/pa/services/http:proxyaudit-aggregator:http/proxy/ui/nodes/n1"}
	if string(b) != "page" || strings.Join(paths, "; ") != strings.Join(want, "; ") || tokenHeader != "minted" {
		t.Errorf("got %q; the API server saw %v with reader token %q; want %v", b, paths, tokenHeader, want)
	}
}

// DNS rebinding: a web page the SRE opens points a name of its own at
// 127.0.0.1 and reads the page as same-origin. The browser still names
// that host, and proxyaudit ui refuses it before the reader token is
// attached; this machine's addresses, localhost and --accept-host names
// are served, a foreign Origin is not.
func TestUIRefusesOtherHosts(t *testing.T) {
	asked := 0
	agg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		asked++
		io.WriteString(w, "page")
	}))
	defer agg.Close()
	tok := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tok, []byte("reader-token\n"), 0o600)
	srv := httptest.NewServer(hostGuard([]string{"workstation.corp"}, uiProxy(t, "--aggregator", agg.URL, "--token-file", tok)))
	defer srv.Close()
	_, port, _ := strings.Cut(strings.TrimPrefix(srv.URL, "http://"), ":")
	for _, c := range []struct {
		host, origin string
		served       bool
	}{
		{"127.0.0.1:" + port, "", true},
		{"localhost:" + port, "", true},
		{"[::1]:" + port, "", true},
		{"198.18.0.7:" + port, "", true}, // an address of this machine: cannot be rebound
		{"workstation.corp:" + port, "", true},
		{"127.0.0.1:" + port, "http://127.0.0.1:" + port, true},
		{"attacker.example:" + port, "", false},
		{"attacker.example:" + port, "http://attacker.example:" + port, false},
		{"127.0.0.1.attacker.example:" + port, "", false},
		{"127.0.0.1:" + port, "http://attacker.example", false},
		{"127.0.0.1:" + port, "null", false},
	} {
		before := asked
		req, _ := http.NewRequest("GET", srv.URL+"/ui/", nil)
		req.Host = c.host
		if c.origin != "" {
			req.Header.Set("Origin", c.origin)
		}
		r, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if served := r.StatusCode == http.StatusOK; served != c.served || (asked > before) != c.served {
			t.Errorf("Host %q Origin %q: %d %q (aggregator asked: %v), want served %v", c.host, c.origin, r.StatusCode, b, asked > before, c.served)
		}
		if !c.served && !strings.Contains(string(b), "refused") {
			t.Errorf("Host %q: the refusal does not say why: %q", c.host, b)
		}
	}
	for _, bad := range []string{"", "a:1", "http://a", "a b"} {
		var errb strings.Builder
		if code := run([]string{"ui", "--aggregator", "http://127.0.0.1:1", "--listen", "127.0.0.1:0", "--accept-host", bad}, io.Discard, &errb); code != exitUsage ||
			!strings.Contains(errb.String(), "--accept-host") {
			t.Errorf("--accept-host %q taken: exit %d, %q", bad, code, errb.String())
		}
	}
}
