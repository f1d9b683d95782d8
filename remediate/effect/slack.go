package effect

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/remediate"

	"github.com/slack-go/slack"
	"go.uber.org/zap"
)

// SlackConfig is how proxyaudit reaches Slack: a bot token (one thread per
// incident, the opening message updated when it resolves) or an incoming
// webhook (one message per notice, no threads).
type SlackConfig struct {
	// Token is a bot token (xoxb-…) with chat:write; Channel is where
	// incidents open.
	Token, Channel string
	// WebhookURL is used when Token is empty.
	WebhookURL string
	// Cluster names the cluster in every message.
	Cluster string
	// APIURL overrides Slack's API endpoint (tests).
	APIURL string
	Log    *zap.Logger
	// Delivered counts messages by result: sent, retried, dropped, failed.
	Delivered func(result string)
}

// Slack sends notices to Slack from its own goroutine: Notify never
// blocks, a Slack outage never holds up detection or repair. Rate limits
// (429 with Retry-After) and server errors are retried; a full queue drops
// the newest notice with a log line.
type Slack struct {
	cfg    SlackConfig
	client *slack.Client
	queue  chan queued

	mu      sync.Mutex
	threads map[string]thread // by node: the open incident's thread
	last    map[string]string // by node: the last notice sent (de-duplication)
}

// queued is a notice to deliver, or (forget) a node that left the
// cluster: through the same queue, so it follows the node's last notice.
type queued struct {
	notice remediate.Notice
	forget bool
}

type thread struct {
	channel, ts string
	opened      time.Time
}

// NewSlack returns a notifier; Run delivers.
func NewSlack(cfg SlackConfig) (*Slack, error) {
	if cfg.Token == "" && cfg.WebhookURL == "" {
		return nil, errors.New("slack: set a bot token (with a channel) or a webhook URL")
	}
	if cfg.Token != "" && cfg.Channel == "" {
		return nil, errors.New("slack: a bot token needs a channel (--slack-channel)")
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Delivered == nil {
		cfg.Delivered = func(string) {}
	}
	s := &Slack{cfg: cfg, queue: make(chan queued, 256), threads: map[string]thread{}, last: map[string]string{}}
	if cfg.Token != "" {
		var opts []slack.Option
		if cfg.APIURL != "" {
			opts = append(opts, slack.OptionAPIURL(cfg.APIURL))
		}
		s.client = slack.New(cfg.Token, opts...)
	}
	return s, nil
}

// Notify queues a notice (never blocks).
func (s *Slack) Notify(n remediate.Notice) {
	select {
	case s.queue <- queued{notice: n}:
	default:
		s.cfg.Log.Warn("slack queue full: notice dropped", zap.String("node", n.Node), zap.String("action", string(n.Kind)))
		s.cfg.Delivered("dropped")
	}
}

// Forget closes the node's open thread, if any, saying it left the
// cluster, and drops what is kept of it.
func (s *Slack) Forget(node string) {
	select {
	case s.queue <- queued{notice: remediate.Notice{Action: remediate.Action{Node: node}}, forget: true}:
	default:
		// The queue is full: drop the memory now, without a last word.
		s.mu.Lock()
		delete(s.threads, node)
		delete(s.last, node)
		s.mu.Unlock()
	}
}

// forget posts the last word in a left node's thread and drops it.
func (s *Slack) forget(ctx context.Context, node string) error {
	s.mu.Lock()
	th, open := s.threads[node]
	delete(s.threads, node)
	delete(s.last, node)
	s.mu.Unlock()
	if !open || s.client == nil {
		return nil
	}
	text := fmt.Sprintf("%s left the cluster (its Node was deleted): incident closed, nothing more will be done for it.", safetext.Slack(node))
	return s.retry(ctx, func(ctx context.Context) error {
		_, _, err := s.client.PostMessageContext(ctx, th.channel, slack.MsgOptionText(text, false), slack.MsgOptionTS(th.ts))
		return err
	})
}

// Run delivers queued notices until ctx ends.
func (s *Slack) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case q := <-s.queue:
			n := q.notice
			deliver := s.deliver
			if q.forget {
				deliver = func(ctx context.Context, n remediate.Notice) error { return s.forget(ctx, n.Node) }
			}
			if err := deliver(ctx, n); err != nil && ctx.Err() == nil {
				s.cfg.Log.Warn("slack delivery failed", zap.String("node", n.Node), zap.String("action", string(n.Kind)), zap.Error(err))
				s.cfg.Delivered("failed")
			}
		}
	}
}

