// Command proxyaudit finds Kubernetes nodes whose kube-proxy rules have
// drifted from the cluster's Services and EndpointSlices. It is also the
// kubectl plugin kubectl-proxyaudit.
//
//	proxyaudit report [kubectl's connection flags] [-o table|wide|json|yaml|name|jsonpath=…|custom-columns=…|markdown]
//	proxyaudit explain node NAME [--service NAMESPACE/NAME]
//	proxyaudit ui | pause --reason TEXT | resume
//	proxyaudit diff --cluster cluster.json --rules NODE=FILE [--rules NODE=FILE …]
//	proxyaudit completion bash|zsh|fish|powershell
//	proxyaudit version
//
// See docs/usage.md, and docs/cli-conventions.md for how it follows kubectl.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Exit codes: no findings, findings, usage or input error.
const (
	exitClean    = 0
	exitFindings = 1
	exitUsage    = 2
	// exitUnaudited: no finding, but a family the cluster has was in no
	// dump of some node: not "in sync".
	exitUnaudited = 3
)

// maxInputBytes bounds one input file; larger inputs are refused.
const maxInputBytes = 1 << 30

// maxServiceEndpoints bounds the expected model: a Service with n ports and
// n endpoints is n² rules for kube-proxy and n² expected endpoints here
// (and, on a node that misses them, n² findings), so a cluster file of a
// few hundred kilobytes could ask for gigabytes. The bound is the one the
// aggregator puts on a node's report (stream.MaxEndpoints), far above the
// largest clusters' (100k endpoints at the anchors).
const maxServiceEndpoints = 2_000_000

const diffUsage = `Compares each node's rule dump with what kube-proxy should have programmed
there, offline: nothing is installed, nothing connects to a cluster.

--cluster FILE is the output of
  kubectl get services,endpointslices,nodes -A -o json   (or -o yaml)
a dump without Nodes, Services or their EndpointSlices is refused (it would
make findings that are not there).

--rules NODE=FILE is a node's rules, any of:
  iptables-save -t nat              (iptables mode, either backend)
  ip6tables-save -t nat             (its IPv6 half)
  nft -j list table ip kube-proxy   (nftables mode; "ip6" for IPv6, or
                                     nft -j list ruleset for both)
  ipvsadm -Sn  or  ipvsadm -Ln      (IPVS mode, both families)
  proxyaudit-collector --once --snapshot FILE   (any mode, Cilium's maps
                                     included: the release's image has it)
the format is detected from the content. Give a node once per family
(--rules n=v4.rules --rules n=v6.rules) or one file holding both
(iptables-save and ip6tables-save output one after the other); a family the
cluster has that no dump covers is reported as not audited. IPVS real
servers at weight 0 are listed apart as draining, not as findings.

--conntrack NODE=FILE is the node's conntrack table, from conntrack -L (or
-L -o extended), beside its --rules: flows of the node's service frontends
still DNATed to an address that is not an endpoint of the service are
StaleConntrack findings (UDP flows, TCP connect attempts).

Exit status: 0 no findings, 1 findings, 2 usage or input error, 3 no
findings but some node's IPv4 or IPv6 half not audited (no dump covered it).`

// diffFormats are diff's own formats (-o), the default first.
var diffFormats = []string{"table", "markdown"}

func (c *cli) diffCmd() *cobra.Command {
	var cluster string
	var rules, conntrack []string
	var format *string
	cmd := &cobra.Command{
		Use:   "diff --cluster FILE --rules NODE=FILE [--rules NODE=FILE ...]",
		Short: "Judge nodes' rule dumps against a cluster dump, offline",
		Long:  diffUsage,
		Example: `  kubectl get services,endpointslices,nodes -A -o json > cluster.json
  iptables-save -t nat > node-1.rules          # on node-1
  kubectl proxyaudit diff --cluster cluster.json --rules node-1=node-1.rules`,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return usageError{fmt.Errorf("unexpected argument %q (node dumps go in --rules NODE=FILE)", args[0])}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(*format, diffFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns); err != nil {
				c.code = c.fail(cmd, "%v", err)
				return nil
			}
			c.code = c.diff(cmd, cluster, rules, conntrack, *format)
			return nil
		},
	}
	cmd.Flags().StringVar(&cluster, "cluster", "", "cluster state: kubectl get services,endpointslices,nodes -A -o json (or -o yaml)")
	cmd.Flags().StringArrayVar(&rules, "rules", nil, "NODE=FILE, a node's rule dump (repeatable)")
	cmd.Flags().StringArrayVar(&conntrack, "conntrack", nil, "NODE=FILE, a node's conntrack -L output (repeatable)")
	format = addOutput(cmd.Flags(), diffFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns)
	return cmd
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func versionString() string { return "proxyaudit " + buildinfo.Get().String() }

