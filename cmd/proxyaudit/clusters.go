package main

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/ui"
)

// ClustersReport is report's JSON output across clusters: each cluster's
// report, or why it could not be read.
type ClustersReport struct {
	At       time.Time       `json:"at"`
	Clusters []ClusterReport `json:"clusters"`
}

// ClusterReport is one cluster (a kubeconfig context) of a report across
// clusters.
type ClusterReport struct {
	Context string       `json:"context"`
	Report  *FleetReport `json:"report,omitempty"`
	Error   string       `json:"error,omitempty"`
}

// clustersReport reports every cluster named (or, with all, every
// context of the kubeconfig), each asked in parallel through its own API
// server within the timeout.
func (c *cli) clustersReport(cmd *cobra.Command, a *access, all bool, format string) int {
	contexts, err := a.clusters(all)
	if err != nil {
		return c.fail(cmd, "%v", err)
	}
	if strings.HasPrefix(format, formatName) {
		return c.fail(cmd, "-o name reads one cluster (node names repeat across clusters): use -o custom-columns=CLUSTER:.cluster,NODE:.node")
	}
	rep := fetchClusters(a, contexts)
	var rows []any
	eachFinding(rep, func(cluster, _ string, tf audit.TimedFinding) {
		rows = append(rows, struct {
			Cluster string `json:"cluster"`
			audit.TimedFinding
		}{cluster, tf})
	})
	if err := render(c.stdout, format, rep, func() []any { return rows }, nil,
		func(w io.Writer) { clustersTable(w, rep) }, func(w io.Writer) { clustersMarkdown(w, rep) }); err != nil {
		return c.fail(cmd, "%v", err)
	}
	code := exitClean
	for _, c := range rep.Clusters {
		switch {
		case c.Report == nil || c.Report.Stale != nil:
			return exitUsage
		case len(c.Report.Findings) > 0:
			code = exitFindings
		}
	}
	return code
}

// clusters are the contexts several clusters are read from: the
// --context flags, or with all every context of the kubeconfig.
func (a *access) clusters(all bool) ([]string, error) {
	if *a.url != "" {
		return nil, fmt.Errorf("--aggregator names one aggregator; several clusters are reached through their API servers (drop --aggregator)")
	}
	for _, c := range a.contexts {
		if c == "" {
			return nil, errors.New("--context: an empty context name")
		}
	}
	if !all {
		return slices.Clone(a.contexts), nil
	}
	if len(a.contexts) > 0 {
		return nil, errors.New("--all-contexts or --context, not both")
	}
	return a.allContexts()
}

// on is a copy of a that reads the cluster of context name.
func (a *access) on(name string) *access {
	one, k := *a, *a.kube
	k.contexts = []string{name}
	one.kube = &k
	return &one
}

// fetchClusters reads each context's report in parallel; a cluster that
// cannot be read carries why.
func fetchClusters(a *access, contexts []string) *ClustersReport {
	out := &ClustersReport{At: time.Now().UTC(), Clusters: make([]ClusterReport, len(contexts))}
	var wg sync.WaitGroup
	for i, name := range contexts {
		wg.Go(func() {
			out.Clusters[i].Context = name
			get, cancel, err := a.on(name).getter()
			if err != nil {
				out.Clusters[i].Error = err.Error()
				return
			}
			defer cancel()
			rep, err := fetchReport(get)
			if err != nil {
				out.Clusters[i].Error = err.Error()
				return
			}
			out.Clusters[i].Report = rep
		})
	}
	wg.Wait()
	return out
}

// clusterLine is one cluster's state in a line: its nodes, or why it
// could not be read, or that its view is stale.
func clusterLine(c ClusterReport) string {
	switch {
	case c.Report == nil:
		return "UNREADABLE: " + c.Error
	case c.Report.Stale != nil:
		return fmt.Sprintf("STALE since %s (%s): %s", c.Report.Stale.Since.UTC().Format(time.RFC3339), c.Report.Stale.Reason, countsLine(c.Report))
	}
	line := countsLine(c.Report)
	if c.Report.RemediationHold != "" {
		line += "; repairs held: " + c.Report.RemediationHold
	}
	return line
}

func clustersTable(w io.Writer, rep *ClustersReport) {
	fmt.Fprintf(w, "proxyaudit report across %d cluster(s) at %s\n", len(rep.Clusters), rep.At.Format(time.RFC3339))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLUSTER\tFINDINGS\tNODES")
	findings := eachCluster(rep, func(c ClusterReport, n string) { fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Context, n, clusterLine(c)) })
	tw.Flush()
	if findings == 0 {
		fmt.Fprintln(w, "\nNo findings in the clusters read.")
		return
	}
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "CLUSTER\tNODE\tSERVICE\tKIND\tENDPOINT\tSINCE")
	eachFinding(rep, func(cluster, node string, f audit.TimedFinding) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", cluster, orDash(node), servicePort(f), f.Kind, orDash(f.Endpoint), f.Since.UTC().Format(time.RFC3339))
	})
	tw.Flush()
}

