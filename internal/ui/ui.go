// Package ui renders the aggregator's read-only status page: the fleet,
// one node, the incidents. Server-rendered with html/template (every
// string a node or the cluster supplies is escaped by context) from
// assets embedded in the binary: no build step, no CDN, works air-gapped.
// The aggregator fills the pages' data; this package only renders.
package ui

import (
	"bytes"
	"embed"
	"fmt"
	"html/template"
	"io"
	"math"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

//go:embed templates/*.html static/*
var files embed.FS

var pages = template.Must(template.New("").Funcs(template.FuncMap{
	"ago":     ago,
	"stamp":   func(t time.Time) string { return t.UTC().Format("2006-01-02 15:04:05Z") },
	"seconds": seconds,
	"count":   count,
	"lagClass": func(p99, grace float64) string {
		switch {
		case p99 <= 0:
			return "l0"
		case p99 < 1:
			return "l1"
		case p99 < grace/3:
			return "l2"
		case p99 < grace:
			return "l3"
		}
		return "l4"
	},
	"lower": strings.ToLower,
	"dec":   func(n int) int { return n - 1 },
	"hasBad": func(p audit.PortTrace) bool {
		for _, f := range p.Frontends {
			if f.Status != audit.TraceOK {
				return true
			}
			for _, e := range f.Endpoints {
				if e.Status != audit.TraceOK {
					return true
				}
			}
		}
		return false
	},
}).ParseFS(files, "templates/*.html"))

// Base is what every page shows: where the data comes from and how fresh
// it is.
type Base struct {
	Title string
	// Root is the relative path back to /ui/ ("./" or "../"), so that the
	// pages work under any prefix (the API server's service proxy, a
	// port-forward, `proxyaudit ui`).
	Root string
	// At is when the leader's verdict was made; Now when the page was.
	At, Now time.Time
	// Stale says why the leader's view of the API is stale ("" when it is
	// not); Hold why every repair is held.
	Stale, Hold string
	Leader      string
	Mode        string
	Grace       float64 // seconds
}

// Age is how old the verdict is.
func (b Base) Age() string { return ago(b.At, b.Now) }

// Count is one bar of a breakdown.
type Count struct {
	Name string
	N    int
}

// Cell is one node of the heatmap.
type Cell struct {
	Node       string
	State      string
	P99        float64
	Findings   int
	StaleFlows int
}

// Zone groups the heatmap's cells by topology zone.
type Zone struct {
	Name  string
	Cells []Cell
}

// FleetPage is the fleet at a glance.
type FleetPage struct {
	Base
	Total    int
	States   []Count
	Kinds    []Count
	Zones    []Zone
	WorstP99 float64
	// Worst are the nodes that need a look first (not in sync), at most 50.
	Worst []Cell
}

// NodePage is one node: what `proxyaudit explain node` shows, kube-proxy's
// own account, the collector's cost and the node's incident.
type NodePage struct {
	Base
	Status    audit.NodeStatus
	Findings  []audit.TimedFinding
	Ports     []audit.PortTrace
	Explained bool
	Incident  *Incident
}

// Incident is a node's remediation ladder and what was done.
type Incident struct {
	// DryRun: remediation is in dry-run; the ladder is what would have
	// been done.
	DryRun   bool
	Node     string
	Stage    string
	Opened   time.Time
	Restarts []time.Time
	Cordoned time.Time
	Flushes  []time.Time
	Actions  []Entry
}

// Entry is one action, page or outcome, as its Event says it.
type Entry struct {
	At     time.Time
	Node   string
	Kind   string
	Reason string
	DryRun bool
	Held   string
}

// IncidentsPage is every open incident and the recent actions.
type IncidentsPage struct {
	Base
	Incidents []Incident
	Recent    []Entry
}

// ClustersPage is several clusters side by side (`proxyaudit ui` with
// several kubeconfig contexts): each cluster's nodes by state and the
// nodes to look at, linking into that cluster's own pages.
type ClustersPage struct {
	Base
	Clusters []ClusterRow
	// Unreadable counts the clusters that could not be read.
	Unreadable int
}

// ClusterRow is one cluster of the ClustersPage.
type ClusterRow struct {
	Name string // its kubeconfig context
	// Link is the relative path to its fleet page ("SLUG/ui/"); its nodes'
	// pages are under it.
	Link string
	// Error says why it could not be read ("" when it was); Stale why its
	// leader's view is stale; Hold why its repairs are held.
	Error, Stale, Hold string
	At                 time.Time
	Total, Findings    int
	States             []Count
	// Look are the nodes not in sync (at most 20), the worst first.
	Look []Cell
}

// Render writes the named page ("fleet", "node", "incidents", "clusters").
func Render(w io.Writer, page string, data any) error {
	return pages.ExecuteTemplate(w, page+".html", data)
}

// Serve renders a page as an HTTP response, with a content security policy
// that allows only the page's own assets.
func Serve(w http.ResponseWriter, page string, data any) {
	var b bytes.Buffer
	if err := Render(&b, page, data); err != nil {
		http.Error(w, "rendering the page: "+err.Error(), http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Cache-Control", "no-store")
	w.Write(b.Bytes())
}

// Static serves the embedded stylesheet and script under /ui/static/.
func Static() http.Handler { return StaticAt("/ui/") }

// StaticAt serves them under prefix + "static/".
func StaticAt(prefix string) http.Handler {
	return http.StripPrefix(prefix, http.FileServerFS(files))
}

// Cluster builds a ClusterRow from a cluster's node states and findings.
func Cluster(name, link string, at time.Time, nodes []audit.NodeStatus, findings []audit.TimedFinding) ClusterRow {
	r := ClusterRow{Name: name, Link: link, At: at, Total: len(nodes), Findings: len(findings)}
	byNode := map[string]int{}
	for _, f := range findings {
		byNode[f.Node]++
	}
	states := map[string]int{}
	for _, n := range nodes {
		states[string(n.State)]++
		if n.State != audit.NodeInSync {
			r.Look = append(r.Look, Cell{Node: n.Node, State: string(n.State), P99: n.Lag.P99, Findings: byNode[n.Node], StaleFlows: n.StaleFlows})
		}
	}
	sort.SliceStable(r.Look, func(i, j int) bool {
		a, b := r.Look[i], r.Look[j]
		if a.Findings != b.Findings {
			return a.Findings > b.Findings
		}
		return a.Node < b.Node
	})
	if len(r.Look) > 20 {
		r.Look = r.Look[:20]
	}
	r.States = counts(states)
	return r
}

// Fleet builds the fleet page's breakdowns from the judge's node states
// and findings; zone names each node's topology zone ("" for none).
func Fleet(base Base, nodes []audit.NodeStatus, findings []audit.TimedFinding, zone func(node string) string) FleetPage {
	p := FleetPage{Base: base, Total: len(nodes)}
	byNode := map[string]int{}
	kinds := map[string]int{}
	for _, f := range findings {
		byNode[f.Node]++
		kinds[string(f.Kind)]++
	}
	states := map[string]int{}
	zones := map[string][]Cell{}
	for _, n := range nodes {
		c := Cell{Node: n.Node, State: string(n.State), P99: n.Lag.P99, Findings: byNode[n.Node], StaleFlows: n.StaleFlows}
		states[c.State]++
		z := zone(n.Node)
		zones[z] = append(zones[z], c)
		p.WorstP99 = math.Max(p.WorstP99, c.P99)
		if n.State != audit.NodeInSync && len(p.Worst) < 50 {
			p.Worst = append(p.Worst, c)
		}
	}
	p.States, p.Kinds = counts(states), counts(kinds)
	for name, cells := range zones {
		sort.Slice(cells, func(i, j int) bool { return cells[i].Node < cells[j].Node })
		p.Zones = append(p.Zones, Zone{Name: name, Cells: cells})
	}
	sort.Slice(p.Zones, func(i, j int) bool { return p.Zones[i].Name < p.Zones[j].Name })
	return p
}

func counts(m map[string]int) []Count {
	out := make([]Count, 0, len(m))
	for k, n := range m {
		out = append(out, Count{k, n})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].N != out[j].N {
			return out[i].N > out[j].N
		}
		return out[i].Name < out[j].Name
	})
	return out
}

func ago(t, now time.Time) string {
	if t.IsZero() {
		return "never"
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "just now"
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds ago", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm ago", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd ago", int(d.Hours()/24))
}

// seconds shows a duration given in seconds with the precision it has: a
// read of a few hundred rules takes under a millisecond, which "%.2fs"
// showed as 0.00s, as if nothing had been read.
// count is "1 sample", "2 samples": a number and its noun, singular for one.
func count(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func seconds(s float64) string {
	switch {
	case s == 0:
		return "0s"
	case s < 0.001:
		return fmt.Sprintf("%.0fµs", s*1e6)
	case s < 1:
		return fmt.Sprintf("%.3gms", s*1e3)
	default:
		return fmt.Sprintf("%.2fs", s)
	}
}
