package localcluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"time"
)

// Alertmanager is a genuine Alertmanager, built from its Go module
// (deploy/k8s-tools/alertmanager.sh), run by the harness as it runs
// kube-apiserver: one replica, no gossip, every alert routed to one
// webhook receiver with resolved notices on and short group timers.
type Alertmanager struct {
	// URL is its API base (http://host:port).
	URL  string
	proc *process
	log  string
}

// EnsureAlertmanager returns the Alertmanager binary, building it when the
// cache does not hold it yet (~1 min cold).
func EnsureAlertmanager(ctx context.Context) (string, error) {
	if p := os.Getenv("PROXYAUDIT_ALERTMANAGER"); p != "" {
		return p, nil
	}
	return ensureTool(ctx, "alertmanager.sh")
}

// EnsureOTelCollector returns an OpenTelemetry Collector with the
// k8sobjects receiver (deploy/k8s-tools/otelcol.sh), building it when the
// cache does not hold it yet (~3 min cold): a consumer of the OpenReports
// proxyaudit did not write.
func EnsureOTelCollector(ctx context.Context) (string, error) {
	return ensureTool(ctx, "otelcol.sh")
}

// StartAlertmanager runs Alertmanager on host (an address of this machine;
// Alertmanager binds a free port itself) with its state in dir, sending
// every alert group to webhook. It is ready to take alerts when this
// returns.
func StartAlertmanager(ctx context.Context, dir, host, webhook string) (*Alertmanager, error) {
	bin, err := EnsureAlertmanager(ctx)
	if err != nil {
		return nil, err
	}
	cfg := fmt.Sprintf(`route:
  receiver: webhook
  group_by: [alertname, node, severity]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 1h
receivers:
  - name: webhook
    webhook_configs:
      - url: %q
        send_resolved: true
`, webhook)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "alertmanager.yml")
	if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	log := filepath.Join(dir, "alertmanager.log")
	// Port 0, the port read back from its log: a port picked here and
	// closed before Alertmanager binds it can be taken in between by
	// another listener of the test process, whose /-/ready then answered
	// for an Alertmanager that had exited.
	p, err := startProcess("alertmanager", log, []string{bin, "--config.file=" + conf, "--storage.path=" + filepath.Join(dir, "data"),
		"--web.listen-address=" + net.JoinHostPort(host, "0"),
		"--cluster.listen-address=", "--log.level=info"})
	if err != nil {
		return nil, err
	}
	am := &Alertmanager{proc: p, log: log}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if am.URL == "" {
			if addr := listeningOn(log); addr != "" {
				am.URL = "http://" + addr
			}
		}
		if am.URL != "" {
			resp, err := http.Get(am.URL + "/-/ready")
			if err == nil {
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					return am, nil
				}
			}
		}
		if p.exited() || time.Now().After(deadline) {
			am.Stop()
			return nil, fmt.Errorf("alertmanager did not become ready on %s:\n%s", am.URL, tailFile(log, 20))
		}
	}
}

// listeningAddr is the address in exporter-toolkit's "Listening on" log
// line (logfmt: msg="Listening on" address=127.0.0.1:40123).
var listeningAddr = regexp.MustCompile(`msg="Listening on" .*address=(\S+)`)

// listeningOn returns the address Alertmanager's log says it listens on,
// or "" before it says so.
func listeningOn(log string) string {
	b, err := os.ReadFile(log)
	if err != nil {
		return ""
	}
	if m := listeningAddr.FindSubmatch(b); m != nil {
		return string(m[1])
	}
	return ""
}

// Stop ends it.
func (am *Alertmanager) Stop() { am.proc.stop(5 * time.Second) }

// Log is the end of its log.
func (am *Alertmanager) Log() string { return tailFile(am.log, 40) }

// Matcher is one matcher of a silence.
type Matcher struct {
	Name, Value      string
	IsRegex, IsEqual bool
}

// Silence creates a silence through the v2 API, as amtool or the UI do,
// and returns its ID.
func (am *Alertmanager) Silence(ctx context.Context, by, comment string, d time.Duration, ms ...Matcher) (string, error) {
	type matcher struct {
		Name    string `json:"name"`
		Value   string `json:"value"`
		IsRegex bool   `json:"isRegex"`
		IsEqual bool   `json:"isEqual"`
	}
	body := struct {
		Matchers  []matcher `json:"matchers"`
		StartsAt  time.Time `json:"startsAt"`
		EndsAt    time.Time `json:"endsAt"`
		CreatedBy string    `json:"createdBy"`
		Comment   string    `json:"comment"`
	}{StartsAt: time.Now().Add(-time.Second), EndsAt: time.Now().Add(d), CreatedBy: by, Comment: comment}
	for _, m := range ms {
		body.Matchers = append(body.Matchers, matcher(m))
	}
	var out struct {
		ID string `json:"silenceID"`
	}
	err := am.call(ctx, http.MethodPost, "/api/v2/silences", body, &out)
	return out.ID, err
}

// Expire ends a silence now.
func (am *Alertmanager) Expire(ctx context.Context, id string) error {
	return am.call(ctx, http.MethodDelete, "/api/v2/silence/"+id, nil, nil)
}

// AMAlert is an alert as Alertmanager's API shows it.
type AMAlert struct {
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
	StartsAt    time.Time         `json:"startsAt"`
	EndsAt      time.Time         `json:"endsAt"`
	Status      struct {
		State      string   `json:"state"`
		SilencedBy []string `json:"silencedBy"`
	} `json:"status"`
}

// Alerts lists the alerts it holds (firing, silenced or not).
func (am *Alertmanager) Alerts(ctx context.Context) ([]AMAlert, error) {
	var out []AMAlert
	err := am.call(ctx, http.MethodGet, "/api/v2/alerts", nil, &out)
	return out, err
}

func (am *Alertmanager) call(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, am.URL+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("alertmanager %s %s: %s: %s", method, path, strconv.Quote(resp.Status), raw)
	}
	if out != nil {
		return json.Unmarshal(raw, out)
	}
	return nil
}
