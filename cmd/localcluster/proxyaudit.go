package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The demo shortens the grace period and the collector interval so that it
// finishes in about a minute; production defaults are 30s and 10s.
const (
	demoGrace    = 15 * time.Second
	demoInterval = 3 * time.Second
)

// replicas: two aggregators with addresses of their own, as pods have.
var replicaIPs = []string{"198.18.1.1", "198.18.1.2"}

type aggClient struct {
	url string
}

// startProxyaudit runs two aggregator replicas on the host (leader
// election on a Lease) and a collector in every node's namespace with a
// ServiceAccount token bound to a pod on that node, the binaries next to
// this one (make build puts them in bin/).
func startProxyaudit(ctx context.Context, c *localcluster.Cluster) (*aggClient, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	bin := filepath.Dir(self)
	for _, b := range []string{"proxyaudit-aggregator", "proxyaudit-collector"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			return nil, fmt.Errorf("%s not found next to %s: run `make build`", b, self)
		}
	}
	fmt.Printf("▶ starting proxyaudit: 2 aggregator replicas (%s), a collector per node (grace %s, interval %s for the demo)\n",
		strings.Join(replicaIPs, ", "), demoGrace, demoInterval)
	var streams []string
	for _, ip := range replicaIPs {
		if err := c.AddHostAddress(ctx, ip); err != nil {
			return nil, err
		}
		if _, err := c.StartProcess("aggregator-"+ip, filepath.Join(bin, "proxyaudit-aggregator"),
			"--kubeconfig="+c.AdminKubeconfig, "--stream-listen="+ip+":9443", "--http-listen="+ip+":8080",
			"--advertise-address="+ip, "--grace="+demoGrace.String(), "--leader-elect-namespace=proxyaudit",
			"--collector-service-accounts=proxyaudit/proxyaudit-collector"); err != nil {
			return nil, err
		}
		streams = append(streams, ip+":9443")
	}
	for _, n := range c.Nodes() {
		tok, err := c.PodToken(ctx, "proxyaudit", "proxyaudit-collector", n.Name, "proxyaudit")
		if err != nil {
			return nil, err
		}
		tokFile := filepath.Join(c.Dir, n.Name+".token")
		if err := os.WriteFile(tokFile, []byte(tok), 0o600); err != nil {
			return nil, err
		}
		if _, err := n.StartProcess("collector-"+n.Name, filepath.Join(bin, "proxyaudit-collector"),
			"--node-name="+n.Name, "--aggregator="+strings.Join(streams, ","),
			"--interval="+demoInterval.String(), "--token-file="+tokFile); err != nil {
			return nil, err
		}
	}
	return &aggClient{url: "http://" + replicaIPs[0] + ":8080"}, nil
}

// wait polls the API (a follower proxies to the leader) until cond holds.
func (a *aggClient) wait(ctx context.Context, d time.Duration, what string, cond func([]audit.TimedFinding, []audit.NodeStatus) bool) error {
	deadline := time.Now().Add(d)
	var last error
	for time.Now().Before(deadline) {
		var fr api.FindingsResponse
		var nr api.NodesResponse
		if last = a.get("/api/v1/findings", &fr); last == nil {
			if last = a.get("/api/v1/nodes", &nr); last == nil && cond(fr.Findings, nr.Nodes) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
	return fmt.Errorf("after %s, still waiting for %s (last error: %v)", d, what, last)
}

func (a *aggClient) get(path string, v any) error {
	r, err := http.Get(a.url + path)
	if err != nil {
		return err
	}
	defer r.Body.Close()
	if r.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, r.Status)
	}
	return json.NewDecoder(r.Body).Decode(v)
}

func printFindings(fs []audit.TimedFinding) {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "  NODE\tKIND\tSERVICE\tPORT\tENDPOINT\tSINCE")
	var details []string
	for _, f := range fs {
		fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%s\t%s\n", f.Node, f.Kind, f.Service, f.Port, f.Endpoint, f.Since.Local().Format("15:04:05"))
		if f.Kind == audit.StuckProxy || f.Kind == audit.NoRules || f.Kind == audit.MassDivergence {
			details = append(details, fmt.Sprintf("  %s %s: %s", f.Node, f.Kind, f.Detail))
		}
	}
	w.Flush()
	if len(details) > 0 {
		fmt.Println()
		fmt.Println(strings.Join(details, "\n"))
	}
}
