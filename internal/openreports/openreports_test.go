package openreports

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/proxyaudit/proxyaudit/audit"
)

var since = time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)

func stale(node string, i int) audit.TimedFinding {
	return audit.TimedFinding{Since: since, Finding: audit.Finding{Node: node, Service: fmt.Sprintf("ns/svc-%05d", i), Port: "http", Protocol: "TCP", Family: 4,
		Scope: audit.ScopeCluster, Kind: audit.StaleEndpoint, Endpoint: "198.18.0.9:8080", Detail: "the node routes to 198.18.0.9:8080, which the cluster no longer lists"}}
}

// Each node with findings gets its report, scoped to the Node; each
// finding its result, failing or warning by kind, with its service,
// endpoint and family as properties; nodes without findings get none.
func TestBuild(t *testing.T) {
	v := &audit.Verdict{Findings: []audit.TimedFinding{
		stale("node-b", 1),
		{Since: since, Finding: audit.Finding{Node: "node-b", Kind: audit.StuckProxy, Detail: "kube-proxy stopped following the API"}},
		{Since: since, Finding: audit.Finding{Node: "node-d", Kind: audit.CollectorMissing, Detail: "last report 1m ago"}},
		{Since: since, Finding: audit.Finding{Kind: audit.MassDivergence, Detail: "most nodes drift at once"}},
	}}
	rs := Build(v)
	var names []string
	for _, r := range rs {
		names = append(names, r.Metadata.Name)
	}
	if got := strings.Join(names, " "); got != "proxyaudit-fleet proxyaudit-node-node-b proxyaudit-node-node-d" {
		t.Fatalf("reports: %s", got)
	}
	b := rs[1]
	if b.Scope == nil || b.Scope.Kind != "Node" || b.Scope.Name != "node-b" || b.Metadata.Labels[LabelNode] != "node-b" || b.Metadata.Labels[LabelManagedBy] != Source {
		t.Errorf("node-b's report is not scoped to its Node: %+v %+v", b.Scope, b.Metadata)
	}
	if b.Summary != (Summary{Fail: 2}) || len(b.Results) != 2 {
		t.Fatalf("node-b: %+v, %d results", b.Summary, len(b.Results))
	}
	if r := b.Results[0]; r.Policy != "proxyaudit/StuckProxy" || r.Result != "fail" || r.Rule != "" {
		t.Errorf("node-level finding first: %+v", r)
	}
	r := b.Results[1]
	want := map[string]string{"service": "ns/svc-00001", "port": "http", "protocol": "TCP", "scope": "cluster", "endpoint": "198.18.0.9:8080", "family": "IPv4", "since": "2026-11-28T12:00:00Z"}
	if r.Policy != "proxyaudit/StaleEndpoint" || r.Rule != "ns/svc-00001:http" || r.Severity != "high" || fmt.Sprint(r.Properties) != fmt.Sprint(want) ||
		r.Timestamp.Seconds != since.Unix() || len(r.Subjects) != 1 || r.Subjects[0].Name != "node-b" {
		t.Errorf("the stale endpoint's result: %+v", r)
	}
	if d := rs[2]; d.Summary != (Summary{Warn: 1}) || d.Results[0].Result != "warn" {
		t.Errorf("a silent collector warns: %+v", d)
	}
	if f := rs[0]; f.Scope != nil || f.Metadata.Labels[LabelNode] != "" {
		t.Errorf("the fleet's report names a node: %+v", f)
	}
}

// A flushed node with 10k services at fault is summarised: the report
// stays far below etcd's 1.5 MiB object limit, counts every finding and
// says how many of each kind it leaves out. Hostile detail is clipped.
func TestBuildIsBounded(t *testing.T) {
	var fs []audit.TimedFinding
	for i := range 20000 {
		f := stale("node-x", i)
		if i%2 == 1 {
			f.Kind, f.Endpoint = audit.MissingService, ""
		}
		f.Detail = strings.Repeat("é", 10_000)
		fs = append(fs, f)
	}
	rs := Build(&audit.Verdict{Findings: fs})
	if len(rs) != 1 {
		t.Fatalf("%d reports", len(rs))
	}
	r := rs[0]
	raw, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) > 512<<10 {
		t.Errorf("a report of 20,000 findings is %d bytes", len(raw))
	}
	if r.Summary.Fail != 20000 || len(r.Results) != MaxResults+1 {
		t.Errorf("summary %+v, %d results", r.Summary, len(r.Results))
	}
	last := r.Results[len(r.Results)-1]
	if last.Policy != "proxyaudit/Omitted" || !strings.Contains(last.Message, "19800 more finding(s)") || !strings.Contains(last.Message, "MissingService 9900, StaleEndpoint 9900") {
		t.Errorf("the left-out count: %+v", last)
	}
	if m := r.Results[0].Message; len(m) > maxText+len("…") || !strings.HasSuffix(m, "…") {
		t.Errorf("a 20 KB detail became a %d-byte message", len(m))
	}
	t.Logf("20,000 findings: a %d-byte report", len(raw))
}

