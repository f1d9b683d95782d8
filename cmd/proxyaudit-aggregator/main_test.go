package main

import (
	"bytes"
	"context"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/aggregator"
)

func TestFlagsAndHelp(t *testing.T) {
	var out bytes.Buffer
	if code := run([]string{"--help"}, &out); code != 0 || !strings.Contains(out.String(), "[POD_IP]") || !strings.Contains(out.String(), "/api/v1/findings") {
		t.Errorf("--help: exit %d\n%s", code, out.String())
	}
	t.Setenv("POD_IP", "")
	t.Setenv("KUBECONFIG", "")
	for name, tc := range map[string]struct {
		args []string
		says string
	}{
		"short grace":               {[]string{"--grace", "10ms"}, "too short"},
		"bad share":                 {[]string{"--mass-divergence-share", "1.5"}, "share"},
		"half TLS":                  {[]string{"--tls-cert-file", "c.pem"}, "go together"},
		"TLS Secret without names":  {[]string{"--tls-secret", "agg-tls"}, "--tls-server-names"},
		"TLS Secret and files":      {[]string{"--tls-secret", "agg-tls", "--tls-server-names", "a", "--tls-cert-file", "c.pem", "--tls-key-file", "k.pem"}, "not --tls-cert-file"},
		"bad collector DaemonSet":   {[]string{"--leader-elect=false", "--collector-daemonset", "collector"}, "want namespace/name"},
		"bad peers Service":         {[]string{"--leader-elect=false", "--peers-service", "proxyaudit-aggregator-headless"}, "--peers-service"},
		"bad listen":                {[]string{"--stream-listen", "9443"}, "--stream-listen"},
		"no advertise":              {[]string{}, "--advertise-address is required"},
		"no cluster":                {[]string{"--advertise-address", "10.0.0.1"}, "outside a cluster, pass --kubeconfig"},
		"missing kubeconfig":        {[]string{"--advertise-address", "10.0.0.1", "--kubeconfig", "/nonexistent"}, "API client"},
		"negative memory limit":     {[]string{"--memory-limit-bytes", "-5"}, "want a byte count"},
		"TCP services alone":        {[]string{"--remediation-conntrack-tcp-services", "shop/api"}, "takes --remediation-conntrack"},
		"bad TCP service":           {[]string{"--remediation-conntrack", "--remediation-conntrack-tcp-services", "shop/api,<x>"}, `"<x>" is not namespace/name`},
		"empty Cilium selector":     {[]string{"--cilium-selector", ""}, "matches every pod"},
		"empty kube-proxy selector": {[]string{"--kube-proxy-selector", " "}, "matches every pod"},
	} {
		var errb bytes.Buffer
		if code := run(tc.args, &errb); code != 2 || !strings.Contains(errb.String(), tc.says) {
			t.Errorf("%s: exit %d: %q", name, code, errb.String())
		}
	}
	// The chart passes the container's limit in bytes; a hand-set "1Gi"
	// is refused with what to write instead.
	t.Setenv("PROXYAUDIT_MEMORY_LIMIT", "1Gi")
	var errb bytes.Buffer
	if code := run([]string{"--advertise-address", "10.0.0.1"}, &errb); code != 2 || !strings.Contains(errb.String(), `PROXYAUDIT_MEMORY_LIMIT "1Gi"`) {
		t.Errorf("PROXYAUDIT_MEMORY_LIMIT=1Gi: exit %d: %q", code, errb.String())
	}
}

// A client that sends its request slowly, or opens a connection and goes
// quiet, is cut off: before, only the headers had a deadline.
func TestAPIServerCutsSlowAndIdleClients(t *testing.T) {
	saved := httpTimeouts
	defer func() { httpTimeouts = saved }()
	httpTimeouts.header, httpTimeouts.read, httpTimeouts.write, httpTimeouts.idle = 300*time.Millisecond, 300*time.Millisecond, 300*time.Millisecond, 300*time.Millisecond
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := apiServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Write([]byte("ok"))
	}))
	go srv.Serve(ln)
	defer srv.Close()
	closedWithin := func(c net.Conn, d time.Duration) bool {
		c.SetReadDeadline(time.Now().Add(d))
		_, err := io.Copy(io.Discard, c)
		return err == nil // EOF: the server closed it
	}
	// A body promised and never finished.
	slow, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	io.WriteString(slow, "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\nonly a little")
	if !closedWithin(slow, 5*time.Second) {
		t.Error("a request body that never ends keeps its connection")
	}
	// A keep-alive connection after its request, then silence.
	idle, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	io.WriteString(idle, "GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
	if !closedWithin(idle, 5*time.Second) {
		t.Error("an idle keep-alive connection is kept")
	}
}

// The Alertmanager flags: a private CA and a bearer token from files reach
// an https Alertmanager; a CA file without a certificate, or one that is
// not there, stops the start with what is wrong.
func TestAlertmanagerFlags(t *testing.T) {
	var auth atomic.Value
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth.Store(r.Header.Get("Authorization"))
		w.Write([]byte("[]"))
	}))
	defer srv.Close()
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(dir, "token")
	if err := os.WriteFile(token, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o := &options{amURLs: srv.URL, amCAFile: ca, amTokenFile: token, clusterName: "e2e"}
	am, err := o.alertmanager(aggregator.NewMetrics(), zap.NewNop(), clock.RealClock{})
	if err != nil {
		t.Fatal(err)
	}
	if by, hold := am.Silenced(context.Background()); len(by) != 0 || hold != "" {
		t.Fatalf("asking Alertmanager over TLS with the CA: %v %q", by, hold)
	}
	if got, _ := auth.Load().(string); got != "Bearer s3cret" {
		t.Errorf("Authorization %q", got)
	}
	// Without the CA the system's roots do not know the test server.
	o.amCAFile = ""
	am, err = o.alertmanager(aggregator.NewMetrics(), zap.NewNop(), clock.RealClock{})
	if err != nil {
		t.Fatal(err)
	}
	if _, hold := am.Silenced(context.Background()); !strings.Contains(hold, "certificate") {
		t.Errorf("an unknown CA: %q", hold)
	}
	if err := os.WriteFile(ca, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	for name, o := range map[string]*options{
		"no PEM":     {amURLs: srv.URL, amCAFile: ca},
		"no CA file": {amURLs: srv.URL, amCAFile: filepath.Join(dir, "missing")},
		"no token":   {amURLs: srv.URL, amTokenFile: filepath.Join(dir, "missing")},
		"bad URL":    {amURLs: "alertmanager:9093"},
	} {
		if _, err := o.alertmanager(aggregator.NewMetrics(), zap.NewNop(), clock.RealClock{}); err == nil || !strings.Contains(err.Error(), "--alertmanager") {
			t.Errorf("%s: %v", name, err)
		}
	}
}
