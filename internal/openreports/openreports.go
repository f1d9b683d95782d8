// Package openreports turns a verdict into OpenReports objects
// (openreports.io/v1alpha1 ClusterReport), the form policy tools share
// findings in and that Policy Reporter, hub collectors and dashboards
// read: one ClusterReport per node with findings, scoped to the Node, and
// one for the fleet's own findings (a mass divergence).
//
// One report per node, not one per cluster: a node's findings change on
// their own, so a change rewrites one small object instead of the whole
// cluster's; each object stays far below etcd's limit (a flushed node
// with 10k services is summarised, see MaxResults); and a consumer shows
// findings by resource, which the Node scope gives it.
//
// Build, Want and Plan are pure; the Writer (writer.go) makes the leader's
// API writes, rate-limited and merged.
//
// The types are written here to the API's JSON schema rather than taken
// from github.com/openreports/reports-api: that module moves
// go-openapi and easyjson versions the Kubernetes tools built for the
// tests share with this module.
package openreports

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// The API, and how proxyaudit's objects are named and labelled.
const (
	APIVersion = "openreports.io/v1alpha1"
	Kind       = "ClusterReport"
	Source     = "proxyaudit"
	// LabelManagedBy marks the objects proxyaudit writes (and may delete).
	LabelManagedBy = "app.kubernetes.io/managed-by"
	// LabelNode names the node a report is about (a label value: a node
	// name longer than 63 characters is given as the hash NodeLabel
	// makes, and AnnotationNode names it whole).
	LabelNode = "proxyaudit.io/node"
	// AnnotationNode names the node a report is about, whatever its length.
	AnnotationNode = "proxyaudit.io/node-name"
	// FleetName is the report of findings about no one node.
	FleetName = "proxyaudit-fleet"
	// MaxResults bounds the results one report lists; the rest are
	// counted in its summary and one result that says how many of each
	// kind were left out.
	MaxResults = 200
	// maxText bounds a result's message and each property.
	maxText = 1024
)

// ClusterReport is an openreports.io/v1alpha1 ClusterReport.
type ClusterReport struct {
	APIVersion string           `json:"apiVersion"`
	Kind       string           `json:"kind"`
	Metadata   ObjectMeta       `json:"metadata"`
	Source     string           `json:"source"`
	Scope      *ObjectReference `json:"scope,omitempty"`
	Summary    Summary          `json:"summary"`
	Results    []Result         `json:"results,omitempty"`
}

// ObjectMeta is the part of an object's metadata proxyaudit sets.
type ObjectMeta struct {
	Name            string            `json:"name"`
	Labels          map[string]string `json:"labels,omitempty"`
	Annotations     map[string]string `json:"annotations,omitempty"`
	ResourceVersion string            `json:"resourceVersion,omitempty"`
	OwnerReferences []OwnerReference  `json:"ownerReferences,omitempty"`
}

// OwnerReference names the object a report lives and dies with.
type OwnerReference struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Name       string `json:"name"`
	UID        string `json:"uid"`
}

// ObjectReference names a Kubernetes object.
type ObjectReference struct {
	APIVersion string `json:"apiVersion,omitempty"`
	Kind       string `json:"kind,omitempty"`
	Name       string `json:"name,omitempty"`
}

// Summary counts a report's results by outcome, those left out included.
type Summary struct {
	Pass  int `json:"pass"`
	Fail  int `json:"fail"`
	Warn  int `json:"warn"`
	Error int `json:"error"`
	Skip  int `json:"skip"`
}

// Timestamp is the API's {seconds, nanos}.
type Timestamp struct {
	Seconds int64 `json:"seconds"`
	Nanos   int32 `json:"nanos"`
}

// Result is one finding.
type Result struct {
	Source     string            `json:"source"`
	Policy     string            `json:"policy"`
	Rule       string            `json:"rule,omitempty"`
	Category   string            `json:"category,omitempty"`
	Severity   string            `json:"severity,omitempty"`
	Timestamp  Timestamp         `json:"timestamp,omitempty"`
	Result     string            `json:"result,omitempty"`
	Subjects   []ObjectReference `json:"resources,omitempty"`
	Message    string            `json:"message,omitempty"`
	Properties map[string]string `json:"properties,omitempty"`
}

