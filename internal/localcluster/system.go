package localcluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
)

// System drives proxyaudit installed on a cluster the way its users do:
// helm with this tree's chart, and the CLI as kubectl's plugin (`kubectl
// proxyaudit …`), as the admin. The real-node suites and make demo share
// it.
type System struct {
	C *Cluster
	// Bin holds the proxyaudit binaries (BuildProxyaudit).
	Bin string
	// Release and Namespace are the chart's ("proxyaudit" both when
	// empty, as the README installs it).
	Release, Namespace string
}

func (s *System) release() string {
	if s.Release == "" {
		return "proxyaudit"
	}
	return s.Release
}

func (s *System) namespace() string {
	if s.Namespace == "" {
		return "proxyaudit"
	}
	return s.Namespace
}

// Helm runs helm with args from the repository's root (charts/proxyaudit
// is there) against the cluster, with a helm home of its own, and returns
// what it printed.
func (s *System) Helm(ctx context.Context, args ...string) ([]byte, error) {
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	bin, err := chart.Helm(root)
	if err != nil {
		return nil, err
	}
	home, err := os.MkdirTemp("", "proxyaudit-helm-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(home)
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "KUBECONFIG="+s.C.AdminKubeconfig, "HELM_CACHE_HOME="+home+"/cache",
		"HELM_CONFIG_HOME="+home+"/config", "HELM_DATA_HOME="+home+"/data")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// Uninstall removes the release and the incident record remediation
// keeps on purpose (open incidents survive a reinstall): one install's
// repairs must not count against the next's budget.
func (s *System) Uninstall(ctx context.Context) error {
	if _, err := s.Helm(ctx, "uninstall", s.release(), "--namespace", s.namespace(), "--wait"); err != nil {
		return err
	}
	err := s.C.Client.CoreV1().ConfigMaps(s.namespace()).Delete(ctx, s.release()+"-aggregator-incidents", metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	return nil
}

// Kubectl is `kubectl proxyaudit args...` (the CLI as kubectl's plugin)
// with kubeconfig (the admin's when empty).
func (s *System) Kubectl(ctx context.Context, kubeconfig string, args ...string) (*exec.Cmd, error) {
	plugin := filepath.Join(s.Bin, "kubectl-proxyaudit")
	if _, err := os.Stat(plugin); err != nil {
		if err := os.Link(filepath.Join(s.Bin, "proxyaudit"), plugin); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, err
		}
	}
	if kubeconfig == "" {
		kubeconfig = s.C.AdminKubeconfig
	}
	cmd := exec.CommandContext(ctx, s.C.Kubectl(), append([]string{"proxyaudit"}, args...)...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig, "PATH="+s.Bin+":"+os.Getenv("PATH"))
	return cmd, nil
}

// Report is what `proxyaudit report -o json` prints.
type Report struct {
	Stale    any                  `json:"stale"`
	Nodes    []audit.NodeStatus   `json:"nodes"`
	Findings []audit.TimedFinding `json:"findings"`
	Summary  audit.Summary        `json:"summary"`
}

// InSync is how many nodes the report judges in sync.
func (r *Report) InSync() int {
	n := 0
	for _, s := range r.Nodes {
		if s.State == audit.NodeInSync {
			n++
		}
	}
	return n
}

// Report runs `kubectl proxyaudit report -o json` through the API
// server's proxy to the aggregator's pods, and returns it with what the
// command printed (and, when it failed, its stderr).
func (s *System) Report(ctx context.Context) (*Report, string, error) {
	cmd, err := s.Kubectl(ctx, "", "report", "-n", s.namespace(), "-o", "json")
	if err != nil {
		return nil, "", err
	}
	out, err := cmd.Output()
	var r Report
	if jerr := json.Unmarshal(out, &r); jerr != nil {
		stderr := ""
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			stderr = string(ee.Stderr)
		}
		return nil, string(out) + stderr, fmt.Errorf("report: %v (%v)", jerr, err)
	}
	return &r, string(out), nil // status 1 says findings, which r holds
}

// Wait runs the report every second until cond holds, and returns that
// report; else, after limit, what it waited for with the last report's
// findings or error.
func (s *System) Wait(ctx context.Context, limit time.Duration, what string, cond func(*Report) bool) (*Report, error) {
	deadline := time.Now().Add(limit)
	var last error
	var seen []string
	for {
		r, _, err := s.Report(ctx)
		if last = err; err == nil {
			if cond(r) {
				return r, nil
			}
			seen = seen[:0]
			for _, f := range r.Findings {
				seen = append(seen, fmt.Sprintf("%s %s %s %s %s", f.Node, f.Kind, f.Service, f.Port, f.Endpoint))
			}
		}
		if time.Now().After(deadline) {
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
	if last != nil {
		return nil, fmt.Errorf("after %s, still waiting for %s (last error: %v)", limit, what, last)
	}
	return nil, fmt.Errorf("after %s, still waiting for %s; the last report's findings:\n  %s", limit, what, strings.Join(seen, "\n  "))
}

// Pod is the pod in namespace ns matching selector on node that is not
// being deleted, or nil.
func (s *System) Pod(ctx context.Context, ns, selector, node string) (*corev1.Pod, error) {
	pods, err := s.C.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return nil, err
	}
	for i := range pods.Items {
		if pods.Items[i].DeletionTimestamp == nil {
			return &pods.Items[i], nil
		}
	}
	return nil, nil
}
