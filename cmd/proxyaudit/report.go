package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	neturl "net/url"
	"os"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/proxyaudit/proxyaudit/internal/api"

	authnv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
)

const reportUsage = `The fleet at a glance, from the aggregator: each node's state and every finding.

Without --aggregator it goes the way kubectl does: the kubeconfig's current
context (or --context), with kubectl's connection flags, through the API
server's proxy to the aggregator's Service (--aggregator-service,
--aggregator-service-port) in the namespace: -n, else the context's, else
proxyaudit. The API server's proxy drops your credentials, so report first
mints a 10-minute token for the reader ServiceAccount (--reader-service-account)
and shows it to the aggregator, which serves findings only to callers allowed
to use that proxy (the chart's report-reader Role allows both). With
--aggregator, pass such a token with --token-file.

Several --context flags (or --all-contexts) report several clusters side by
side: each is asked in parallel through its own API server, within --timeout
each, and shown with a CLUSTER column; a cluster that cannot be reached or
refuses is named with the reason and never hides the others.

-o json and -o yaml print the report's document; -o jsonpath=TEMPLATE a part
of it; -o custom-columns=HEADER:.path,... and -o name one line per finding
(node/NAME per node with findings); -o wide adds each finding's detail.

Exit status: 0 no findings, 1 findings, 2 usage error, aggregator unreachable,
or the aggregator's view of the API stale (the findings shown are the last
known, not current). Across clusters: 2 when any cluster could not be read or
is stale, else 1 when any has findings.`

// FleetReport is report's JSON output.
type FleetReport struct {
	At    time.Time      `json:"at"`
	Stale *api.StaleView `json:"stale,omitempty"`
	// RecoveringUntil: node drift is held back until then (the aggregator's
	// view just came back from an API outage; kube-proxies reconnect).
	RecoveringUntil *time.Time `json:"recoveringUntil,omitempty"`
	// RemediationHold: why every repair is held (a pause, outside the
	// maintenance windows); pages go on.
	RemediationHold string                  `json:"remediationHold,omitempty"`
	Counts          map[audit.NodeState]int `json:"nodesByState"`
	Lag             FleetLag                `json:"programmingLag"`
	Nodes           []audit.NodeStatus      `json:"nodes"`
	Findings        []audit.TimedFinding    `json:"findings"`
	Summary         audit.Summary           `json:"summary"`
}

// FleetLag summarises the nodes' programming latency: the median of the
// nodes' p50 and the worst p99 and max.
type FleetLag struct {
	MedianP50 float64 `json:"medianP50Seconds"`
	WorstP99  float64 `json:"worstP99Seconds"`
	Max       float64 `json:"maxSeconds"`
	Nodes     int     `json:"nodesWithSamples"`
}

// reportFormats are report's own formats (-o), the default first.
var reportFormats = []string{"table", "wide", "markdown"}

func (c *cli) reportCmd() *cobra.Command {
	var a *access
	var format *string
	var all bool
	cmd := &cobra.Command{
		Use:   "report",
		Short: "The fleet at a glance, from the aggregator: each node's state and every finding",
		Long:  reportUsage,
		Example: `  kubectl proxyaudit report
  kubectl proxyaudit report -o json
  kubectl proxyaudit report -o custom-columns=NODE:.node,KIND:.kind,SERVICE:.service,ENDPOINT:.endpoint
  kubectl proxyaudit report --context prod-eu --context prod-us`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(*format, reportFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns); err != nil {
				return usageError{err}
			}
			c.code = c.report(cmd, a, *format, all)
			return nil
		},
	}
	a = accessFlags(cmd.Flags(), true)
	format = addOutput(cmd.Flags(), reportFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns)
	cmd.Flags().BoolVar(&all, "all-contexts", false, "every context of the kubeconfig, one cluster each, side by side (see --context)")
	a.complete(cmd)
	return cmd
}

func runReport(args []string, stdout, stderr io.Writer) int {
	return run(append([]string{"report"}, args...), stdout, stderr)
}

