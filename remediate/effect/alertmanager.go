package effect

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// AlertmanagerConfig is how proxyaudit reaches Alertmanager's v2 API.
type AlertmanagerConfig struct {
	// URLs of every Alertmanager replica (http://alertmanager:9093):
	// alerts go to each, as Prometheus sends them; silences are asked of
	// the first that answers (replicas share them).
	URLs []string
	// Cluster is the cluster label of every alert.
	Cluster string
	// HTTP is the client (TLS, proxies); nil: a default with a 10 s
	// timeout. Token, when set, is sent as a bearer token.
	HTTP  *http.Client
	Token string
	// Refresh: a firing alert is sent again this often, ending 4 Refresh
	// later, so that Alertmanager resolves it by itself if no proxyaudit
	// leader is left to keep it firing. Default 1m.
	Refresh time.Duration
	// MaxAge: silences read younger than this are used as they are (the
	// leader plans every second). Default 5s.
	MaxAge time.Duration
	Clock  clock.PassiveClock
	Log    *zap.Logger
	// Requests counts calls by operation (post, alerts, silences) and
	// outcome (ok, failed).
	Requests func(op, outcome string)
}

// Alertmanager keeps each incident an alert in Alertmanager — firing
// while it lasts, ended when it resolves — and tells the planner which
// nodes' alerts are silenced there, so that a silence holds repairs as it
// holds pages (kured #50). Leader only; one goroutine calls Sync and
// Silenced, Notify may come from any.
type Alertmanager struct {
	cfg  AlertmanagerConfig
	base []*url.URL

	mu      sync.Mutex
	actions map[string]string // by node: the last action's reason

	posted  map[string]sent // by labels' key: what Alertmanager holds from us
	adopted bool            // what an earlier leader left firing has been read

	silAt    time.Time
	silenced map[string]string
	hold     string
}

type sent struct {
	labels, annotations map[string]string
	startsAt, at        time.Time
}

// NewAlertmanager checks the URLs.
func NewAlertmanager(cfg AlertmanagerConfig) (*Alertmanager, error) {
	if len(cfg.URLs) == 0 {
		return nil, errors.New("alertmanager: no URL")
	}
	am := &Alertmanager{cfg: cfg, actions: map[string]string{}, posted: map[string]sent{}}
	for _, raw := range cfg.URLs {
		u, err := url.Parse(strings.TrimSuffix(raw, "/"))
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("alertmanager URL %q: want http(s)://host:port[/path], the address Alertmanager's web listens on", raw)
		}
		am.base = append(am.base, u)
	}
	if am.cfg.HTTP == nil {
		am.cfg.HTTP = &http.Client{Timeout: 10 * time.Second}
	}
	if am.cfg.Refresh <= 0 {
		am.cfg.Refresh = time.Minute
	}
	if am.cfg.MaxAge <= 0 {
		am.cfg.MaxAge = 5 * time.Second
	}
	if am.cfg.Clock == nil {
		am.cfg.Clock = clock.RealClock{}
	}
	if am.cfg.Log == nil {
		am.cfg.Log = zap.NewNop()
	}
	if am.cfg.Requests == nil {
		am.cfg.Requests = func(string, string) {}
	}
	return am, nil
}

// Notify keeps each node's last action for its alert's annotations (the
// alert carries it on its next send).
func (am *Alertmanager) Notify(n remediate.Notice) {
	if n.Node == remediate.SelfNode {
		return
	}
	am.mu.Lock()
	defer am.mu.Unlock()
	reason := n.Reason
	if n.DryRun {
		reason = "dry-run, would " + string(n.Kind) + ": " + reason
	}
	if n.Kind == remediate.Resolve || n.Kind == remediate.Uncordon {
		delete(am.actions, n.Node)
		return
	}
	am.actions[n.Node] = reason
}

// Forget drops what is kept of a node that left the cluster.
func (am *Alertmanager) Forget(node string) {
	am.mu.Lock()
	defer am.mu.Unlock()
	delete(am.actions, node)
}

// gettable is an alert as GET /api/v2/alerts returns it.
type gettable struct {
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
	StartsAt    time.Time         `json:"startsAt"`
	EndsAt      time.Time         `json:"endsAt"`
	Status      struct {
		State       string   `json:"state"`
		SilencedBy  []string `json:"silencedBy"`
		InhibitedBy []string `json:"inhibitedBy"`
	} `json:"status"`
}