// Plan writes only what changed: new drift creates, changed drift updates
// (with the version it read), ended drift deletes; an unchanged report is
// not written again.
func TestPlan(t *testing.T) {
	have := Build(&audit.Verdict{Findings: []audit.TimedFinding{stale("a", 1), stale("b", 1), stale("c", 1)}})
	for i := range have {
		have[i].Metadata.ResourceVersion = fmt.Sprint(100 + i)
	}
	want := Build(&audit.Verdict{Findings: []audit.TimedFinding{stale("a", 1), stale("b", 2), stale("d", 1)}})
	create, update, del := Plan(have, want)
	if len(create) != 1 || create[0].Metadata.Name != "proxyaudit-node-d" {
		t.Errorf("create %+v", create)
	}
	if len(update) != 1 || update[0].Metadata.Name != "proxyaudit-node-b" || update[0].Metadata.ResourceVersion != "101" {
		t.Errorf("update %+v", update)
	}
	if fmt.Sprint(del) != "[proxyaudit-node-c]" {
		t.Errorf("delete %v", del)
	}
	if c, u, d := Plan(want, want); len(c)+len(u)+len(d) != 0 {
		t.Errorf("an unchanged verdict writes %d, %d, %d", len(c), len(u), len(d))
	}
}

// Want keeps, as they are, the reports of nodes the verdict has not
// judged yet (a new leader's first verdicts), and the fleet's while no
// node is judged; it drops those of nodes judged clean or gone.
func TestWantKeepsWhatIsNotJudgedYet(t *testing.T) {
	have := Build(&audit.Verdict{Findings: []audit.TimedFinding{stale("node-a", 1), stale("node-b", 2), stale("node-c", 3),
		{Since: since, Finding: audit.Finding{Kind: audit.MassDivergence, Detail: "storm"}}}})
	for i := range have {
		have[i].Metadata.ResourceVersion = fmt.Sprint(i + 1)
	}
	names := func(rs []ClusterReport) string {
		var out []string
		for _, r := range rs {
			out = append(out, r.Metadata.Name)
		}
		return strings.Join(out, " ")
	}
	// Nobody judged yet: everything stays, nothing is written.
	v := &audit.Verdict{Nodes: []audit.NodeStatus{{Node: "node-a", State: audit.NodePending}, {Node: "node-b", State: audit.NodePending}}}
	if c, u, d := Plan(have, Want(v, have)); len(c)+len(u) != 0 || fmt.Sprint(d) != "[proxyaudit-node-node-c]" {
		t.Errorf("before any judgement: create %s, update %s, delete %v (only node-c, gone from the cluster, goes)", names(c), names(u), d)
	}
	// node-a judged clean, node-b still pending: node-a's and the fleet's go.
	v.Nodes[0].State = audit.NodeInSync
	if c, u, d := Plan(have, Want(v, have)); len(c)+len(u) != 0 || fmt.Sprint(d) != "[proxyaudit-fleet proxyaudit-node-node-a proxyaudit-node-node-c]" {
		t.Errorf("node-a judged: create %s, update %s, delete %v", names(c), names(u), d)
	}
}

// A report's name and node label are what the API server takes, whatever
// the node's name (up to 253 characters), and two long names never share
// a report.
func TestNamesOfLongNodes(t *testing.T) {
	long := strings.Repeat("ip-198-18-0-1.", 19)[:253]
	other := long[:252] + "x"
	for _, n := range []string{"node-b", "a" + strings.Repeat("0123456789", 7), long, other} {
		name, label := Name(n), NodeLabel(n)
		if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
			t.Errorf("node of %d characters: name %q: %v", len(n), name, errs)
		}
		if errs := validation.IsValidLabelValue(label); len(errs) > 0 {
			t.Errorf("node of %d characters: label %q: %v", len(n), label, errs)
		}
		r := build(n, []audit.TimedFinding{{Finding: audit.Finding{Node: n, Kind: audit.NoRules}}})
		if NodeOf(r) != n {
			t.Errorf("the report of %q names node %q", n, NodeOf(r))
		}
	}
	if Name(long) == Name(other) || NodeLabel(long) == NodeLabel(other) {
		t.Error("two long node names share a report")
	}
}