func (c *cli) report(cmd *cobra.Command, a *access, format string, all bool) int {
	if all || len(a.contexts) > 1 {
		return c.clustersReport(cmd, a, all, format)
	}
	if err := a.single("report"); err != nil {
		return c.fail(cmd, "%v", err)
	}
	get, cancel, err := a.getter()
	if err != nil {
		return c.fail(cmd, "%v", err)
	}
	defer cancel()
	rep, err := fetchReport(get)
	if err != nil {
		return c.fail(cmd, "%v", err)
	}
	if err := render(c.stdout, format, rep, func() []any { return rowsOf(rep.Findings) }, func() []string { return nodeNames(rep.Findings, func(f audit.TimedFinding) string { return f.Node }) },
		func(w io.Writer) { reportTable(w, rep, format == "wide") }, func(w io.Writer) { reportMarkdown(w, rep) }); err != nil {
		return c.fail(cmd, "%v", err)
	}
	switch {
	case rep.Stale != nil:
		return exitUsage
	case len(rep.Findings) > 0:
		return exitFindings
	}
	return exitClean
}

// nodeNames are the nodes of findings as -o name prints them
// (node/NAME), each once.
func nodeNames[F any](fs []F, node func(F) string) []string {
	var out []string
	for _, f := range fs {
		if n := "node/" + node(f); node(f) != "" && !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	return out
}

// render writes v in format: a shared one (json, yaml, name, jsonpath,
// custom-columns over rows), or the command's table or markdown (each
// shown inert: see shown).
func render(stdout io.Writer, format string, v any, rows func() []any, names func() []string, table, markdown func(io.Writer)) error {
	if done, err := printShared(stdout, format, v, rows, names); done {
		return err
	}
	if format == "markdown" {
		shown(stdout, markdown)
	} else {
		shown(stdout, table)
	}
	return nil
}

// banner warns that the report is not current: the aggregator's view is
// stale, or it is holding node drift back after an API outage; "" when
// neither.
func banner(rep *FleetReport) string {
	held := ""
	if rep.RemediationHold != "" {
		held = "REPAIRS HELD (pages only): " + rep.RemediationHold + ".\n"
	}
	if rep.Stale == nil {
		if rep.RecoveringUntil != nil {
			return held + fmt.Sprintf("RECOVERING: the aggregator's view came back from an API outage; node drift is held back until %s while kube-proxies reconnect.\n",
				rep.RecoveringUntil.UTC().Format(time.RFC3339))
		}
		return held
	}
	return fmt.Sprintf("STALE: the aggregator cannot see the API since %s (%s). What follows was judged before then; nothing is being repaired. Check the aggregator's log (\"view of the API is stale\") and its connection to the API server.\n",
		rep.Stale.Since.UTC().Format(time.RFC3339), rep.Stale.Reason)
}

// access is how the CLI reaches the aggregator's API: through the API
// server (kube), or at --aggregator.
type access struct {
	*kube
	url, service, port          *string
	reader, audience, tokenFile *string
	timeout                     *time.Duration
}

func accessFlags(fs *pflag.FlagSet, multi bool) *access {
	return &access{
		kube:      addKubeFlags(fs, multi),
		url:       fs.String("aggregator", "", "aggregator HTTP base URL (e.g. http://localhost:8080 after kubectl port-forward); empty goes through the API server"),
		service:   fs.String("aggregator-service", "proxyaudit-aggregator", "the aggregator's Service"),
		port:      fs.String("aggregator-service-port", "http", "the Service port (name or number) of the aggregator's HTTP API"),
		timeout:   fs.Duration("timeout", 15*time.Second, "how long to wait for the aggregator"),
		reader:    fs.String("reader-service-account", "proxyaudit-reader", "through the API server: mint a 10-minute token for this ServiceAccount to show the aggregator (the chart's report-reader Role allows it); empty: send none"),
		audience:  fs.String("reader-audience", api.DefaultReaderAudience, "audience of that token (the aggregator's --http-reader-audience)"),
		tokenFile: fs.String("token-file", "", "with --aggregator: file holding a token to send as Authorization: Bearer (audience --reader-audience)"),
	}
}

// getter returns a function that GETs an API path, and its cancel.
func (a *access) getter() (func(string) ([]byte, error), func(), error) {
	ctx, cancel := context.WithTimeout(context.Background(), *a.timeout)
	if *a.url != "" {
		base := strings.TrimSuffix(*a.url, "/")
		var token string
		if *a.tokenFile != "" {
			b, err := os.ReadFile(*a.tokenFile)
			if err != nil {
				cancel()
				return nil, nil, fmt.Errorf("--token-file: %v", err)
			}
			token = strings.TrimSpace(string(b))
		}
		return func(path string) ([]byte, error) { return httpGet(ctx, base+path, token) }, cancel, nil
	}
	client, _, ns, err := a.client(a.context())
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("%v (or pass --aggregator URL)", err)
	}
	// The API server's proxy drops the caller's credentials; an aggregator
	// that serves findings only to readers (--http-readers) checks this
	// short-lived token instead. Not being allowed to mint one is not an
	// error here: an aggregator without --http-readers needs none, and one
	// with it says what is missing.
	var token, noToken string
	if *a.reader != "" {
		exp := int64(600)
		tr, err := client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, *a.reader, &authnv1.TokenRequest{
			Spec: authnv1.TokenRequestSpec{Audiences: []string{*a.audience}, ExpirationSeconds: &exp}}, metav1.CreateOptions{})
		if err != nil {
			noToken = fmt.Sprintf("; no reader token was sent: minting one for ServiceAccount %s/%s failed: %v", ns, *a.reader, err)
		} else {
			token = tr.Status.Token
		}
	}
	return func(path string) ([]byte, error) {
		p, query, _ := strings.Cut(path, "?")
		for attempt := 1; ; attempt++ {
			req := client.CoreV1().RESTClient().Get().Namespace(ns).Resource("services").
				Name("http:" + *a.service + ":" + *a.port).SubResource("proxy").Suffix(p)
			if v, err := neturl.ParseQuery(query); err == nil {
				for k := range v {
					req = req.Param(k, v.Get(k))
				}
			}
			if token != "" {
				req = req.SetHeader(api.TokenHeader, token)
			}
			b, err := req.DoRaw(ctx)
			if err == nil {
				return b, nil
			}
			if attempt < unavailableTries && aggregatorUnavailable(err, b) {
				// A replica that has not seen the leader yet (just
				// started), or a leader whose first verdict is not ready:
				// the Service may pick another replica, or this one will
				// know in a moment.
				select {
				case <-ctx.Done():
				case <-time.After(unavailableWait):
					continue
				}
			}
			return nil, proxyError(err, b, ns, *a.service, *a.port, noToken)
		}
	}, cancel, nil
}