// Report is the JSON output of diff; its field names are a public contract.
type Report struct {
	Findings []audit.Finding `json:"findings"`
	Summary  audit.Summary   `json:"summary"`
	// Draining lists IPVS real servers at weight 0 that the cluster no
	// longer lists: normal while their connections end, a leftover when
	// they stay (one dump cannot tell; the aggregator reports them after
	// its --ipvs-weight-zero-limit).
	Draining []audit.Finding `json:"draining,omitempty"`
	// Coverage says, per node, which IP families its dumps held and
	// which the cluster has that none did.
	Coverage []Coverage `json:"coverage,omitempty"`
	dual     map[string]bool
}

func (c *cli) diff(cmd *cobra.Command, cluster string, rules, conntrack []string, format string) int {
	stdout := c.stdout
	fail := func(format string, a ...any) int { return c.fail(cmd, format, a...) }
	if cluster == "" {
		return fail("--cluster is required: save it with kubectl get services,endpointslices,nodes -A -o json > cluster.json")
	}
	if len(rules) == 0 {
		return fail("at least one --rules NODE=FILE is required (e.g. --rules node-1=node-1.rules from iptables-save -t nat)")
	}
	data, err := readBounded(cluster)
	if err != nil {
		return fail("--cluster: %v", err)
	}
	st, in, err := audit.ParseCluster(data)
	if err != nil {
		return fail("--cluster %s: %v", cluster, err)
	}
	// A dump that lacks a kind would turn into findings that are not
	// there (every endpoint, or every rule, stale): refused.
	if err := in.Complete(); err != nil {
		return fail("--cluster %s cannot be judged: %v", cluster, err)
	}
	if n := st.ServiceEndpoints(); n > maxServiceEndpoints {
		return fail("--cluster %s: its services ask kube-proxy for %d endpoint rules (each EndpointSlice's ports × endpoints), more than the %d this command audits in one run (the collector's cap for one node); audit a part of the cluster: kubectl get services,endpointslices,nodes -n NAMESPACE -o json", cluster, n, maxServiceEndpoints)
	}
	// A node's dumps: one per family (iptables-save and ip6tables-save),
	// or one holding both.
	var nodes []string
	dumps := map[string][]string{}
	for _, r := range rules {
		node, path, ok := strings.Cut(r, "=")
		if !ok || node == "" || path == "" {
			return fail("--rules %q: want NODE=FILE", r)
		}
		if _, known := st.Nodes[node]; !known {
			return fail("--rules %s: no Node %q in the cluster input (known: %s)", r, node, knownNodes(st))
		}
		if dumps[node] == nil {
			nodes = append(nodes, node)
		}
		dumps[node] = append(dumps[node], path)
	}
	sort.Strings(nodes)
	tables := map[string]string{}
	for _, c := range conntrack {
		node, path, ok := strings.Cut(c, "=")
		if !ok || node == "" || path == "" {
			return fail("--conntrack %q: want NODE=FILE", c)
		}
		if dumps[node] == nil {
			return fail("--conntrack %s: give the node's rules too (--rules %s=FILE): its frontends say which flows are services'", c, node)
		}
		if tables[node] != "" {
			return fail("--conntrack %s: one table per node", c)
		}
		tables[node] = path
	}
	var history *audit.History
	at := time.Now()
	if len(tables) > 0 {
		history = audit.NewHistory(time.Hour)
		history.Update(st, at)
	}
	var findings, draining []audit.Finding
	var coverage []Coverage
	for _, node := range nodes {
		var parts []*audit.Observed
		cov := Coverage{Node: node}
		for _, path := range dumps[node] {
			f, err := os.Open(path)
			if err != nil {
				return fail("--rules %s: %v", node, err)
			}
			obs, err := readRules(io.LimitReader(f, maxInputBytes))
			f.Close()
			if err != nil {
				return fail("--rules %s (%s): %v", node, path, err)
			}
			parts = append(parts, obs)
			cov.Dumps = append(cov.Dumps, DumpCoverage{File: path, Families: obs.Families})
		}
		obs, err := audit.Merge(parts...)
		if err != nil {
			return fail("--rules %s (%s): %v", node, strings.Join(dumps[node], ", "), err)
		}
		exp := audit.ExpectedFor(st, node)
		cov.NotAudited = audit.Unaudited(exp, obs)
		coverage = append(coverage, cov)
		findings = append(findings, audit.Diff(exp, obs)...)
		draining = append(draining, audit.Draining(exp, obs)...)
		if path := tables[node]; path != "" {
			stale, err := staleFlows(node, path, obs, history, at)
			if err != nil {
				return fail("--conntrack %s (%s): %v", node, path, err)
			}
			findings = append(findings, stale...)
		}
	}
	audit.SortFindings(findings)
	audit.SortFindings(draining)
	rep := Report{Findings: findings, Summary: audit.Summarize(nodes, findings), Draining: draining, Coverage: coverage, dual: dualStack(st)}
	if rep.Findings == nil {
		rep.Findings = []audit.Finding{}
	}
	if err := render(stdout, format, rep, func() []any { return rowsOf(rep.Findings) }, func() []string { return nodeNames(rep.Findings, func(f audit.Finding) string { return f.Node }) },
		func(w io.Writer) { writeTable(w, rep, nodes) }, func(w io.Writer) { writeMarkdown(w, rep, nodes) }); err != nil {
		return fail("%v", err)
	}
	if len(findings) > 0 {
		return exitFindings
	}
	if rep.unaudited() != "" {
		return exitUnaudited
	}
	return exitClean
}