// outcome is a finding kind's result and severity: drift that breaks
// traffic fails, what makes the node's state unknown or is a fleet-wide
// guard warns.
func outcome(k audit.Kind) (result, severity string) {
	switch k {
	case audit.StaleEndpoint, audit.MissingEndpoint, audit.StaleService, audit.MissingService, audit.NoRules, audit.StuckProxy:
		return "fail", "high"
	case audit.StaleConntrack:
		return "fail", "medium"
	}
	return "warn", "medium" // CollectorMissing, MassDivergence, and kinds to come
}

// Name is the report of node's findings: proxyaudit-node-NODE, or where
// that would be longer than an object name may be (253; FQDN node names
// are common) the node name cut and a hash of the whole, so that two long
// names never share a report.
func Name(node string) string {
	if node == "" {
		return FleetName
	}
	const prefix, limit = "proxyaudit-node-", 253
	if len(prefix)+len(node) <= limit {
		return prefix + node
	}
	h := nodeHash(node)
	return strings.TrimRight(prefix+node[:limit-len(prefix)-len(h)-1], ".-") + "-" + h
}

// NodeLabel is the value of LabelNode for node: the name itself where it
// is a label value (63 characters at most), else a hash of it.
func NodeLabel(node string) string {
	if len(node) <= 63 {
		return node
	}
	return "sha256-" + nodeHash(node)
}

// nodeHash is 16 hex digits of node's SHA-256.
func nodeHash(node string) string {
	sum := sha256.Sum256([]byte(node))
	return hex.EncodeToString(sum[:8])
}

// NodeOf is the node a report written by this version or an earlier one
// is about ("" for the fleet's).
func NodeOf(r ClusterReport) string {
	if n := r.Metadata.Annotations[AnnotationNode]; n != "" {
		return n
	}
	return r.Metadata.Labels[LabelNode]
}

// Build returns the reports of a verdict: one per node with findings,
// sorted by name.
func Build(v *audit.Verdict) []ClusterReport {
	byNode := map[string][]audit.TimedFinding{}
	for _, f := range v.Findings {
		byNode[f.Node] = append(byNode[f.Node], f)
	}
	out := make([]ClusterReport, 0, len(byNode))
	for node, fs := range byNode {
		out = append(out, build(node, fs))
	}
	slices.SortFunc(out, func(a, b ClusterReport) int { return strings.Compare(a.Metadata.Name, b.Metadata.Name) })
	return out
}

func build(node string, fs []audit.TimedFinding) ClusterReport {
	r := ClusterReport{APIVersion: APIVersion, Kind: Kind, Source: Source,
		Metadata: ObjectMeta{Name: Name(node), Labels: map[string]string{LabelManagedBy: Source}}}
	var subjects []ObjectReference
	if node != "" {
		r.Metadata.Labels[LabelNode] = NodeLabel(node)
		r.Metadata.Annotations = map[string]string{AnnotationNode: node}
		r.Scope = &ObjectReference{APIVersion: "v1", Kind: "Node", Name: node}
		subjects = []ObjectReference{*r.Scope}
	}
	// Node-level kinds (no service) first, then by service: the ones to
	// read first are listed when the rest are left out.
	fs = slices.Clone(fs)
	slices.SortStableFunc(fs, func(a, b audit.TimedFinding) int {
		return cmp.Or(strings.Compare(a.Service, b.Service), strings.Compare(a.Port, b.Port),
			strings.Compare(string(a.Kind), string(b.Kind)), strings.Compare(a.Endpoint, b.Endpoint))
	})
	left := map[audit.Kind]int{}
	for i, f := range fs {
		res, _ := outcome(f.Kind)
		switch res {
		case "fail":
			r.Summary.Fail++
		default:
			r.Summary.Warn++
		}
		if i >= MaxResults {
			left[f.Kind]++
			continue
		}
		r.Results = append(r.Results, result(f, subjects))
	}
	if len(left) > 0 {
		var parts []string
		n := 0
		for _, k := range slices.Sorted(maps.Keys(left)) {
			parts = append(parts, fmt.Sprintf("%s %d", k, left[k]))
			n += left[k]
		}
		r.Results = append(r.Results, Result{Source: Source, Policy: "proxyaudit/Omitted", Result: "warn", Severity: "info", Subjects: subjects,
			Message:    fmt.Sprintf("%d more finding(s) not listed here (%s): `proxyaudit report` and `proxyaudit explain node %s` show them all", n, strings.Join(parts, ", "), node),
			Properties: map[string]string{"omitted": fmt.Sprint(n)}})
	}
	return r
}

