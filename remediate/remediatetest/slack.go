// Package remediatetest holds test helpers for code that pages through
// effect.Slack: slack-go's own test server, recording what it was sent.
package remediatetest

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/slack-go/slack/slacktest"
)

// Slack is slack-go's slacktest server with chat.postMessage and
// chat.update recorded. Its first post answers 429 (Retry-After: 1) and
// its second 500 when built with Flaky, so retries are exercised.
type Slack struct {
	// URL is the API base to give the client (slack.OptionAPIURL).
	URL string
	// Refused counts the posts answered 429 or 500; Updates the updates.
	Refused, Updates atomic.Int32

	mu    sync.Mutex
	posts []url.Values
}

// Flaky makes the first two posts fail (429, then 500).
const Flaky = true

// NewSlack starts the server; it stops with the test.
func NewSlack(t testing.TB, flaky bool) *Slack {
	s := &Slack{}
	var calls atomic.Int32
	srv := slacktest.NewTestServer(func(c slacktest.Customize) {
		c.Handle("/chat.postMessage", func(w http.ResponseWriter, r *http.Request) {
			n := calls.Add(1)
			if flaky && n <= 2 {
				s.Refused.Add(1)
				if n == 1 {
					w.Header().Set("Retry-After", "1")
					w.WriteHeader(http.StatusTooManyRequests)
				} else {
					w.WriteHeader(http.StatusInternalServerError)
				}
				return
			}
			body, _ := io.ReadAll(r.Body)
			v, _ := url.ParseQuery(string(body))
			s.mu.Lock()
			s.posts = append(s.posts, v)
			s.mu.Unlock()
			json.NewEncoder(w).Encode(map[string]any{"ok": true, "channel": v.Get("channel"), "ts": fmt.Sprintf("1700000000.%06d", n)})
		})
		c.Handle("/chat.update", func(w http.ResponseWriter, r *http.Request) {
			s.Updates.Add(1)
			json.NewEncoder(w).Encode(map[string]any{"ok": true, "channel": "C1", "ts": "1700000000.000001", "text": ""})
		})
	})
	go srv.Start()
	t.Cleanup(srv.Stop)
	s.URL = srv.GetAPIURL()
	return s
}

// Posts returns the accepted posts (form values: channel, text, blocks,
// thread_ts), oldest first.
func (s *Slack) Posts() []url.Values {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]url.Values(nil), s.posts...)
}

// Relay forwards every TCP connection accepted on ln to target (host:port)
// until ln is closed, which happens when t ends: it puts Slack's test
// server where the code under test can reach it (an address pods reach,
// or a port that starts refusing and answers later).
func Relay(t testing.TB, ln net.Listener, target string) {
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			in, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer in.Close()
				out, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer out.Close()
				go io.Copy(out, in)
				io.Copy(in, out)
			}()
		}
	}()
}