// staleFlows judges a node's conntrack -L output against the one cluster
// state given: offline there is no history, so a destination that is not
// an endpoint now is stale now (no grace).
func staleFlows(node, path string, obs *audit.Observed, h *audit.History, at time.Time) ([]audit.Finding, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	keys := make([]audit.FrontendKey, 0, len(obs.Frontends))
	for _, fe := range obs.Frontends {
		keys = append(keys, fe.FrontendKey)
	}
	// Node ports on any address: the dump does not say which are the
	// node's.
	c := conntrack.NewCounter(keys, nil, 1<<20)
	if _, err := conntrack.ParseList(io.LimitReader(f, maxInputBytes), c.Add); err != nil {
		return nil, err
	}
	var out []audit.Finding
	for _, tf := range audit.JudgeConntrack(node, c.Result(obs.Families), h, obs.Mode, at, 0) {
		out = append(out, tf.Finding)
	}
	return out, nil
}

// Coverage is which IP families a node's dumps held.
type Coverage struct {
	Node  string         `json:"node"`
	Dumps []DumpCoverage `json:"dumps"`
	// NotAudited lists the families the node should program services in
	// but no dump covers: neither in sync nor drifted, unknown.
	NotAudited []int `json:"notAudited,omitempty"`
}

// DumpCoverage is one dump file and the families it holds.
type DumpCoverage struct {
	File     string `json:"file"`
	Families []int  `json:"families"`
}

// unaudited says which nodes' families no dump covered, or "".
func (r Report) unaudited() string {
	var out []string
	for _, c := range r.Coverage {
		for _, f := range c.NotAudited {
			out = append(out, fmt.Sprintf("%s IPv%d", c.Node, f))
		}
	}
	return strings.Join(out, ", ")
}

// dualStack lists the services with cluster IPs in both families: their
// findings name the family.
func dualStack(st *audit.State) map[string]bool {
	out := map[string]bool{}
	for _, s := range st.Services {
		if len(s.ClusterIPs) == 2 {
			out[s.Namespace+"/"+s.Name] = true
		}
	}
	return out
}

// readRules parses a node's rules dump, or a collector's snapshot
// (proxyaudit-collector --once --snapshot FILE): the rules as streamed.
func readRules(r io.Reader) (*audit.Observed, error) {
	br := bufio.NewReader(r)
	if head, _ := br.Peek(64); bytes.HasPrefix(bytes.TrimLeft(head, " \t\r\n"), []byte("{")) && bytes.Contains(head, []byte(`"type"`)) {
		var m stream.Message
		if err := json.NewDecoder(br).Decode(&m); err != nil {
			return nil, fmt.Errorf("collector snapshot: %v", err)
		}
		if m.Type != stream.TypeReport || m.Report == nil || !m.Report.Full {
			return nil, fmt.Errorf("collector snapshot: a %q message, not a full report (write one with proxyaudit-collector --once --snapshot FILE)", m.Type)
		}
		st := stream.NewState()
		if _, err := st.Apply(m.Report); err != nil {
			return nil, fmt.Errorf("collector snapshot: %v", err)
		}
		return st.Observed(), nil
	}
	return dataplane.ParseRules(br)
}