func result(f audit.TimedFinding, subjects []ObjectReference) Result {
	res, sev := outcome(f.Kind)
	props := map[string]string{"since": f.Since.UTC().Format(time.RFC3339)}
	set := func(k, v string) {
		if v != "" {
			props[k] = clip(v)
		}
	}
	set("service", f.Service)
	set("port", f.Port)
	set("protocol", f.Protocol)
	set("scope", string(f.Scope))
	set("endpoint", f.Endpoint)
	set("frontend", f.Frontend)
	if f.Family != 0 {
		props["family"] = fmt.Sprintf("IPv%d", f.Family)
	}
	if f.Flows != 0 {
		props["flows"] = fmt.Sprint(f.Flows)
	}
	rule := ""
	if f.Service != "" {
		rule = f.Service
		if f.Port != "" {
			rule += ":" + f.Port
		}
	}
	return Result{Source: Source, Policy: "proxyaudit/" + string(f.Kind), Rule: clip(rule), Category: "kube-proxy drift", Severity: sev, Result: res,
		Timestamp: Timestamp{Seconds: f.Since.Unix(), Nanos: int32(f.Since.Nanosecond())}, Subjects: subjects, Message: clip(f.Detail), Properties: props}
}

// clip bounds text a node or the cluster supplied.
func clip(s string) string {
	if len(s) <= maxText {
		return s
	}
	cut := maxText
	for cut > 0 && s[cut]&0xC0 == 0x80 { // a rune's continuation byte
		cut--
	}
	return s[:cut] + "…"
}

// Want is what the API should hold for a verdict, given the reports it
// holds: Build's, and, kept as they are, those of nodes the verdict does
// not judge yet (pending: a new leader, or a node that has not reported
// since it took over) — a leader adopts what the last one wrote instead
// of deleting a node's report until that node is heard again. A node's
// report goes when the node is judged without findings, or leaves the
// cluster; the fleet's when a judged fleet has no fleet-wide finding.
func Want(v *audit.Verdict, have []ClusterReport) []ClusterReport {
	want := Build(v)
	named := make(map[string]bool, len(want))
	for _, r := range want {
		named[r.Metadata.Name] = true
	}
	pending := map[string]bool{}
	judged := false
	for _, n := range v.Nodes {
		if n.State == audit.NodePending {
			pending[n.Node] = true
		} else {
			judged = true
		}
	}
	for _, h := range have {
		if named[h.Metadata.Name] {
			continue
		}
		node := NodeOf(h)
		if pending[node] || (!judged && h.Metadata.Name == FleetName) {
			want = append(want, h)
		}
	}
	return want
}

// Plan compares the reports that exist (of proxyaudit's, found by
// LabelManagedBy) with those the verdict wants: which to create, which to
// update (their content differs; ResourceVersion carried over for an
// optimistic update) and which to delete (their node's drift ended).
func Plan(have, want []ClusterReport) (create, update []ClusterReport, del []string) {
	old := make(map[string]ClusterReport, len(have))
	for _, r := range have {
		old[r.Metadata.Name] = r
	}
	for _, w := range want {
		h, ok := old[w.Metadata.Name]
		delete(old, w.Metadata.Name)
		switch {
		case !ok:
			create = append(create, w)
		case !same(h, w):
			w.Metadata.ResourceVersion = h.Metadata.ResourceVersion
			update = append(update, w)
		}
	}
	for name := range old {
		del = append(del, name)
	}
	slices.Sort(del)
	return create, update, del
}

// same says whether two reports say the same, their resource versions
// aside.
func same(a, b ClusterReport) bool {
	a.Metadata.ResourceVersion, b.Metadata.ResourceVersion = "", ""
	return reflect.DeepEqual(a, b)
}