// unavailableTries and unavailableWait bound how long a request through
// the service proxy waits out aggregators that answer 503 (no leader
// known yet, or no verdict yet): about the leader election's retry period
// twice over.
const (
	unavailableTries = 5
	unavailableWait  = time.Second
)

// aggregatorUnavailable says whether the aggregator itself (not the API
// server) answered 503 with its reason.
func aggregatorUnavailable(err error, body []byte) bool {
	var agg struct {
		Error string `json:"error"`
	}
	return apierrors.IsServiceUnavailable(err) && json.Unmarshal(body, &agg) == nil && agg.Error != ""
}

// proxyError says who refused a request through the service proxy: client-go
// words a 401 passed through from the aggregator as if the kubeconfig's
// credentials were wrong, while the body is the aggregator's own reason.
func proxyError(err error, body []byte, namespace, service, port, noToken string) error {
	if errors.Is(err, errRedirect) {
		return fmt.Errorf("through the API server's proxy to service %s/%s port %s: %w", namespace, service, port, err)
	}
	var agg struct {
		Error string `json:"error"`
	}
	if json.Unmarshal(body, &agg) == nil && agg.Error != "" {
		return fmt.Errorf("the aggregator behind service %s/%s refused: %s%s", namespace, service, agg.Error, noToken)
	}
	var ue *neturl.Error
	switch {
	case errors.As(err, &ue):
		return fmt.Errorf("cannot reach the API server: %v (check the kubeconfig context's server and your network)", ue.Err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("the API server refused your credentials (401 Unauthorized): log in to this cluster again (kubectl get nodes says the same)")
	case apierrors.IsForbidden(err):
		return fmt.Errorf("the API server does not let you use service %s/%s's proxy (403 Forbidden): bind the chart's report-reader Role to you%s", namespace, service, noToken)
	}
	return fmt.Errorf("through the API server's proxy to service %s/%s port %s: %w%s (is proxyaudit installed there? -n selects the namespace)", namespace, service, port, err, noToken)
}

func httpGet(ctx context.Context, url, token string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := directClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return body, nil
}

// fetchReport reads the findings and the nodes and summarises the fleet.
func fetchReport(get func(string) ([]byte, error)) (*FleetReport, error) {
	var fr api.FindingsResponse
	var nr api.NodesResponse
	for path, v := range map[string]any{"/api/v1/findings": &fr, "/api/v1/nodes": &nr} {
		b, err := get(path)
		if err != nil {
			return nil, err
		}
		if err := json.Unmarshal(b, v); err != nil {
			return nil, fmt.Errorf("%s: not the aggregator's answer: %v", path, err)
		}
	}
	rep := &FleetReport{At: nr.At, Stale: fr.Stale, RecoveringUntil: fr.RecoveringUntil, RemediationHold: fr.RemediationHold, Counts: map[audit.NodeState]int{}, Nodes: nr.Nodes, Findings: fr.Findings}
	if rep.Findings == nil {
		rep.Findings = []audit.TimedFinding{}
	}
	var p50s []float64
	var names []string
	for _, n := range nr.Nodes {
		rep.Counts[n.State]++
		names = append(names, n.Node)
		if n.Lag.Samples > 0 {
			p50s = append(p50s, n.Lag.P50)
			rep.Lag.WorstP99 = max(rep.Lag.WorstP99, n.Lag.P99)
			rep.Lag.Max = max(rep.Lag.Max, n.Lag.Max)
		}
	}
	if len(p50s) > 0 {
		slices.Sort(p50s)
		rep.Lag.MedianP50, rep.Lag.Nodes = p50s[len(p50s)/2], len(p50s)
	}
	plain := make([]audit.Finding, len(rep.Findings))
	for i, f := range rep.Findings {
		plain[i] = f.Finding
	}
	rep.Summary = audit.Summarize(names, plain)
	return rep, nil
}

var stateOrder = []struct {
	state audit.NodeState
	word  string
}{
	{audit.NodeInSync, "in sync"}, {audit.NodeLagging, "lagging (within grace)"}, {audit.NodeStuck, "stuck"},
	{audit.NodeDivergent, "divergent"}, {audit.NodeNoRules, "without rules"}, {audit.NodeMissing, "silent (collector missing)"},
	{audit.NodePending, "pending"},
}

func countsLine(rep *FleetReport) string {
	parts := []string{}
	for _, s := range stateOrder {
		if c := rep.Counts[s.state]; c > 0 || s.state == audit.NodeInSync {
			parts = append(parts, fmt.Sprintf("%d %s", c, s.word))
		}
	}
	return fmt.Sprintf("%d node(s): %s", len(rep.Nodes), strings.Join(parts, ", "))
}

func lagLine(rep *FleetReport) string {
	if rep.Lag.Nodes == 0 {
		return "programming lag: no samples yet"
	}
	return fmt.Sprintf("programming lag over %d node(s): median p50 %.1fs, worst p99 %.1fs, max %.1fs (upper bounds at the collector interval)",
		rep.Lag.Nodes, rep.Lag.MedianP50, rep.Lag.WorstP99, rep.Lag.Max)
}

// byNode groups findings by node (the API sorts node-level kinds first).
func byNode(rep *FleetReport) ([]string, map[string][]audit.TimedFinding) {
	m := map[string][]audit.TimedFinding{}
	for _, f := range rep.Findings {
		m[f.Node] = append(m[f.Node], f)
	}
	var nodes []string
	for n := range m {
		nodes = append(nodes, n)
	}
	sort.Strings(nodes)
	return nodes, m
}

func reportTable(w io.Writer, rep *FleetReport, wide bool) {
	fmt.Fprint(w, banner(rep))
	fmt.Fprintf(w, "proxyaudit report at %s\n%s\n%s\n", rep.At.UTC().Format(time.RFC3339), countsLine(rep), lagLine(rep))
	for _, l := range warnings(rep) {
		fmt.Fprintf(w, "WARNING %s\n", l)
	}
	if len(rep.Findings) == 0 {
		fmt.Fprintln(w, "\nNo findings: every reporting node's kube-proxy rules match the cluster.")
		return
	}
	state := map[string]audit.NodeState{}
	for _, n := range rep.Nodes {
		state[n.Node] = n.State
	}
	nodes, m := byNode(rep)
	for _, n := range nodes {
		fs := m[n]
		title := n
		if n == "" {
			title = "fleet"
		}
		fmt.Fprintf(w, "\n%s (%s): %d finding(s)\n", title, orDash(string(state[n])), len(fs))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		if wide {
			fmt.Fprintln(tw, "  SERVICE\tKIND\tENDPOINT\tSINCE\tFOUND\tDETAIL")
		} else {
			fmt.Fprintln(tw, "  SERVICE\tKIND\tENDPOINT\tSINCE")
		}
		var details []string
		prev := ""
		for _, f := range fs {
			sp := "-"
			if f.Service != "" {
				sp = svcPortFamily(f.Finding)
			}
			shown := sp
			if sp == prev && sp != "-" {
				shown = `  "`
			}
			prev = sp
			if wide {
				found := "-"
				if !f.Found.IsZero() {
					found = f.Found.UTC().Format(time.RFC3339)
				}
				fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\n", shown, f.Kind, orDash(f.Endpoint), f.Since.UTC().Format(time.RFC3339), found, orDash(f.Detail))
				continue
			}
			fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\n", shown, f.Kind, orDash(f.Endpoint), f.Since.UTC().Format(time.RFC3339))
			if f.Service == "" || f.Kind == audit.StaleConntrack {
				// Node-level findings, and stale flows (how many, which
				// clients): what the table's columns cannot say.
				details = append(details, fmt.Sprintf("  %s: %s", f.Kind, f.Detail))
			}
		}
		tw.Flush()
		for _, d := range details {
			fmt.Fprintln(w, d)
		}
	}
}

func reportMarkdown(w io.Writer, rep *FleetReport) {
	if l := banner(rep); l != "" {
		// The pause's reason is someone's words: inert here.
		for _, line := range strings.Split(strings.TrimSpace(l), "\n") {
			fmt.Fprintf(w, "> **%s**\n", mdCell(line))
		}
	}
	fmt.Fprintf(w, "### proxyaudit report, %s\n\n%s  \n%s\n\n", rep.At.UTC().Format(time.RFC3339), countsLine(rep), lagLine(rep))
	ws := warnings(rep)
	for _, l := range ws {
		fmt.Fprintf(w, "- **Warning** %s\n", mdCell(l))
	}
	if len(ws) > 0 {
		fmt.Fprintln(w) // a list item would swallow the table
	}
	if len(rep.Findings) == 0 {
		fmt.Fprintln(w, "No findings: every reporting node's kube-proxy rules match the cluster.")
		return
	}
	fmt.Fprintln(w, "| Node | Service | Kind | Endpoint | Since | Detail |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|")
	nodes, m := byNode(rep)
	for _, n := range nodes {
		for _, f := range m[n] {
			sp := "-"
			if f.Service != "" {
				sp = svcPortFamily(f.Finding)
			}
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s |\n", orDash(mdCell(f.Node)), mdCell(sp), mdCell(string(f.Kind)), orDash(mdCell(f.Endpoint)),
				f.Since.UTC().Format(time.RFC3339), mdCell(f.Detail))
		}
	}
}

// warnings lists the nodes' warnings (facts that are not findings, such
// as a kube-proxy release known to misbehave), one line each.
func warnings(rep *FleetReport) []string {
	var out []string
	for _, n := range rep.Nodes {
		for _, w := range n.Warnings {
			out = append(out, n.Node+": "+w)
		}
	}
	return out
}