func readBounded(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxInputBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxInputBytes {
		return nil, errors.New("larger than 1 GiB: not a cluster dump")
	}
	return data, nil
}

func knownNodes(st *audit.State) string {
	var ns []string
	for n := range st.Nodes {
		ns = append(ns, n)
	}
	sort.Strings(ns)
	if len(ns) > 8 {
		ns = append(ns[:8], "…")
	}
	return strings.Join(ns, ", ")
}

func svcPort(f audit.Finding) string {
	s := f.Service
	if s == "" {
		s = "(unknown service)"
	}
	if f.Port != "" {
		s += ":" + f.Port
	}
	return s + "/" + f.Protocol
}

// svcPortFamily is svcPort, naming IPv6 (a report from the aggregator
// does not say which services are dual-stack; IPv4 stays unmarked).
func svcPortFamily(f audit.Finding) string {
	if f.Family == 6 {
		return svcPort(f) + " (IPv6)"
	}
	return svcPort(f)
}

// svcPortIn is svcPort, with the IP family where the service has both.
func (r Report) svcPortIn(f audit.Finding) string {
	if f.Family != 0 && r.dual[f.Service] {
		return fmt.Sprintf("%s (IPv%d)", svcPort(f), f.Family)
	}
	return svcPort(f)
}

// writeCoverage says which family each dump covered where a node had
// several or the cluster has a family no dump covered.
func writeCoverage(w io.Writer, rep Report) {
	for _, c := range rep.Coverage {
		if len(c.Dumps) < 2 && len(c.NotAudited) == 0 {
			continue
		}
		var ds []string
		for _, d := range c.Dumps {
			fams := make([]string, len(d.Families))
			for i, f := range d.Families {
				fams[i] = fmt.Sprintf("IPv%d", f)
			}
			ds = append(ds, d.File+": "+strings.Join(fams, "+"))
		}
		fmt.Fprintf(w, "\n%s: rules read from %s\n", c.Node, strings.Join(ds, ", "))
		for _, f := range c.NotAudited {
			fmt.Fprintf(w, "%s: IPv%d NOT AUDITED: the cluster has IPv%d services and no dump covers IPv%d (add the node's %s output with another --rules %s=FILE)\n",
				c.Node, f, f, f, map[int]string{4: "iptables-save -t nat", 6: "ip6tables-save -t nat"}[f], c.Node)
		}
	}
}

// writeTable groups findings by node, then service, for a person at a glance.
func writeTable(w io.Writer, rep Report, nodes []string) {
	s := rep.Summary
	fmt.Fprintf(w, "%d node(s) audited: %d in sync, %d drifted, %d finding(s)\n", s.Nodes, s.NodesInSync, s.NodesDrifted, s.Findings)
	writeCoverage(w, rep)
	notAudited := map[string]bool{}
	for _, c := range rep.Coverage {
		notAudited[c.Node] = len(c.NotAudited) > 0
	}
	byNode := findingsByNode(rep.Findings)
	for _, n := range nodes {
		fs := byNode[n]
		if len(fs) == 0 && notAudited[n] {
			fmt.Fprintf(w, "\n%s: in sync in the families audited\n", n)
			continue
		}
		if len(fs) == 0 {
			fmt.Fprintf(w, "\n%s: in sync\n", n)
			continue
		}
		fmt.Fprintf(w, "\n%s: %d finding(s)\n", n, len(fs))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "  SERVICE\tSCOPE\tKIND\tENDPOINT\tDETAIL")
		prev := ""
		eachRow(fs, func(f audit.Finding, more int) {
			sp := rep.svcPortIn(f)
			if f.Kind == audit.NoRules {
				sp = "(all services)"
			}
			shown := sp
			if sp == prev {
				shown = `  "`
			}
			prev = sp
			if more > 0 {
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", shown, orDash(string(f.Scope)), f.Kind, fmt.Sprintf("(%d more)", more), moreRows)
				return
			}
			ep := f.Endpoint
			if ep == "" {
				ep = "-"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", shown, orDash(string(f.Scope)), f.Kind, ep, f.Detail)
		})
		tw.Flush()
	}
	writeDraining(w, rep.Draining)
}

