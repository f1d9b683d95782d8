package main

import (
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	fs := flag.NewFlagSet("ui", flag.ContinueOnError)
	a := accessFlags(fs)
	if err := fs.Parse([]string{"--aggregator", agg.URL, "--token-file", tok}); err != nil {
		t.Fatal(err)
	}
	h, err := a.uiProxy()
	if err != nil {
		t.Fatal(err)
	}
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
	if _, err := (&access{url: ptr("ftp://x"), tokenFile: ptr("")}).uiProxy(); err == nil {
		t.Error("an ftp aggregator URL was taken")
	}
}

func ptr(s string) *string { return &s }
