package remediate

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/slack-go/slack/slacktest"
	"go.uber.org/zap/zaptest"
)

func notice(kind ActionKind, reason string) Notice {
	return Notice{Action: Action{Kind: kind, Node: "node-b", Reason: reason, Incident: Incident{Opened: t0}},
		Evidence: []string{"StaleEndpoint kube-system/kube-dns dns 198.18.128.12:53"}, Since: t0}
}

type posts struct {
	mu   sync.Mutex
	seen []url.Values
}

func (p *posts) add(v url.Values) { p.mu.Lock(); p.seen = append(p.seen, v); p.mu.Unlock() }
func (p *posts) all() []url.Values {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]url.Values(nil), p.seen...)
}

// One thread per incident on slack-go's own test server: opened with the
// evidence, each action a reply, closed with a resolved reply and the
// opening message updated; a 429 with Retry-After and a 500 are retried.
func TestSlackThreadPerIncident(t *testing.T) {
	var calls atomic.Int32
	var got posts
	var updates atomic.Int32
	srv := slacktest.NewTestServer(func(c slacktest.Customize) {
		c.Handle("/chat.postMessage", func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			v, _ := url.ParseQuery(string(body))
			switch calls.Add(1) {
			case 2:
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusTooManyRequests)
				return
			case 3:
				w.WriteHeader(http.StatusInternalServerError)
				return
			}
			got.add(v)
			ts := "1700000000.000100"
			if v.Get("thread_ts") != "" {
				ts = "1700000000.0002" + string(rune('0'+calls.Load()%10))
			}
			json.NewEncoder(w).Encode(map[string]any{"ok": true, "channel": v.Get("channel"), "ts": ts})
		})
		c.Handle("/chat.update", func(w http.ResponseWriter, r *http.Request) {
			updates.Add(1)
			json.NewEncoder(w).Encode(map[string]any{"ok": true, "channel": "C1", "ts": "1700000000.000100", "text": "x"})
		})
	})
	go srv.Start()
	defer srv.Stop()
	var sent, retried atomic.Int32
	s, err := NewSlack(SlackConfig{Token: "xoxb-test", Channel: "C1", Cluster: "prod-eu", APIURL: srv.GetAPIURL(), Log: zaptest.NewLogger(t),
		Delivered: func(r string) {
			switch r {
			case "sent":
				sent.Add(1)
			case "retried":
				retried.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go s.Run(ctx)
	s.Notify(notice(RestartProxy, "StuckProxy: kube-proxy stopped following the API; restarting kube-proxy on the node"))
	s.Notify(notice(RestartProxy, "StuckProxy: kube-proxy stopped following the API; restarting kube-proxy on the node")) // duplicate
	s.Notify(notice(Cordon, "still drifted 2m0s after restarting kube-proxy: cordoning"))
	s.Notify(notice(Uncordon, "rules back in sync; uncordons it"))
	for ctx.Err() == nil && (len(got.all()) < 3 || updates.Load() < 1) {
		time.Sleep(50 * time.Millisecond)
	}
	ps := got.all()
	if len(ps) != 3 {
		t.Fatalf("posts: %d", len(ps))
	}
	if ps[0].Get("thread_ts") != "" || !strings.Contains(ps[0].Get("blocks"), "198.18.128.12:53") || !strings.Contains(ps[0].Get("blocks"), "prod-eu") {
		t.Errorf("opening message: %v", ps[0])
	}
	for _, p := range ps[1:] {
		if p.Get("thread_ts") != "1700000000.000100" {
			t.Errorf("not in the incident's thread: %v", p)
		}
	}
	if !strings.Contains(ps[2].Get("text"), "healthy again") || updates.Load() != 1 {
		t.Errorf("closing: %v, %d updates", ps[2].Get("text"), updates.Load())
	}
	if retried.Load() != 2 {
		t.Errorf("retried %d times, want 2 (429, 500)", retried.Load())
	}
}

// Webhook mode: one message per notice, no threads; a queue that cannot
// drain never blocks Notify.
func TestSlackWebhookAndNeverBlocks(t *testing.T) {
	var n atomic.Int32
	block := make(chan struct{})
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) > 1 {
			<-block
		}
		w.Write([]byte("ok"))
	}))
	defer hook.Close()
	defer close(block)
	s, err := NewSlack(SlackConfig{WebhookURL: hook.URL, Cluster: "c", Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	start := time.Now()
	for i := range 1000 {
		s.Notify(notice(Page, "reason "+string(rune('a'+i%26))))
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Notify blocked for %s", d)
	}
	if _, err := NewSlack(SlackConfig{Token: "xoxb"}); err == nil {
		t.Error("a bot token without a channel accepted")
	}
}