func clustersMarkdown(w io.Writer, rep *ClustersReport) {
	fmt.Fprintf(w, "### proxyaudit report across %d cluster(s), %s\n\n", len(rep.Clusters), rep.At.Format(time.RFC3339))
	fmt.Fprintln(w, "| Cluster | Findings | Nodes |")
	fmt.Fprintln(w, "|---|---|---|")
	findings := eachCluster(rep, func(c ClusterReport, n string) {
		fmt.Fprintf(w, "| %s | %s | %s |\n", mdCell(c.Context), n, mdCell(clusterLine(c)))
	})
	if findings == 0 {
		fmt.Fprintln(w, "\nNo findings in the clusters read.")
		return
	}
	fmt.Fprintln(w, "\n| Cluster | Node | Service | Kind | Endpoint | Since | Detail |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|")
	eachFinding(rep, func(cluster, node string, f audit.TimedFinding) {
		fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s |\n", mdCell(cluster), orDash(mdCell(node)), mdCell(servicePort(f)), mdCell(string(f.Kind)),
			orDash(mdCell(f.Endpoint)), f.Since.UTC().Format(time.RFC3339), mdCell(f.Detail))
	})
}

// eachCluster calls f with each cluster and its count of findings ("-"
// when it could not be read), and returns the findings of all.
func eachCluster(rep *ClustersReport, f func(c ClusterReport, findings string)) int {
	total := 0
	for _, c := range rep.Clusters {
		n := "-"
		if c.Report != nil {
			n = fmt.Sprint(len(c.Report.Findings))
			total += len(c.Report.Findings)
		}
		f(c, n)
	}
	return total
}

// eachFinding calls f with every finding of the clusters read, cluster by
// cluster, node by node.
func eachFinding(rep *ClustersReport, f func(cluster, node string, tf audit.TimedFinding)) {
	for _, c := range rep.Clusters {
		if c.Report == nil {
			continue
		}
		nodes, m := byNode(c.Report)
		for _, n := range nodes {
			for _, tf := range m[n] {
				f(c.Context, n, tf)
			}
		}
	}
}

// servicePort is a finding's service, port and family, or "-".
func servicePort(f audit.TimedFinding) string {
	if f.Service == "" {
		return "-"
	}
	return svcPortFamily(f.Finding)
}

// clustersUI serves several clusters' status: the page of them all at
// /clusters/, and each cluster's own pages at /ui/ of an origin of its own,
// SLUG.localhost on the same port (browsers resolve every .localhost name
// to this machine), through that cluster's API server as `proxyaudit ui`
// reaches one. One origin for every cluster let a page served for one run
// script that fetched another's pages, with that cluster's reader token
// and the user's credentials (trust review 4, item 5); across origins the
// browser says where a request comes from, and hostGuard refuses it.
func (a *access) clustersUI(contexts []string, stderr io.Writer) http.Handler {
	overview := http.NewServeMux()
	slugs := clusterSlugs(contexts)
	byHost := map[string]http.Handler{}
	for i, name := range contexts {
		h, err := a.on(name).uiProxy(stderr)
		if err != nil {
			msg := fmt.Sprintf("proxyaudit ui: cluster %s: %v", name, err)
			h = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { http.Error(w, msg, http.StatusBadGateway) })
		}
		byHost[slugs[i]+".localhost"] = h
	}
	overview.Handle("GET /clusters/static/", ui.StaticAt("/clusters/"))
	overview.HandleFunc("GET /clusters/{$}", func(w http.ResponseWriter, r *http.Request) {
		_, port, _ := net.SplitHostPort(r.Host)
		link := func(slug string) string { return "http://" + net.JoinHostPort(slug+".localhost", port) + "/ui/" }
		ui.Serve(w, "clusters", clustersPage(fetchClusters(a, contexts), slugs, link))
	})
	overview.Handle("GET /{$}", http.RedirectHandler("/clusters/", http.StatusFound))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := byHost[strings.ToLower(hostOnly(r.Host))]; h != nil {
			h.ServeHTTP(w, r)
			return
		}
		overview.ServeHTTP(w, r)
	})
}

// clustersPage is the page of a report across clusters; link names each
// cluster's pages by its slug.
func clustersPage(rep *ClustersReport, slugs []string, link func(slug string) string) ui.ClustersPage {
	p := ui.ClustersPage{Base: ui.Base{Title: "clusters", Root: "./", At: rep.At, Now: time.Now()}}
	for i, c := range rep.Clusters {
		link := link(slugs[i])
		if c.Report == nil {
			p.Clusters = append(p.Clusters, ui.ClusterRow{Name: c.Context, Link: link, Error: c.Error})
			p.Unreadable++
			continue
		}
		row := ui.Cluster(c.Context, link, c.Report.At, c.Report.Nodes, c.Report.Findings)
		row.Hold = c.Report.RemediationHold
		if st := c.Report.Stale; st != nil {
			row.Stale = fmt.Sprintf("since %s: %s", st.Since.UTC().Format(time.RFC3339), st.Reason)
		}
		p.Clusters = append(p.Clusters, row)
	}
	return p
}

// clusterSlugs names each context in a URL path: lower case, every run
// of other characters than letters, digits, dots and dashes one dash
// (EKS contexts are ARNs, arn:aws:eks:…:cluster/name), made unique.
func clusterSlugs(contexts []string) []string {
	out := make([]string, len(contexts))
	used := map[string]bool{}
	for i, name := range contexts {
		var b strings.Builder
		dash := false
		for _, r := range strings.ToLower(name) {
			if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '.' || r == '-' {
				b.WriteRune(r)
				dash = false
			} else if !dash {
				b.WriteByte('-')
				dash = true
			}
		}
		slug := strings.Trim(b.String(), "-.")
		if slug == "" {
			slug = "cluster"
		}
		for n := 2; used[slug]; n++ {
			slug = fmt.Sprintf("%s-%d", strings.TrimSuffix(slug, fmt.Sprintf("-%d", n-1)), n)
		}
		used[slug] = true
		out[i] = slug
	}
	return out
}
