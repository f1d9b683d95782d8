package aggregator

import (
	"net/http"
	"sort"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/ui"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// uiHandler serves the status page (leader only: onLeader proxies).
func (a *Aggregator) uiHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /ui/static/", ui.Static())
	mux.HandleFunc("GET /ui/{$}", func(w http.ResponseWriter, _ *http.Request) {
		v := a.Verdict()
		zone := func(name string) string {
			if n := a.view.Node(name); n != nil {
				return n.Labels["topology.kubernetes.io/zone"]
			}
			return ""
		}
		ui.Serve(w, "fleet", ui.Fleet(a.uiBase("Fleet", "./", v), v.Nodes, v.Findings, zone))
	})
	mux.HandleFunc("GET /ui/nodes/{name}", func(w http.ResponseWriter, r *http.Request) {
		v := a.Verdict()
		name := r.PathValue("name")
		p := ui.NodePage{Base: a.uiBase(name, "../", v)}
		found := false
		for _, n := range v.Nodes {
			if n.Node == name {
				p.Status, found = n, true
			}
		}
		if !found {
			http.Error(w, "no node "+name+" in the cluster or among the reporting collectors", http.StatusNotFound)
			return
		}
		for _, f := range v.Findings {
			if f.Node == name {
				p.Findings = append(p.Findings, f)
			}
		}
		if ex, ok, _ := a.explain(r.Context(), name, ""); ok {
			p.Ports, p.Explained = ex.Ports, true
		}
		p.Incident = a.uiIncident(name)
		ui.Serve(w, "node", p)
	})
	mux.HandleFunc("GET /ui/incidents", func(w http.ResponseWriter, _ *http.Request) {
		v := a.Verdict()
		p := ui.IncidentsPage{Base: a.uiBase("Incidents", "./", v), Recent: a.journal.recent("", 100)}
		for _, n := range v.Nodes {
			if inc := a.uiIncident(n.Node); inc != nil && inc.Stage != "" {
				p.Incidents = append(p.Incidents, *inc)
			}
		}
		sort.Slice(p.Incidents, func(i, j int) bool { return p.Incidents[i].Opened.Before(p.Incidents[j].Opened) })
		ui.Serve(w, "incidents", p)
	})
	return mux
}

func (a *Aggregator) uiBase(title, root string, v *audit.Verdict) ui.Base {
	b := ui.Base{Title: title, Root: root, At: v.At, Now: a.cfg.Clock.Now(), Hold: a.RemediationHold(), Leader: a.cfg.Self, Grace: a.cfg.Policy.Grace.Seconds()}
	if s := a.staleView(); s != nil {
		b.Stale = s.Reason
	}
	if r := a.cfg.Remediation; r != nil {
		b.Mode = string(r.Policy.Mode)
	}
	return b
}

// uiIncident is the node's incident as recorded, with the actions this
// leader took on it; nil without remediation or anything to show.
func (a *Aggregator) uiIncident(node string) *ui.Incident {
	r := a.cfg.Remediation
	if r == nil {
		return nil
	}
	inc := r.Executor.Peek(node)
	actions := a.journal.recent(node, journalPerNode)
	if inc.Empty() && len(actions) == 0 {
		return nil
	}
	return &ui.Incident{DryRun: r.Policy.Mode == remediate.DryRun, Node: node, Stage: string(inc.Stage), Opened: inc.Opened, Restarts: inc.Restarts, Cordoned: inc.Cordoned, Flushes: inc.Flushes, Actions: actions}
}
