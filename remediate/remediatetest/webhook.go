package remediatetest

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
)

// Webhook is an Alertmanager webhook receiver recording each
// notification it is sent.
type Webhook struct {
	// URL is what Alertmanager's webhook_configs url gets.
	URL string

	mu   sync.Mutex
	seen []WebhookAlert
}

// WebhookAlert is one alert of one notification: its status then
// (firing or resolved) and labels.
type WebhookAlert struct {
	Status string            `json:"status"`
	Labels map[string]string `json:"labels"`
}

// NewWebhook listens on host (port picked free); it stops with the test.
func NewWebhook(t testing.TB, host string) *Webhook {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	w := &Webhook{}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		var msg struct {
			Alerts []WebhookAlert `json:"alerts"`
		}
		if err := json.NewDecoder(r.Body).Decode(&msg); err != nil {
			http.Error(rw, err.Error(), http.StatusBadRequest)
			return
		}
		w.mu.Lock()
		w.seen = append(w.seen, msg.Alerts...)
		w.mu.Unlock()
	}))
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	w.URL = srv.URL
	return w
}

// Seen says whether an alert with these labels was notified with status.
func (w *Webhook) Seen(status string, labels map[string]string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, a := range w.seen {
		if a.Status != status {
			continue
		}
		ok := true
		for k, v := range labels {
			if a.Labels[k] != v {
				ok = false
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// All is every alert notified so far.
func (w *Webhook) All() []WebhookAlert {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]WebhookAlert(nil), w.seen...)
}
