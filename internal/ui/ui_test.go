package ui

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

var now = time.Date(2026, 11, 27, 3, 0, 0, 0, time.UTC)

func base() Base {
	return Base{Title: "t", Root: "./", At: now.Add(-2 * time.Second), Now: now, Leader: "10.0.0.1:9443", Mode: "dry-run", Grace: 30}
}

// fleet is n nodes in four zones, one in twenty lagging, one stuck.
func fleet(n int) ([]audit.NodeStatus, []audit.TimedFinding, func(string) string) {
	nodes := make([]audit.NodeStatus, n)
	zones := map[string]string{}
	var fs []audit.TimedFinding
	for i := range nodes {
		name := fmt.Sprintf("ip-10-0-%d-%d.eu-west-1.compute.internal", i/250, i%250)
		nodes[i] = audit.NodeStatus{Node: name, State: audit.NodeInSync, Mode: audit.ModeIPTables, Services: 10000, InSync: 10000,
			Lag: audit.LagStats{Samples: 50, P50: 0.2, P99: float64(i%40) / 10}}
		zones[name] = fmt.Sprintf("eu-west-1%c", 'a'+i%4)
	}
	nodes[7].State, nodes[7].Lagging = audit.NodeLagging, 3
	nodes[42].State = audit.NodeStuck
	fs = append(fs, audit.TimedFinding{Finding: audit.Finding{Node: nodes[42].Node, Kind: audit.StuckProxy, Detail: "kube-proxy stopped following the API"}})
	return nodes, fs, func(n string) string { return zones[n] }
}

// A 5,000-node fleet on one page: every node a cell of the heatmap, under
// 2 MB (the time it takes is BenchmarkFleetPage's).
func TestFleetPageOf5000Nodes(t *testing.T) {
	nodes, fs, zone := fleet(5000)
	var b bytes.Buffer
	if err := Render(&b, "fleet", Fleet(base(), nodes, fs, zone)); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	if n := strings.Count(page, `data-node=`); n != 5000 {
		t.Errorf("%d heatmap cells, want 5000", n)
	}
	if b.Len() > 2<<20 {
		t.Errorf("the page is %d bytes, over 2 MB", b.Len())
	}
	for _, want := range []string{"<b>4998</b> InSync", "<b>1</b> Stuck", "<b>1</b> StuckProxy", "eu-west-1a <small>1250</small>",
		`data-node="` + nodes[42].Node + `" data-state="Stuck"`, `href="./nodes/` + nodes[42].Node + `"`} {
		if !strings.Contains(page, want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	t.Logf("5,000 nodes: %d bytes", b.Len())
}

func BenchmarkFleetPage(b *testing.B) {
	for _, n := range []int{500, 5000} {
		nodes, fs, zone := fleet(n)
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			var size int
			for b.Loop() {
				var buf bytes.Buffer
				if err := Render(&buf, "fleet", Fleet(base(), nodes, fs, zone)); err != nil {
					b.Fatal(err)
				}
				size = buf.Len()
			}
			b.ReportMetric(float64(size), "page-bytes")
		})
	}
}

// Every string a node or the cluster supplies renders as text: a service,
// endpoint, detail or node name holding markup cannot run script or
// inject a link.
func TestHostileNamesRenderAsText(t *testing.T) {
	evil := `<script>alert(1)</script>`
	st := audit.NodeStatus{Node: "n1", State: audit.NodeDivergent, ReadError: evil, Warnings: []string{evil},
		KubeProxy: &audit.KubeProxySignal{Version: evil, Error: evil}, Collector: &audit.CollectorCost{Reads: map[string]uint64{evil: 1}}}
	ports := []audit.PortTrace{{Service: "ns/" + evil, Port: evil, Protocol: "TCP", Frontends: []audit.FrontendTrace{{Frontend: evil, Status: audit.TraceOK,
		Endpoints: []audit.EndpointTrace{{Endpoint: evil, Status: audit.TraceStale, Chain: evil}}}},
		StaleFlows: []audit.FlowTrace{{Endpoint: evil, Flows: 1, Detail: evil}}}}
	fs := []audit.TimedFinding{{Finding: audit.Finding{Node: "n1", Service: evil, Port: evil, Endpoint: evil, Detail: evil, Kind: audit.StaleEndpoint}}}
	inc := &Incident{Node: "n1", Stage: "open", Opened: now, Actions: []Entry{{At: now, Node: evil, Kind: "Page", Reason: evil}}}
	for name, data := range map[string]any{
		"node":      NodePage{Base: Base{Title: evil, Root: "../", Stale: evil, Hold: evil, Leader: evil, Now: now}, Status: st, Findings: fs, Ports: ports, Explained: true, Incident: inc},
		"fleet":     Fleet(Base{Title: evil, Root: "./"}, []audit.NodeStatus{{Node: `a"><script>x</script>`, State: `"><img src=x onerror=alert(1)>`}}, fs, func(string) string { return evil }),
		"incidents": IncidentsPage{Base: Base{Root: "./"}, Incidents: []Incident{*inc}, Recent: inc.Actions},
	} {
		var b bytes.Buffer
		if err := Render(&b, name, data); err != nil {
			t.Fatal(err)
		}
		page := b.String()
		if strings.Contains(page, "<script>alert") || strings.Contains(page, "<script>x") || strings.Contains(page, "<img") {
			t.Errorf("%s page runs what a node sent:\n%s", name, page)
		}
		if !strings.Contains(page, "&lt;script&gt;") {
			t.Errorf("%s page does not show the text", name)
		}
	}
}

