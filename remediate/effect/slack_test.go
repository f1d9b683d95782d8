package effect

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/slack-go/slack"

	"go.uber.org/zap/zaptest"

	"github.com/proxyaudit/proxyaudit/remediate/remediatetest"
)

var t0 = time.Date(2026, 11, 21, 12, 0, 0, 0, time.UTC)

func notice(kind remediate.ActionKind, reason string) remediate.Notice {
	return remediate.Notice{Action: remediate.Action{Kind: kind, Node: "node-b", Reason: reason, Incident: remediate.Incident{Opened: t0}},
		Evidence: []string{"StaleEndpoint kube-system/kube-dns dns 198.18.128.12:53"}, Since: t0}
}

// One thread per incident on slack-go's own test server: opened with the
// evidence, each action a reply, closed with a resolved reply and the
// opening message updated; a 429 with Retry-After and a 500 are retried.
func TestSlackThreadPerIncident(t *testing.T) {
	srv := remediatetest.NewSlack(t, remediatetest.Flaky)
	var sent, retried atomic.Int32
	s, err := NewSlack(SlackConfig{Token: "xoxb-test", Channel: "C1", Cluster: "prod-eu", APIURL: srv.URL, Log: zaptest.NewLogger(t),
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
	s.Notify(notice(remediate.RestartProxy, "StuckProxy: kube-proxy stopped following the API; restarting kube-proxy on the node"))
	s.Notify(notice(remediate.RestartProxy, "StuckProxy: kube-proxy stopped following the API; restarting kube-proxy on the node")) // duplicate
	s.Notify(notice(remediate.Cordon, "still drifted 2m0s after restarting kube-proxy: cordoning"))
	s.Notify(notice(remediate.Uncordon, "rules back in sync; uncordons it"))
	for ctx.Err() == nil && (len(srv.Posts()) < 3 || srv.Updates.Load() < 1) {
		time.Sleep(50 * time.Millisecond)
	}
	ps := srv.Posts()
	if len(ps) != 3 {
		t.Fatalf("posts: %d", len(ps))
	}
	if ps[0].Get("thread_ts") != "" || !strings.Contains(ps[0].Get("blocks"), "198.18.128.12:53") || !strings.Contains(ps[0].Get("blocks"), "prod-eu") {
		t.Errorf("opening message: %v", ps[0])
	}
	for _, p := range ps[1:] {
		// The opening post was the server's third call (after 429, 500).
		if p.Get("thread_ts") != "1700000000.000003" {
			t.Errorf("not in the incident's thread: %v", p)
		}
	}
	if !strings.Contains(ps[2].Get("text"), "healthy again") || srv.Updates.Load() != 1 {
		t.Errorf("closing: %v, %d updates", ps[2].Get("text"), srv.Updates.Load())
	}
	if retried.Load() != 2 || srv.Refused.Load() != 2 {
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
	var dropped atomic.Int32
	s, err := NewSlack(SlackConfig{WebhookURL: hook.URL, Cluster: "c", Log: zaptest.NewLogger(t),
		Delivered: func(r string) {
			if r == "dropped" {
				dropped.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go s.Run(ctx)
	// The hook hangs from its second message on: were Notify to wait for
	// delivery, this loop would never end. It ends, and the overflow is
	// dropped (and counted) instead.
	for i := range 1000 {
		s.Notify(notice(remediate.Page, "reason "+string(rune('a'+i%26))))
	}
	if dropped.Load() == 0 {
		t.Fatal("1000 notices against a hung hook: none dropped, so the queue is unbounded")
	}
	if _, err := NewSlack(SlackConfig{Token: "xoxb"}); err == nil {
		t.Error("a bot token without a channel accepted")
	}
}

// A node that leaves the cluster mid-incident gets a last word in its
// thread, and nothing of it is kept: an autoscaler replacing nodes must
// not grow the notifier.
func TestSlackForgetsLeftNodes(t *testing.T) {
	srv := remediatetest.NewSlack(t, !remediatetest.Flaky)
	s, err := NewSlack(SlackConfig{Token: "xoxb-test", Channel: "C1", Cluster: "prod-eu", APIURL: srv.URL, Log: zaptest.NewLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go s.Run(ctx)
	s.Notify(notice(remediate.Page, "Divergent: 1 finding"))
	s.Forget("node-b")
	s.Forget("node-never-seen") // nothing open: nothing posted
	for ctx.Err() == nil && len(srv.Posts()) < 2 {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond) // the second Forget is processed
	ps := srv.Posts()
	if len(ps) != 2 {
		t.Fatalf("posts: %d, want the opening and the last word", len(ps))
	}
	if ps[1].Get("thread_ts") == "" || !strings.Contains(ps[1].Get("text"), "left the cluster") {
		t.Errorf("last word: %v", ps[1])
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.threads) != 0 || len(s.last) != 0 {
		t.Errorf("kept %d threads, %d last notices of nodes that left", len(s.threads), len(s.last))
	}
}

// A node's text reaches Slack inert, through slack-go's test server: a
// reason or evidence carrying <!channel>, a labelled link or a terminal
// escape pages no one and links nowhere; a clipped message never ends in
// half an entity.
func TestSlackTextFromNodesIsInert(t *testing.T) {
	srv := remediatetest.NewSlack(t, false)
	s, err := NewSlack(SlackConfig{Token: "xoxb-test", Channel: "C1", Cluster: "prod-eu", APIURL: srv.URL, Log: zaptest.NewLogger(t), Delivered: func(string) {}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go s.Run(ctx)
	hostile := "<!channel> read error: <https://evil.example/|kubernetes.io/docs> \x1b]0;x\x07 & more"
	n := notice(remediate.RestartProxy, "StuckProxy: "+hostile)
	n.Evidence = []string{"StaleService (KUBE-SVC-<!here>) " + hostile}
	s.Notify(n)
	for ctx.Err() == nil && len(srv.Posts()) < 1 {
		time.Sleep(50 * time.Millisecond)
	}
	ps := srv.Posts()
	if len(ps) != 1 {
		t.Fatalf("posts: %d", len(ps))
	}
	for _, field := range []string{"text", "blocks"} {
		got := strings.NewReplacer(`\u0026`, "&", `\u003c`, "<", `\u003e`, ">").Replace(ps[0].Get(field)) // blocks are JSON
		for _, bad := range []string{"<!channel>", "<!here>", "<https://", "\x1b", "\x07"} {
			if strings.Contains(got, bad) {
				t.Errorf("%s keeps %q: %s", field, bad, got)
			}
		}
		if !strings.Contains(got, "&lt;!channel&gt;") || !strings.Contains(got, "&amp; more") {
			t.Errorf("%s does not show the text escaped: %s", field, got)
		}
	}
	long := strings.Repeat("<", 2000)
	_, blocks := Render("c", notice(remediate.RestartProxy, long), false, t0)
	for _, b := range blocks {
		if sec, ok := b.(*slack.SectionBlock); ok && sec.Text != nil {
			if txt := strings.TrimSuffix(sec.Text.Text, "…"); strings.HasSuffix(txt, "&") || strings.HasSuffix(txt, "&l") || strings.HasSuffix(txt, "&lt") || len(sec.Text.Text) > 3000 {
				t.Errorf("clipped into an entity or over Slack's limit: …%q (%d bytes)", txt[max(0, len(txt)-8):], len(sec.Text.Text))
			}
		}
	}
}

// Conditions and Events are read with kubectl describe, in a terminal.
func TestNodeTextForConditionsAndEvents(t *testing.T) {
	got := nodeText("StuckProxy: \x1b]0;x\x07" + strings.Repeat("é", 800))
	if strings.ContainsAny(got, "\x1b\x07") || len(got) > 1000+len("…") || !utf8.ValidString(got) || !strings.HasSuffix(got, "…") {
		t.Errorf("nodeText: %q (%d bytes)", got[:40], len(got))
	}
}

// Slack unreachable for a while (its address refuses connections, as
// while an egress proxy or NAT restarts): the notice is retried and
// arrives once Slack answers, posted once. A connection made and then
// lost is not retried (Slack may have posted it).
func TestSlackRetriesWhatNeverLeft(t *testing.T) {
	srv := remediatetest.NewSlack(t, !remediatetest.Flaky)
	target, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	// A port nothing listens on yet; Slack appears there 1.5 s later.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	go func() {
		time.Sleep(1500 * time.Millisecond)
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Error(err)
			return
		}
		remediatetest.Relay(t, ln, target.Host)
	}()
	apiURL := *target
	apiURL.Host = addr
	var retried atomic.Int32
	s, err := NewSlack(SlackConfig{Token: "xoxb-test", Channel: "C1", APIURL: apiURL.String(), Log: zaptest.NewLogger(t),
		Delivered: func(r string) {
			if r == "retried" {
				retried.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go s.Run(ctx)
	s.Notify(notice(remediate.RestartProxy, "StuckProxy: restarting kube-proxy on the node"))
	for ctx.Err() == nil && len(srv.Posts()) < 1 {
		time.Sleep(50 * time.Millisecond)
	}
	if n := len(srv.Posts()); n != 1 || retried.Load() == 0 {
		t.Fatalf("%d posts after %d retries, want 1 after at least one", n, retried.Load())
	}
	if neverSent(io.EOF) || neverSent(&net.OpError{Op: "read", Err: io.EOF}) {
		t.Error("an error after the request left counted as never sent")
	}
}
