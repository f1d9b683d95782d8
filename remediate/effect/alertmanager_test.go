package effect_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
	"github.com/proxyaudit/proxyaudit/remediate/remediatetest"
)

func realAlertmanager(t *testing.T) (*localcluster.Alertmanager, *remediatetest.Webhook) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a genuine Alertmanager (built from its Go module)")
	}
	hook := remediatetest.NewWebhook(t, "127.0.0.1")
	am, err := localcluster.StartAlertmanager(context.Background(), t.TempDir(), "127.0.0.1", hook.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("alertmanager log:\n%s", am.Log())
		}
		am.Stop()
	})
	return am, hook
}

// An incident is an alert in a genuine Alertmanager: it fires, its
// receiver hears it; a silence (any matcher form: Alertmanager decides)
// makes the node silenced, saying by whom and why; expired, it is not;
// the incident over, the alert ends and the receiver hears "resolved". A
// new leader ends at once what the last one left firing.
func TestAlertmanagerIncidentsAndSilences(t *testing.T) {
	am, hook := realAlertmanager(t)
	ctx := context.Background()
	// Alertmanager keeps its own time: proxyaudit's clock is the real one,
	// and the copy of the silences it keeps lives 3 s.
	const maxAge = 3 * time.Second
	past := func() { time.Sleep(maxAge + 100*time.Millisecond) }
	cfg := effect.AlertmanagerConfig{URLs: []string{am.URL}, Cluster: "e2e", MaxAge: maxAge, Log: zaptest.NewLogger(t)}
	a, err := effect.NewAlertmanager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stuck := remediate.Alert{Node: "n1", Kind: "Stuck", Severity: remediate.SeverityWarning, Summary: "StuckProxy: behind since 12:00",
		Evidence: []string{"StaleEndpoint default/dns 53/UDP 198.18.0.9"}, Since: time.Now().Add(-time.Minute)}
	a.Notify(remediate.Notice{Action: remediate.Action{Kind: remediate.RestartProxy, Node: "n1", Reason: "restarting kube-proxy on the node"}})
	if err := a.Sync(ctx, []remediate.Alert{stuck}); err != nil {
		t.Fatal(err)
	}
	labels := map[string]string{"alertname": remediate.AlertName, "node": "n1", "cluster": "e2e", "kind": "Stuck", "severity": "warning"}
	testkit.Eventually(t, 20*time.Second, "the receiver told the incident fires", func() bool { return hook.Seen("firing", labels) })
	got, err := am.Alerts(ctx)
	if err != nil || len(got) != 1 || got[0].Annotations["proxyaudit_action"] != "restarting kube-proxy on the node" ||
		!strings.Contains(got[0].Annotations["description"], "StaleEndpoint default/dns") || !strings.Contains(got[0].Annotations["summary"], "n1 (e2e)") {
		t.Fatalf("alerts in Alertmanager: %+v (%v)", got, err)
	}
	if by, hold := a.Silenced(ctx); len(by) != 0 || hold != "" {
		t.Fatalf("silenced before any silence: %v %q", by, hold)
	}
	// A silence on the node, as an SRE makes it.
	id, err := am.Silence(ctx, "alice", "draining n1 for a kernel upgrade", time.Hour, localcluster.Matcher{Name: "node", Value: "n1", IsEqual: true})
	if err != nil {
		t.Fatal(err)
	}
	past()
	by, hold := a.Silenced(ctx)
	if hold != "" || !strings.Contains(by["n1"], "silenced in Alertmanager by alice") || !strings.Contains(by["n1"], "draining n1 for a kernel upgrade") || !strings.Contains(by["n1"], id) {
		t.Fatalf("silenced: %v %q", by, hold)
	}
	if err := am.Expire(ctx, id); err != nil {
		t.Fatal(err)
	}
	past()
	if by, _ := a.Silenced(ctx); by["n1"] != "" {
		t.Fatalf("still silenced after the silence expired: %v", by)
	}
	// A regex matcher on the cluster and alertname: every proxyaudit
	// incident in it. Alertmanager decides what matches, not proxyaudit.
	id, err = am.Silence(ctx, "bob", "fleet maintenance", time.Hour, localcluster.Matcher{Name: "cluster", Value: "e2.*", IsRegex: true, IsEqual: true},
		localcluster.Matcher{Name: "alertname", Value: remediate.AlertName, IsEqual: true})
	if err != nil {
		t.Fatal(err)
	}
	other := remediate.Alert{Node: "n2", Kind: "NoRules", Severity: remediate.SeverityWarning, Summary: "NoRules"}
	if err := a.Sync(ctx, []remediate.Alert{stuck, other}); err != nil {
		t.Fatal(err)
	}
	// A new alert is asked about at once, not after MaxAge.
	if by, _ := a.Silenced(ctx); !strings.Contains(by["n1"], "by bob") || !strings.Contains(by["n2"], "fleet maintenance") {
		t.Fatalf("a regex silence on the cluster: %v", by)
	}
	// A silence that matches another cluster holds nothing here.
	if err := am.Expire(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, err := am.Silence(ctx, "carol", "not this cluster", time.Hour, localcluster.Matcher{Name: "cluster", Value: "prod", IsEqual: true}); err != nil {
		t.Fatal(err)
	}
	past()
	if by, _ := a.Silenced(ctx); len(by) != 0 {
		t.Fatalf("silenced by another cluster's silence: %v", by)
	}
	// Escalated: the warning ends, a critical alert fires.
	stuck.Severity = remediate.SeverityCritical
	if err := a.Sync(ctx, []remediate.Alert{stuck, other}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the warning resolved and the critical firing", func() bool {
		return hook.Seen("resolved", labels) && hook.Seen("firing", map[string]string{"node": "n1", "severity": "critical"})
	})
	// n1 is back in sync: its alert ends now.
	if err := a.Sync(ctx, []remediate.Alert{other}); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "the receiver told n1's incident resolved", func() bool {
		return hook.Seen("resolved", map[string]string{"node": "n1", "severity": "critical"})
	})
	// The leader dies; a new one finds n2 over too: it ends the alert the
	// last one left firing, at once.
	b, err := effect.NewAlertmanager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Sync(ctx, nil); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 20*time.Second, "n2's alert, left by the dead leader, resolved by the new one", func() bool {
		return hook.Seen("resolved", map[string]string{"node": "n2"})
	})
	if got, _ := am.Alerts(ctx); len(got) != 0 {
		t.Errorf("alerts still firing: %+v", got)
	}
}