// The node page shows what explain shows: the port with a stale endpoint
// open, its STALE endpoint and stale flows, kube-proxy beside the verdict;
// the incident's ladder with a dry-run action marked.
func TestNodeAndIncidentPages(t *testing.T) {
	st := audit.NodeStatus{Node: "n1", State: audit.NodeStuck, Mode: audit.ModeNFTables, Services: 3, InSync: 2, Divergent: 1,
		KubeProxy: &audit.KubeProxySignal{Version: "v1.36.3", LastSync: now.Add(-5 * time.Minute), EndpointChangesPending: 4},
		// A stuck node's last read was incremental and found nothing; its
		// last whole read is what reading the node costs (issue #57).
		Collector: &audit.CollectorCost{Version: "v0.1.0", Reads: map[string]uint64{"change": 3}, LastReadSeconds: 0.0004,
			LastWholeReadSeconds: 0.21, LastWholeReadCPUSeconds: 0.18, LastWholeReadBytes: 4 << 20}}
	ports := []audit.PortTrace{{Service: "default/web", Port: "http", Protocol: "TCP", Frontends: []audit.FrontendTrace{{Frontend: "198.19.0.20:80/TCP", Status: audit.TraceOK,
		Endpoints: []audit.EndpointTrace{{Endpoint: "198.18.1.5:8080", Status: audit.TraceStale}, {Endpoint: "198.18.1.6:8080", Status: audit.TraceMissing}}}}}}
	inc := &Incident{DryRun: true, Node: "n1", Stage: "restarted", Opened: now.Add(-time.Minute), Restarts: []time.Time{now.Add(-30 * time.Second)},
		Actions: []Entry{{At: now.Add(-time.Minute), Node: "n1", Kind: "RestartProxy", Reason: "StuckProxy: …", DryRun: true}}}
	var b bytes.Buffer
	if err := Render(&b, "node", NodePage{Base: base(), Status: st, Ports: ports, Explained: true, Incident: inc}); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	for _, want := range []string{`<span class="state s-Stuck" id="state">Stuck</span>`, "<details class=\"port\" open>", "198.18.1.5:8080 <b>stale</b>",
		"198.18.1.6:8080 <b>missing</b>", "v1.36.3", "4 endpoint, 0 service", `<span class="dry">dry-run</span>`, "would restart kube-proxy (1×", "dry-run: nothing was changed",
		"0 bytes (only what changed: nothing)", "<th>Last whole read</th><td>210ms wall, 180ms CPU, 4194304 bytes", "no change programmed in the window",
		"<th>Version</th><td>v0.1.0</td>"} {
		if !strings.Contains(page, want) {
			t.Errorf("node page lacks %q", want)
		}
	}
	// In dry-run the ladder never says what was not done (issue #57).
	if strings.Contains(page, "kube-proxy restarted") {
		t.Error("a dry-run incident reads as if kube-proxy was restarted")
	}
	inc.DryRun = false
	b.Reset()
	if err := Render(&b, "node", NodePage{Base: base(), Status: st, Ports: ports, Explained: true, Incident: inc}); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(b.String(), "kube-proxy restarted (1×") {
		t.Error("a real restart is not said")
	}
}

// A duration is shown with the precision it has: a quick read is not 0.00s.
func TestSecondsKeepTheirPrecision(t *testing.T) {
	for in, want := range map[float64]string{0: "0s", 0.0004: "400µs", 0.0123: "12.3ms", 0.21: "210ms", 1.234: "1.23s", 42: "42.00s"} {
		if got := seconds(in); got != want {
			t.Errorf("seconds(%g) = %q, want %q", in, got, want)
		}
	}
}

func TestCountSaysOneInTheSingular(t *testing.T) {
	for n, want := range map[int]string{0: "0 samples", 1: "1 sample", 2: "2 samples", 40: "40 samples"} {
		if got := count(n, "sample"); got != want {
			t.Errorf("count(%d) = %q, want %q", n, got, want)
		}
	}
}