func (s *Slack) deliver(ctx context.Context, n remediate.Notice) error {
	key := string(n.Kind) + "|" + n.Reason
	s.mu.Lock()
	dup := s.last[n.Node] == key
	s.last[n.Node] = key
	th, open := s.threads[n.Node]
	s.mu.Unlock()
	if dup {
		return nil
	}
	closing := n.Kind == remediate.Resolve || n.Kind == remediate.Uncordon || n.Kind == remediate.ViewFresh || n.Kind == remediate.StormOver
	text, blocks := Render(s.cfg.Cluster, n, open, th.opened)
	if s.client == nil {
		return s.retry(ctx, func(ctx context.Context) error {
			return slack.PostWebhookContext(ctx, s.cfg.WebhookURL, &slack.WebhookMessage{Text: text, Blocks: &slack.Blocks{BlockSet: blocks}})
		})
	}
	if !open {
		var ch, ts string
		err := s.retry(ctx, func(ctx context.Context) error {
			var err error
			ch, ts, err = s.client.PostMessageContext(ctx, s.cfg.Channel, slack.MsgOptionText(text, false), slack.MsgOptionBlocks(blocks...))
			return err
		})
		if err != nil {
			return err
		}
		if !closing {
			s.mu.Lock()
			s.threads[n.Node] = thread{channel: ch, ts: ts, opened: n.Incident.Opened}
			s.mu.Unlock()
		}
		return nil
	}
	err := s.retry(ctx, func(ctx context.Context) error {
		_, _, err := s.client.PostMessageContext(ctx, th.channel, slack.MsgOptionText(text, false), slack.MsgOptionBlocks(blocks...), slack.MsgOptionTS(th.ts))
		return err
	})
	if err != nil || !closing {
		return err
	}
	s.mu.Lock()
	delete(s.threads, n.Node)
	s.mu.Unlock()
	// Mark the opening message resolved, so the channel reads at a glance.
	return s.retry(ctx, func(ctx context.Context) error {
		what := "kube-proxy drift on " + safetext.Slack(n.Node)
		switch n.Kind {
		case remediate.ViewFresh:
			what = "proxyaudit could not see the API"
		case remediate.StormOver:
			what = "most nodes drifted at once"
		}
		_, _, _, err := s.client.UpdateMessageContext(ctx, th.channel, th.ts,
			slack.MsgOptionText(fmt.Sprintf(":white_check_mark: Resolved: %s (%s)", what, safetext.Slack(s.cfg.Cluster)), false))
		return err
	})
}

// retry calls f until it succeeds, honouring Retry-After on 429 and
// backing off on 5xx, for at most five attempts.
func (s *Slack) retry(ctx context.Context, f func(context.Context) error) error {
	backoff := time.Second
	var err error
	for attempt := 0; attempt < 5; attempt++ {
		if err = f(ctx); err == nil {
			s.cfg.Delivered("sent")
			return nil
		}
		wait := time.Duration(0)
		var rl *slack.RateLimitedError
		var sc slack.StatusCodeError
		switch {
		case errors.As(err, &rl):
			wait = min(max(rl.RetryAfter, time.Second), time.Minute)
		case errors.As(err, &sc) && sc.Code >= 500, neverSent(err):
			wait, backoff = backoff, min(2*backoff, 30*time.Second)
		default:
			return err
		}
		s.cfg.Delivered("retried")
		s.cfg.Log.Info("slack asked to retry", zap.Error(err), zap.Duration("after", wait))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
	}
	return err
}

// neverSent reports whether err is a connection that could not be made
// (refused, unreachable, no route, a DNS failure): the request never left,
// so sending it again cannot post twice. An error after the request went
// out (a reset, EOF) is not retried: Slack may have posted it.
func neverSent(err error) bool {
	var op *net.OpError
	var dns *net.DNSError
	return (errors.As(err, &op) && op.Op == "dial") || errors.As(err, &dns)
}