// findingsByNode splits findings sorted by node into each node's run,
// without copying them (there can be millions).
func findingsByNode(fs []audit.Finding) map[string][]audit.Finding {
	out := map[string][]audit.Finding{}
	for i := 0; i < len(fs); {
		j := i + 1
		for j < len(fs) && fs[j].Node == fs[i].Node {
			j++
		}
		if prev, ok := out[fs[i].Node]; ok { // not sorted after all
			out[fs[i].Node] = append(slices.Clip(prev), fs[i:j]...)
		} else {
			out[fs[i].Node] = fs[i:j:j]
		}
		i = j
	}
	return out
}

// writeDraining lists IPVS real servers at weight 0 after the findings.
func writeDraining(w io.Writer, ds []audit.Finding) {
	if len(ds) == 0 {
		return
	}
	fmt.Fprintf(w, "\n%d IPVS real server(s) at weight 0, no longer listed by the cluster (draining: normal while their connections end; a leftover if still there after %s):\n", len(ds), audit.DefaultWeightZeroLimit)
	for _, f := range ds {
		fmt.Fprintf(w, "  %s  %s  %s\n", f.Node, svcPort(f), f.Endpoint)
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// mdCell is text as one inert Markdown table cell: node names, details
// and chain names come from nodes and dumps.
func mdCell(s string) string { return safetext.Markdown(s) }

// shown writes what render prints with every control character,
// bidirectional override and invalid byte shown as an escape (\x1b), so
// that text from a node or a dump cannot drive the reader's terminal.
func shown(w io.Writer, render func(io.Writer)) {
	var b strings.Builder
	render(&b)
	io.WriteString(w, safetext.Terminal(b.String()))
}

func writeMarkdown(w io.Writer, rep Report, nodes []string) {
	s := rep.Summary
	fmt.Fprintf(w, "### proxyaudit: %d node(s), %d in sync, %d drifted, %d finding(s)\n\n", s.Nodes, s.NodesInSync, s.NodesDrifted, s.Findings)
	writeCoverage(w, rep)
	if len(rep.Findings) == 0 && rep.unaudited() != "" {
		fmt.Fprintf(w, "\nNo finding in what was audited; not audited: %s.\n", mdCell(rep.unaudited()))
		writeDraining(w, rep.Draining)
		return
	}
	if len(rep.Findings) == 0 {
		fmt.Fprintln(w, "Every audited node's kube-proxy rules match the cluster.")
		writeDraining(w, rep.Draining)
		return
	}
	defer writeDraining(w, rep.Draining)
	fmt.Fprintln(w, "| Node | Service | Scope | Kind | Endpoint | Detail |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	eachRow(rep.Findings, func(f audit.Finding, more int) {
		if more > 0 {
			fmt.Fprintf(w, "| %s | %s | %s | %s | (%d more) | %s |\n", mdCell(f.Node), mdCell(rep.svcPortIn(f)), orDash(string(f.Scope)), mdCell(string(f.Kind)), more, moreRows)
			return
		}
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", mdCell(f.Node), mdCell(rep.svcPortIn(f)), orDash(string(f.Scope)), mdCell(string(f.Kind)), orDash(mdCell(f.Endpoint)), mdCell(f.Detail))
	})
}

// maxGroupRows is how many findings of one kind on one service port of one
// node a table or markdown output lists; the rest are counted in one row.
// A Service with n ports and n endpoints that a node misses is n² findings:
// a reader learns nothing from the 21st row of the same thing, and the
// output stays proportional to the services, not to their square (JSON
// lists every finding).
const maxGroupRows = 20

const moreRows = "of the same kind on this service port, not listed here: -o json lists every finding"

// eachRow calls row(f, 0) for each finding to list and, after the first
// maxGroupRows of a run of findings (sorted) sharing node, service port,
// scope and kind, row(f, n) once with the run's next finding and how many
// are left out.
func eachRow(fs []audit.Finding, row func(f audit.Finding, more int)) {
	for i := 0; i < len(fs); {
		j := i + 1
		for j < len(fs) && sameGroup(fs[i], fs[j]) {
			j++
		}
		for k := i; k < j && k < i+maxGroupRows; k++ {
			row(fs[k], 0)
		}
		if j-i > maxGroupRows {
			row(fs[i+maxGroupRows], j-i-maxGroupRows)
		}
		i = j
	}
}

func sameGroup(a, b audit.Finding) bool {
	return a.Node == b.Node && a.Service == b.Service && a.Port == b.Port && a.Protocol == b.Protocol &&
		a.Family == b.Family && a.Scope == b.Scope && a.Kind == b.Kind
}
