package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"

	"github.com/proxyaudit/proxyaudit/audit"
)

const explainUsage = `proxyaudit explain: one node's kube-proxy rules traced against the cluster.

Usage:
  proxyaudit explain node NAME [--service NAMESPACE/NAME] [access flags as for report] [-o table|json]

For each service port: each frontend (cluster IP, node port, load-balancer IP)
with its service chain, and each endpoint with its DNAT rule, marked ok, STALE
(in the rules, gone from the cluster) or MISSING (in the cluster, not in the
rules). A dual-stack service is traced once per IP family; a family whose
rules the node's collector could not read is NOT AUDITED.

Exit status: 0 everything ok, 1 stale or missing rules, 2 usage error or
aggregator unreachable, 3 nothing stale or missing but a family not audited.
`

func runExplain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("explain", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, explainUsage); fs.PrintDefaults() }
	acc := accessFlags(fs)
	service := fs.String("service", "", "only this service (namespace/name)")
	format := fs.String("o", "table", "output format: table or json")
	if len(args) < 2 || args[0] != "node" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fs.Usage()
			return exitClean
		}
		fmt.Fprint(stderr, "proxyaudit explain: want `explain node NAME`\n\n"+explainUsage)
		return exitUsage
	}
	node := args[1]
	if err := fs.Parse(args[2:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitClean
		}
		return exitUsage
	}
	if *format != "table" && *format != "json" {
		fmt.Fprintf(stderr, "proxyaudit explain: -o %q: choose table or json\n", *format)
		return exitUsage
	}
	if err := acc.single("explain"); err != nil {
		fmt.Fprintf(stderr, "proxyaudit explain: %v\n", err)
		return exitUsage
	}
	get, cancel, err := acc.getter()
	if err != nil {
		fmt.Fprintf(stderr, "proxyaudit explain: %v\n", err)
		return exitUsage
	}
	defer cancel()
	path := "/api/v1/nodes/" + url.PathEscape(node) + "/explain"
	if *service != "" {
		path += "?service=" + url.QueryEscape(*service)
	}
	b, err := get(path)
	if err != nil {
		fmt.Fprintf(stderr, "proxyaudit explain: %v\n", err)
		return exitUsage
	}
	var resp api.ExplainResponse
	if err := json.Unmarshal(b, &resp); err != nil {
		fmt.Fprintf(stderr, "proxyaudit explain: not the aggregator's answer: %v\n", err)
		return exitUsage
	}
	if *service != "" && len(resp.Ports) == 0 {
		fmt.Fprintf(stderr, "proxyaudit explain: node %s should program no port of %s (no such service, headless, or no rules by design)\n", node, *service)
		return exitUsage
	}
	bad, unaudited := 0, 0
	for _, p := range resp.Ports {
		for _, f := range p.Frontends {
			switch f.Status {
			case audit.TraceOK:
			case audit.TraceUnaudited:
				unaudited++
			default:
				bad++
			}
			for _, e := range f.Endpoints {
				if e.Status != audit.TraceOK {
					bad++
				}
			}
		}
		bad += len(p.StaleFlows)
	}
	if *format == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(resp)
	} else {
		shown(stdout, func(w io.Writer) { explainTable(w, resp, bad, unaudited) })
	}
	if bad > 0 {
		return exitFindings
	}
	if unaudited > 0 {
		return exitUnaudited
	}
	return exitClean
}

func explainTable(w io.Writer, r api.ExplainResponse, bad, unaudited int) {
	fmt.Fprintf(w, "node %s (%s): %d stale or missing rule(s) or stale flow(s)", r.Node, r.Mode, bad)
	if unaudited > 0 {
		fmt.Fprintf(w, "; %d frontend(s) of an IP family whose rules were not read (NOT AUDITED)", unaudited)
	}
	fmt.Fprintln(w)
	// A dual-stack service has a port trace per family: each says which.
	families := map[string]int{}
	for _, p := range r.Ports {
		families[p.Service+"|"+p.Port+"|"+p.Protocol]++
	}
	if c := r.Collector; c != nil {
		reader := ""
		if c.Reader != "" {
			reader = " through " + c.Reader
		}
		fmt.Fprintf(w, "collector: %s%s; last read %s, %s CPU, %s\n", readCounts(c.Reads), reader, seconds(c.LastReadSeconds),
			seconds(c.LastReadCPUSeconds), bytesOf(c.LastReadBytes))
		if c.Fallbacks > 0 {
			fmt.Fprintf(w, "collector: %d read(s) fell back to the text tool; the last because %s\n", c.Fallbacks, c.FallbackReason)
		}
	}
	for _, p := range r.Ports {
		name := p.Service
		if name == "" {
			name = "(rules no service owns)"
		} else if st, ok := r.States[p.Service]; ok {
			name += " — " + string(st)
		}
		if p.Port != "" || p.Protocol != "" {
			name += fmt.Sprintf("  port %s/%s", orDash(p.Port), p.Protocol)
		}
		if p.Family != 0 && families[p.Service+"|"+p.Port+"|"+p.Protocol] > 1 {
			name += fmt.Sprintf("  IPv%d", p.Family)
		}
		fmt.Fprintf(w, "\n%s\n", name)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, f := range p.Frontends {
			fmt.Fprintf(tw, "  %s\t%s\t%s\tvia %s\n", f.Frontend, f.Scope, mark(f.Status), orDash(f.Chain))
			for _, e := range f.Endpoints {
				fmt.Fprintf(tw, "    → %s\t\t%s\t%s\n", e.Endpoint, mark(e.Status), orDash(e.Chain))
			}
		}
		for _, s := range p.StaleFlows {
			fmt.Fprintf(tw, "    ⇢ %s\t\tSTALE FLOWS (%d)\tconntrack\n", s.Endpoint, s.Flows)
		}
		tw.Flush()
		for _, s := range p.StaleFlows {
			fmt.Fprintf(w, "    %s\n", s.Detail)
		}
	}
}

func mark(status string) string {
	if status == audit.TraceOK {
		return "ok"
	}
	return strings.ToUpper(status)
}

// readCounts is "12 reads (change 9, backstop 2, resync 1)".
func readCounts(m map[string]uint64) string {
	var total uint64
	keys := make([]string, 0, len(m))
	for k, n := range m {
		total += n
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return fmt.Sprintf("%d read(s) (%s)", total, strings.Join(parts, ", "))
}

func seconds(s float64) string {
	return (time.Duration(s * float64(time.Second))).Round(time.Millisecond).String()
}

func bytesOf(n int64) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MB read", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f kB read", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d bytes read", n)
}