// Render is a notice as Slack shows it: plain text (notifications,
// webhooks without blocks) and Block Kit.
func Render(plainCluster string, n remediate.Notice, inThread bool, opened time.Time) (string, []slack.Block) {
	// The reason and evidence carry text from nodes and rules (chain
	// names, read errors): escaped, so that no node can page the channel
	// (<!channel>) or dress up a link. Node and cluster names are tame,
	// and escaped all the same.
	node, cluster := safetext.Slack(n.Node), safetext.Slack(plainCluster)
	reason := safetext.Slack(n.Reason)
	dry := ""
	if n.DryRun {
		dry = " (dry-run: nothing was changed)"
	}
	var title string
	switch n.Kind {
	case remediate.RestartProxy:
		title = fmt.Sprintf(":arrows_counterclockwise: Restarting kube-proxy on %s%s", node, dry)
	case remediate.Cordon:
		title = fmt.Sprintf(":no_entry: Cordoning %s%s", node, dry)
	case remediate.Uncordon:
		title = fmt.Sprintf(":white_check_mark: %s healthy again, uncordoned%s", node, dry)
	case remediate.FlushConntrack:
		title = fmt.Sprintf(":broom: Deleting stale conntrack entries on %s%s", node, dry)
	case remediate.Resolve:
		title = fmt.Sprintf(":white_check_mark: %s: kube-proxy rules back in sync", node)
		if strings.HasPrefix(n.Reason, "StaleConntrack") {
			title = fmt.Sprintf(":white_check_mark: %s: the stale conntrack flows are gone", node)
		}
	case remediate.ViewStale:
		title = ":see_no_evil: proxyaudit cannot see the API: findings are unknown, nothing is repaired"
	case remediate.ViewFresh:
		title = ":white_check_mark: proxyaudit sees the API again"
	case remediate.Storm:
		title = ":rotating_light: most nodes drifted at once: suspect the API or proxyaudit's view; nothing is repaired"
	case remediate.StormOver:
		title = ":white_check_mark: the mass divergence is over"
	default:
		title = fmt.Sprintf(":rotating_light: kube-proxy drift on %s", node)
	}
	text := fmt.Sprintf("[%s] %s: %s", cluster, title, reason)
	var blocks []slack.Block
	if !inThread {
		header := fmt.Sprintf("kube-proxy drift on %s (%s)", n.Node, plainCluster)
		switch n.Kind {
		case remediate.ViewStale, remediate.ViewFresh:
			header = fmt.Sprintf("proxyaudit's view of the API is stale (%s)", plainCluster)
		case remediate.Storm, remediate.StormOver:
			header = fmt.Sprintf("kube-proxy drift on most nodes at once (%s)", plainCluster)
		}
		blocks = append(blocks, slack.NewHeaderBlock(slack.NewTextBlockObject(slack.PlainTextType, clipText(header, 150), true, false)))
	}
	blocks = append(blocks, slack.NewSectionBlock(slack.NewTextBlockObject(slack.MarkdownType, clipText("*"+title+"*\n"+reason, 2900), false, false), nil, nil))
	if len(n.Evidence) > 0 && !inThread {
		ev := n.Evidence
		more := ""
		if len(ev) > 10 {
			more = fmt.Sprintf("\n…and %d more", len(ev)-10)
			ev = ev[:10]
		}
		ev = slices.Clone(ev)
		for i := range ev {
			ev[i] = safetext.Slack(ev[i])
		}
		blocks = append(blocks, slack.NewSectionBlock(slack.NewTextBlockObject(slack.MarkdownType,
			clipText("*Evidence* (stale first):\n```"+strings.Join(ev, "\n")+"```"+more, 2900), false, false), nil, nil))
	}
	var ctxt []string
	if !n.Since.IsZero() {
		what := "drifting"
		switch n.Kind {
		case remediate.ViewStale:
			what = "stale"
		case remediate.Storm:
			what = "most nodes drifting"
		}
		ctxt = append(ctxt, what+" since "+n.Since.UTC().Format(time.RFC3339))
	}
	if (n.Kind == remediate.Resolve || n.Kind == remediate.Uncordon) && !opened.IsZero() {
		ctxt = append(ctxt, "incident opened "+opened.UTC().Format(time.RFC3339))
	}
	ctxt = append(ctxt, "cluster "+cluster)
	blocks = append(blocks, slack.NewContextBlock("", slack.NewTextBlockObject(slack.MarkdownType, strings.Join(ctxt, " · "), false, false)))
	return text, blocks
}

// clipText cuts at n bytes on a rune boundary and never inside an entity
// (&lt;), which Slack would show half-written.
func clipText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	s = safetext.Clip(s, n-len("…"))
	s = strings.TrimSuffix(s, "…")
	if amp := strings.LastIndexByte(s, '&'); amp >= 0 && !strings.Contains(s[amp:], ";") {
		s = s[:amp]
	}
	return s + "…"
}
