package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/url"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/internal/api"

	"github.com/proxyaudit/proxyaudit/audit"
)

const explainUsage = `One node's rules traced against the cluster, through the aggregator.

For each service port: each frontend (cluster IP, node port, load-balancer IP)
with its service chain, and each endpoint with its DNAT rule, marked ok, STALE
(in the rules, gone from the cluster) or MISSING (in the cluster, not in the
rules). A dual-stack service is traced once per IP family; a family whose
rules the node's collector could not read is NOT AUDITED. The node is named
as kubectl names it: node NAME, or node/NAME.

Exit status: 0 everything ok, 1 stale or missing rules, 2 usage error or
aggregator unreachable, 3 nothing stale or missing but a family not audited.`

var explainFormats = []string{"table"}

func (c *cli) explainCmd() *cobra.Command {
	var acc *access
	var service string
	var format *string
	cmd := &cobra.Command{
		Use:     "explain node NAME",
		Short:   "Trace one node's rules, endpoint by endpoint",
		Long:    explainUsage,
		Example: "  kubectl proxyaudit explain node worker-1\n  kubectl proxyaudit explain node/worker-1 --service kube-system/kube-dns -o json",
		Args: func(_ *cobra.Command, args []string) error {
			if _, err := explainNode(args); err != nil {
				return usageError{err}
			}
			return nil
		},
		ValidArgsFunction: func(_ *cobra.Command, args []string, prefix string) ([]string, cobra.ShellCompDirective) {
			switch len(args) {
			case 0:
				return prefixed([]string{"node"}, prefix), cobra.ShellCompDirectiveNoFileComp
			case 1:
				if args[0] == "node" {
					return acc.names(prefix, nodeList), cobra.ShellCompDirectiveNoFileComp
				}
			}
			return nil, cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(*format, explainFormats, formatJSON, formatYAML, formatJSONPath); err != nil {
				return usageError{err}
			}
			node, _ := explainNode(args)
			c.code = c.explain(cmd, acc, node, service, *format)
			return nil
		},
	}
	acc = accessFlags(cmd.Flags(), false)
	cmd.Flags().StringVar(&service, "service", "", "only this service (namespace/name)")
	format = addOutput(cmd.Flags(), explainFormats, formatJSON, formatYAML, formatJSONPath)
	acc.complete(cmd)
	return cmd
}

// explainNode is the node of explain's arguments: node NAME, or node/NAME.
func explainNode(args []string) (string, error) {
	switch {
	case len(args) == 2 && args[0] == "node" && args[1] != "":
		return args[1], nil
	case len(args) == 1 && strings.HasPrefix(args[0], "node/") && len(args[0]) > len("node/"):
		return strings.TrimPrefix(args[0], "node/"), nil
	}
	return "", fmt.Errorf("want `explain node NAME` (or node/NAME), got %q", strings.Join(args, " "))
}

// nodeList lists the cluster's nodes, for completion.
func nodeList(ctx context.Context, c kubernetes.Interface) ([]string, error) {
	l, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return namesOf(l.Items, func(n corev1.Node) string { return n.Name }), nil
}

func runExplain(args []string, stdout, stderr io.Writer) int {
	return run(append([]string{"explain"}, args...), stdout, stderr)
}

func (c *cli) explain(cmd *cobra.Command, acc *access, node, service, format string) int {
	if err := acc.single("explain"); err != nil {
		return c.fail(cmd, "%v", err)
	}
	get, cancel, err := acc.getter()
	if err != nil {
		return c.fail(cmd, "%v", err)
	}
	defer cancel()
	path := "/api/v1/nodes/" + url.PathEscape(node) + "/explain"
	if service != "" {
		path += "?service=" + url.QueryEscape(service)
	}
	b, err := get(path)
	if err != nil {
		return c.fail(cmd, "%v", err)
	}
	var resp api.ExplainResponse
	if err := json.Unmarshal(b, &resp); err != nil {
		return c.fail(cmd, "not the aggregator's answer: %v", err)
	}
	if service != "" && len(resp.Ports) == 0 {
		return c.fail(cmd, "node %s should program no port of %s (no such service, headless, or no rules by design)", node, service)
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
	if err := render(c.stdout, format, resp, nil, nil, func(w io.Writer) { explainTable(w, resp, bad, unaudited) }, nil); err != nil {
		return c.fail(cmd, "%v", err)
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