// postable is an alert as POST /api/v2/alerts takes it.
type postable struct {
	Labels       map[string]string `json:"labels"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	StartsAt     time.Time         `json:"startsAt"`
	EndsAt       time.Time         `json:"endsAt"`
	GeneratorURL string            `json:"generatorURL,omitempty"`
}

// silence is one of GET /api/v2/silences.
type silence struct {
	ID        string    `json:"id"`
	CreatedBy string    `json:"createdBy"`
	Comment   string    `json:"comment"`
	EndsAt    time.Time `json:"endsAt"`
	Status    struct {
		State string `json:"state"`
	} `json:"status"`
}

func key(labels map[string]string) string {
	names := make([]string, 0, len(labels))
	for n := range labels {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "%q=%q,", n, labels[n])
	}
	return b.String()
}

// Sync makes the alerts proxyaudit keeps firing in Alertmanager exactly
// want: new and changed ones are sent, firing ones again every Refresh,
// and those no longer wanted end now (Alertmanager's receivers then send
// "resolved"). A new leader first reads what the last one left firing,
// so that an incident that ended meanwhile is ended at once rather than
// when its alert expires.
func (am *Alertmanager) Sync(ctx context.Context, want []remediate.Alert) error {
	now := am.cfg.Clock.Now()
	am.mu.Lock()
	if !am.adopted {
		am.mu.Unlock()
		left, err := am.alerts(ctx, false)
		am.mu.Lock()
		if err != nil {
			am.mu.Unlock()
			return fmt.Errorf("alertmanager: reading the alerts an earlier leader left firing: %w", err)
		}
		for _, a := range left {
			am.posted[key(a.Labels)] = sent{labels: a.Labels, annotations: a.Annotations, startsAt: a.StartsAt, at: now.Add(-am.cfg.Refresh)}
		}
		am.adopted = true
	}
	wanted := map[string]bool{}
	var out []postable
	var next []sent
	for _, a := range want {
		if a.Action == "" {
			a.Action = am.actions[a.Node]
		}
		s := sent{labels: a.Labels(am.cfg.Cluster), annotations: a.Annotations(am.cfg.Cluster), startsAt: a.Since, at: now}
		if s.startsAt.IsZero() {
			s.startsAt = now
		}
		k := key(s.labels)
		wanted[k] = true
		if old, ok := am.posted[k]; ok {
			s.startsAt = old.startsAt // an alert's start is when it began firing
			if maps.Equal(old.annotations, s.annotations) && now.Sub(old.at) < am.cfg.Refresh {
				continue
			}
		}
		out = append(out, postable{Labels: s.labels, Annotations: s.annotations, StartsAt: s.startsAt, EndsAt: now.Add(4 * am.cfg.Refresh)})
		next = append(next, s)
	}
	var ended []string
	for k, s := range am.posted {
		if !wanted[k] {
			out = append(out, postable{Labels: s.labels, Annotations: s.annotations, StartsAt: s.startsAt, EndsAt: now})
			ended = append(ended, k)
		}
	}
	am.mu.Unlock()
	if len(out) == 0 {
		return nil
	}
	if err := am.post(ctx, out); err != nil {
		return err
	}
	am.mu.Lock()
	defer am.mu.Unlock()
	for _, s := range next {
		if _, known := am.posted[key(s.labels)]; !known {
			am.silAt = time.Time{} // a new alert: ask about silences now
		}
		am.posted[key(s.labels)] = s
	}
	for _, k := range ended {
		delete(am.posted, k)
	}
	return nil
}

// post sends alerts to every replica; it fails only when none took them.
func (am *Alertmanager) post(ctx context.Context, alerts []postable) error {
	body, err := json.Marshal(alerts)
	if err != nil {
		return err
	}
	var errs []error
	for _, u := range am.base {
		if err := am.do(ctx, http.MethodPost, u, "/api/v2/alerts", nil, body, nil); err != nil {
			am.cfg.Requests("post", "failed")
			errs = append(errs, err)
			continue
		}
		am.cfg.Requests("post", "ok")
	}
	if len(errs) == len(am.base) {
		return fmt.Errorf("alertmanager: no replica took %d alert(s): %w", len(alerts), errors.Join(errs...))
	}
	for _, err := range errs {
		am.cfg.Log.Warn("an Alertmanager replica refused alerts (others took them)", zap.Error(err))
	}
	return nil
}

// alerts reads proxyaudit's alerts of this cluster from the first
// replica that answers; silenced: only those a silence mutes.
func (am *Alertmanager) alerts(ctx context.Context, silencedOnly bool) ([]gettable, error) {
	q := url.Values{}
	q.Add("filter", fmt.Sprintf("alertname=~%q", remediate.AlertName+"|"+remediate.StormAlertName))
	if am.cfg.Cluster != "" {
		q.Add("filter", fmt.Sprintf("cluster=%q", am.cfg.Cluster))
	}
	if silencedOnly {
		q.Set("active", "false") // muted ones: silenced, or inhibited (filtered below)
	}
	var got []gettable
	err := am.first(ctx, "alerts", "/api/v2/alerts", q, &got)
	return got, err
}

// first GETs path from each replica in turn until one answers.
func (am *Alertmanager) first(ctx context.Context, op, path string, q url.Values, into any) error {
	var errs []error
	for _, u := range am.base {
		err := am.do(ctx, http.MethodGet, u, path, q, nil, into)
		if err == nil {
			am.cfg.Requests(op, "ok")
			return nil
		}
		am.cfg.Requests(op, "failed")
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (am *Alertmanager) do(ctx context.Context, method string, base *url.URL, path string, q url.Values, body []byte, into any) error {
	u := *base
	u.Path += path
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, method, u.String(), bytes.NewReader(body))
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if am.cfg.Token != "" {
		req.Header.Set("Authorization", "Bearer "+am.cfg.Token)
	}
	resp, err := am.cfg.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
	if err != nil {
		return fmt.Errorf("%s %s: %w", method, u.Redacted(), err)
	}
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, u.Redacted(), resp.Status, clipText(strings.TrimSpace(string(raw)), 200))
	}
	if into != nil {
		if err := json.Unmarshal(raw, into); err != nil {
			return fmt.Errorf("%s %s: not Alertmanager's v2 API (%v)", method, u.Redacted(), err)
		}
	}
	return nil
}

// Silenced says, by node, who silenced the node's alert in Alertmanager
// and why, as Alertmanager itself decides it (its status of the alert,
// so every matcher form and every later change of its rules count). A
// silenced node is paged, not repaired, until the silence ends or is
// expired. When Alertmanager cannot be asked, hold says so and every
// repair waits: a silence someone relies on must not be missed.
func (am *Alertmanager) Silenced(ctx context.Context) (byNode map[string]string, hold string) {
	now := am.cfg.Clock.Now()
	am.mu.Lock()
	if !am.silAt.IsZero() && now.Sub(am.silAt) < am.cfg.MaxAge {
		defer am.mu.Unlock()
		return am.silenced, am.hold
	}
	am.mu.Unlock()
	byNode, hold = am.readSilenced(ctx, now)
	am.mu.Lock()
	defer am.mu.Unlock()
	am.silAt, am.silenced, am.hold = now, byNode, hold
	return byNode, hold
}

func (am *Alertmanager) readSilenced(ctx context.Context, now time.Time) (map[string]string, string) {
	cantAsk := func(err error) (map[string]string, string) {
		am.cfg.Log.Warn("cannot ask Alertmanager for silences: every repair is held", zap.Error(err))
		return nil, fmt.Sprintf("(Alertmanager cannot be asked for silences, so repairs are held: %v)", err)
	}
	muted, err := am.alerts(ctx, true)
	if err != nil {
		return cantAsk(err)
	}
	byNode := map[string]string{}
	for _, a := range muted {
		if len(a.Status.SilencedBy) > 0 && a.Labels["alertname"] == remediate.AlertName && a.Labels["node"] != "" && (a.EndsAt.IsZero() || a.EndsAt.After(now)) {
			byNode[a.Labels["node"]] = strings.Join(a.Status.SilencedBy, ",")
		}
	}
	if len(byNode) == 0 {
		return nil, ""
	}
	var all []silence
	if err := am.first(ctx, "silences", "/api/v2/silences", nil, &all); err != nil {
		return cantAsk(err)
	}
	byID := map[string]silence{}
	for _, s := range all {
		byID[s.ID] = s
	}
	for node, list := range byNode {
		var says []string
		for _, id := range strings.Split(list, ",") {
			s, ok := byID[id]
			if !ok {
				says = append(says, "silence "+id)
				continue
			}
			says = append(says, fmt.Sprintf("by %s (%q) until %s, silence %s", s.CreatedBy, clipText(s.Comment, 200), s.EndsAt.UTC().Format(time.RFC3339), s.ID))
		}
		byNode[node] = "silenced in Alertmanager " + strings.Join(says, "; ")
	}
	return byNode, ""
}