// An Alertmanager that cannot be asked — down, or not Alertmanager —
// holds every repair, saying why; it never reads as "no silence".
func TestAlertmanagerUnreachableHoldsRepairs(t *testing.T) {
	notAM := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("<html>login</html>"))
	}))
	defer notAM.Close()
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	for name, url := range map[string]string{"down": down.URL, "not Alertmanager": notAM.URL} {
		a, err := effect.NewAlertmanager(effect.AlertmanagerConfig{URLs: []string{url}, Log: zaptest.NewLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		by, hold := a.Silenced(context.Background())
		if by != nil || !strings.Contains(hold, "Alertmanager cannot be asked for silences, so repairs are held") {
			t.Errorf("%s: %v %q", name, by, hold)
		}
		if name == "not Alertmanager" && !strings.Contains(hold, "not Alertmanager's v2 API") {
			t.Errorf("%s: %q does not say what answered", name, hold)
		}
		if err := a.Sync(context.Background(), []remediate.Alert{{Node: "n1", Kind: "Stuck", Severity: "warning"}}); err == nil {
			t.Errorf("%s: alerts sent", name)
		}
	}
	for _, bad := range []string{"alertmanager:9093", "ftp://x", "http://"} {
		if _, err := effect.NewAlertmanager(effect.AlertmanagerConfig{URLs: []string{bad}}); err == nil || !strings.Contains(err.Error(), "http(s)://host:port") {
			t.Errorf("URL %q: %v", bad, err)
		}
	}
}
