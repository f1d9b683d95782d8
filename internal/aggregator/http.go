package aggregator

import (
	"encoding/json"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/api"
)

func (a *Aggregator) recoveringUntil() *time.Time {
	if r := a.Recovering(); a.cfg.Clock.Now().Before(r) {
		return &r
	}
	return nil
}

func (a *Aggregator) staleView() *api.StaleView {
	since, why := a.Stale()
	if since.IsZero() {
		return nil
	}
	return &api.StaleView{Since: since, Reason: why}
}

// Handler serves the read-only HTTP API, /metrics, /healthz and /readyz.
// httpPort is the port the other replicas serve it on: a follower proxies
// /api/ to the leader's address on that port.
func (a *Aggregator) Handler(httpPort string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.cfg.Metrics.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.view.Synced(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	v1 := http.NewServeMux()
	v1.HandleFunc("GET /api/v1/findings", func(w http.ResponseWriter, r *http.Request) {
		v := a.Verdict()
		resp := api.FindingsResponse{At: v.At, Stale: a.staleView(), RecoveringUntil: a.recoveringUntil(), Leader: a.cfg.Self, Grace: a.cfg.Policy.Grace.String(),
			RemediationHold: a.RemediationHold(), Findings: []audit.TimedFinding{}}
		node, kind := r.URL.Query().Get("node"), r.URL.Query().Get("kind")
		var plain []audit.Finding
		for _, f := range v.Findings {
			if (node == "" || f.Node == node) && (kind == "" || string(f.Kind) == kind) {
				resp.Findings = append(resp.Findings, f)
				plain = append(plain, f.Finding)
			}
		}
		names := make([]string, 0, len(v.Nodes))
		for _, n := range v.Nodes {
			names = append(names, n.Node)
		}
		resp.Summary = audit.Summarize(names, plain)
		writeJSON(w, http.StatusOK, resp)
	})
	v1.HandleFunc("GET /api/v1/nodes", func(w http.ResponseWriter, _ *http.Request) {
		v := a.Verdict()
		writeJSON(w, http.StatusOK, api.NodesResponse{At: v.At, Stale: a.staleView(), Nodes: append([]audit.NodeStatus{}, v.Nodes...)})
	})
	v1.HandleFunc("GET /api/v1/nodes/{name}", func(w http.ResponseWriter, r *http.Request) {
		v := a.Verdict()
		name := r.PathValue("name")
		for _, n := range v.Nodes {
			if n.Node != name {
				continue
			}
			resp := api.NodeResponse{At: v.At, Stale: a.staleView(), NodeStatus: n, Findings: []audit.TimedFinding{}}
			for _, f := range v.Findings {
				if f.Node == name {
					resp.Findings = append(resp.Findings, f)
				}
			}
			writeJSON(w, http.StatusOK, resp)
			return
		}
		writeError(w, http.StatusNotFound, "no node "+name+" in the cluster or among the reporting collectors")
	})
	v1.HandleFunc("GET /api/v1/nodes/{name}/explain", func(w http.ResponseWriter, r *http.Request) {
		resp, ok, err := a.explain(r.Context(), r.PathValue("name"), r.URL.Query().Get("service"))
		if err != nil {
			writeError(w, http.StatusBadGateway, err.Error())
			return
		}
		if !ok {
			writeError(w, http.StatusNotFound, "no rules from node "+r.PathValue("name")+" yet: its collector has not sent a full snapshot to the leader")
			return
		}
		writeJSON(w, http.StatusOK, resp)
	})
	mux.Handle("/api/", a.readers(a.onLeader(v1, httpPort)))
	mux.Handle("/ui/", a.readers(a.onLeader(a.uiHandler(), httpPort)))
	mux.Handle("GET /ui", http.RedirectHandler("ui/", http.StatusFound))
	return mux
}

// readers puts h behind the reader authentication, when there is one: the
// status page answers who may read exactly as the API does.
func (a *Aggregator) readers(h http.Handler) http.Handler {
	if a.cfg.Readers != nil {
		return a.cfg.Readers.Wrap(h)
	}
	return h
}

// onLeader serves h on the leader once its first verdict is ready, and on
// a follower proxies the request to the leader's HTTP port.
func (a *Aggregator) onLeader(h http.Handler, httpPort string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leader, leading := a.Leader()
		switch {
		case leading && a.Verdict() != nil:
			h.ServeHTTP(w, r)
		case leading:
			writeError(w, http.StatusServiceUnavailable, "leading, but the first verdict is not ready yet (informers syncing); retry in a few seconds")
		case leader == "":
			writeError(w, http.StatusServiceUnavailable, "no aggregator leads yet; retry in a few seconds")
		default:
			host, _, err := net.SplitHostPort(leader)
			if err != nil {
				writeError(w, http.StatusBadGateway, "leader identity "+leader+" is not host:port")
				return
			}
			target := &url.URL{Scheme: "http", Host: net.JoinHostPort(host, httpPort)}
			p := httputil.NewSingleHostReverseProxy(target)
			p.ErrorHandler = func(w http.ResponseWriter, _ *http.Request, err error) {
				writeError(w, http.StatusBadGateway, "this replica follows; the leader at "+target.Host+" did not answer: "+err.Error())
			}
			w.Header().Set("X-Proxyaudit-Served-By", "follower, proxied to "+target.Host)
			p.ServeHTTP(w, r)
		}
	})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}

// Explain traces a node's current rules; ok is false when the node has no
// complete snapshot on this replica.
func (a *Aggregator) Explain(node, service string) (api.ExplainResponse, bool) {
	a.mu.Lock()
	n := a.fleet.nodes[node]
	if n == nil || !n.complete {
		a.mu.Unlock()
		return api.ExplainResponse{}, false
	}
	rules := *n.state // a copy: its buckets are immutable
	resp := api.ExplainResponse{Node: node, Mode: rules.Mode, States: map[string]audit.ServiceState{}, Collector: a.fleet.judge.Cost(node)}
	for _, as := range n.assessments {
		resp.States[as.Service] = as.State
	}
	var stale []audit.TimedFinding
	if v := a.fleet.verdict; v != nil {
		for _, f := range v.Findings {
			if f.Node == node && f.Kind == audit.StaleConntrack {
				stale = append(stale, f)
			}
		}
	}
	a.mu.Unlock()
	obs := rules.Observed()
	a.view.Read(func(st *audit.State, _ *audit.History, _ uint64) {
		resp.Ports = audit.Explain(audit.ExpectedFor(st, node), obs, service)
	})
	resp.Ports = audit.AttachStaleFlows(resp.Ports, stale, service)
	if resp.Ports == nil {
		resp.Ports = []audit.PortTrace{}
	}
	return resp, true
}
