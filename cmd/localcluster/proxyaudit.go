package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The demo shortens the grace period and the collector interval so that it
// finishes in a few minutes, and turns remediation on with room for one of
// its three nodes; production defaults are 30s, 10s and dry-run.
const (
	demoGrace    = 15 * time.Second
	demoInterval = 3 * time.Second
)

// proxyaudit is the chart installed on the demo cluster and the CLI that
// reads it, as a user runs them.
type proxyaudit struct {
	c         *localcluster.Cluster
	cli, helm string
	root      string
}

// fleetReport is what `proxyaudit report -o json` prints.
type fleetReport struct {
	Nodes    []audit.NodeStatus   `json:"nodes"`
	Findings []audit.TimedFinding `json:"findings"`
	Summary  audit.Summary        `json:"summary"`
}

func newProxyaudit(c *localcluster.Cluster) (*proxyaudit, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cli := filepath.Join(filepath.Dir(self), "proxyaudit")
	if _, err := os.Stat(cli); err != nil {
		return nil, fmt.Errorf("proxyaudit not found next to %s: run `make build`", self)
	}
	root, err := localcluster.RepoRoot()
	if err != nil {
		return nil, err
	}
	helm, err := chart.Helm(root)
	if err != nil {
		return nil, err
	}
	return &proxyaudit{c: c, cli: cli, helm: helm, root: root}, nil
}

// install runs helm install with the demo's values.
func (p *proxyaudit) install(ctx context.Context) error {
	args := []string{"install", "proxyaudit", filepath.Join(p.root, chart.Dir), "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace=" + demoGrace.String(), "--set", "collector.interval=" + demoInterval.String(),
		"--set", "remediation.mode=restart", "--set", "remediation.maxUnhealthy=50%"}
	fmt.Printf("▶ $ helm %s\n", joinArgs(args))
	cmd := exec.CommandContext(ctx, p.helm, args...)
	home, err := os.MkdirTemp("", "proxyaudit-demo-helm-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(home)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+p.c.AdminKubeconfig, "HELM_CACHE_HOME="+home+"/cache",
		"HELM_CONFIG_HOME="+home+"/config", "HELM_DATA_HOME="+home+"/data")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("helm install: %v\n%s", err, out)
	}
	start := time.Now()
	if _, err := p.c.WaitPodsReady(ctx, "proxyaudit", "app.kubernetes.io/component=collector", 3, 3*time.Minute); err != nil {
		return err
	}
	if _, err := p.c.WaitPodsReady(ctx, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute); err != nil {
		return err
	}
	fmt.Printf("  · a collector on every node and two aggregator replicas Ready %s later\n", time.Since(start).Round(time.Second))
	return nil
}

func (p *proxyaudit) report(ctx context.Context, format string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, p.cli, "report", "--kubeconfig", p.c.AdminKubeconfig, "-n", "proxyaudit", "-o", format)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if ee, ok := err.(*exec.ExitError); ok && ee.ExitCode() == 1 {
		err = nil // findings
	}
	if err != nil {
		return out, fmt.Errorf("%v: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

// wait runs `proxyaudit report` every second until cond holds.
func (p *proxyaudit) wait(ctx context.Context, d time.Duration, what string, cond func(*fleetReport) bool) error {
	deadline := time.Now().Add(d)
	var last error
	for time.Now().Before(deadline) {
		var out []byte
		if out, last = p.report(ctx, "json"); last == nil {
			var r fleetReport
			if last = json.Unmarshal(out, &r); last == nil && cond(&r) {
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

// show prints `proxyaudit report` as a user sees it.
func (p *proxyaudit) show(ctx context.Context) {
	out, err := p.report(ctx, "table")
	if err != nil {
		fmt.Println("  (report:", err, ")")
		return
	}
	os.Stdout.Write(out)
}

func joinArgs(args []string) string {
	var b bytes.Buffer
	for i, a := range args {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(a)
	}
	return b.String()
}
