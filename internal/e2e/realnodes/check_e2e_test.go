package realnodes

import (
	"context"
	"encoding/json"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// `kubectl proxyaudit check node/NAME` on the real kubelet nodes, with
// nothing of proxyaudit installed (issue #57): the check pod runs the
// release's image on the node, reads its rules as the collector does
// (iptables on one node, nftables on another: the node's own detection),
// and the CLI judges them against the API. A node whose kube-proxy is
// frozen while a Service is made is found missing it; the pod is gone
// afterwards every time. What keeps it from running says so: a namespace
// whose PodSecurity refuses it (and the label that allows it), an image
// the node cannot pull, a node that does not exist.
func TestE2ECheckNodeOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for name, level := range map[string]string{"check": "privileged", "check-restricted": "restricted"} {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"pod-security.kubernetes.io/enforce": level}}}
		if _, err := c.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		defer c.Client.CoreV1().Namespaces().Delete(context.Background(), name, metav1.DeleteOptions{})
	}
	check := func(args ...string) (int, *checkResult, string) {
		t.Helper()
		code, r, stderr := runCheck(ctx, t, c, args...)
		if pods, err := c.Client.CoreV1().Pods("check").List(ctx, metav1.ListOptions{}); err != nil || len(pods.Items) > 0 {
			t.Errorf("check %v left pods behind: %v %v", args, pods, err)
		}
		return code, r, stderr
	}

	for node, mode := range map[string]string{"real-ipt-a": "iptables", "real-nft-a": "nftables"} {
		code, r, stderr := check("node/"+node, "-n", "check", "-o", "json")
		if code != 0 || len(r.Findings) != 0 || !strings.HasPrefix(r.Read.Mode, mode) || r.Read.Frontends < 1 {
			t.Errorf("check node/%s in sync: exit %d, read %+v, findings %+v\n%s", node, code, r.Read, r.Findings, stderr)
		}
		t.Logf("check node/%s: %s, %d frontends, %d endpoints, the pod took %.1fs", node, r.Read.Mode, r.Read.Frontends, r.Read.Endpoints, r.Read.PodSeconds)
	}

	// A frozen kube-proxy misses a Service made meanwhile.
	b := c.Node("real-ipt-b")
	thaw, err := b.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		thaw(context.Background())
		if p := kubeProxyPod(context.Background(), t, c, b.Name); p != nil {
			c.Client.CoreV1().Pods("kube-system").Delete(context.Background(), p.Name, metav1.DeleteOptions{})
		}
		// The suite's later tests need it in sync.
		if err := b.WaitRules(context.Background(), 3*time.Minute, "the checked service", func(r string) bool { return b.RoutesTo(r, "198.18.253.1:8080") }); err != nil {
			t.Errorf("%s's kube-proxy, replaced: %v", b.Name, err)
		}
	}()
	svc, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "checked", Namespace: "check"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err == nil {
		err = c.ApplySlice(ctx, localcluster.Slice(svc, "checked-1", "http", 8080, corev1.ProtocolTCP, "198.18.253.1"))
	}
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // the healthy nodes' kube-proxies program it
	code, r, stderr := check("node", b.Name, "-n", "check", "-o", "json")
	missing := false
	for _, f := range r.Findings {
		missing = missing || f.Service == "check/checked" && (f.Kind == audit.MissingService || f.Kind == audit.MissingEndpoint)
	}
	if code != 1 || !missing {
		t.Errorf("check node/%s with its kube-proxy frozen: exit %d, findings %+v\n%s", b.Name, code, r.Findings, stderr)
	}
	if code, r, stderr := check("node/real-ipt-a", "-n", "check", "-o", "json"); code != 0 || len(r.Findings) != 0 {
		t.Errorf("check node/real-ipt-a (healthy) after the Service: exit %d, %+v\n%s", code, r.Findings, stderr)
	}

	for _, tc := range []struct {
		args []string
		says string
	}{
		{[]string{"node/real-ipt-a", "-n", "check-restricted"}, "pod-security.kubernetes.io/enforce=privileged"},
		{[]string{"node/real-ipt-a", "-n", "check", "--image", "registry.invalid/proxyaudit:none", "--timeout", "60s"}, "cannot pull registry.invalid/proxyaudit:none"},
		{[]string{"node/nope", "-n", "check"}, "node nope"},
		{[]string{"node/real-ipt-a", "-n", "no-such-namespace"}, "no namespace no-such-namespace"},
	} {
		if code, _, stderr := check(tc.args...); code != 2 || !strings.Contains(stderr, tc.says) {
			t.Errorf("check %v: exit %d, %q; want 2 saying %q", tc.args, code, stderr, tc.says)
		}
	}
}

// checkResult is what `kubectl proxyaudit check -o json` prints.
type checkResult struct {
	Findings []audit.Finding `json:"findings"`
	Read     struct {
		Mode                 string
		Frontends, Endpoints int
		PodSeconds           float64
	} `json:"read"`
}

// runCheck runs `kubectl proxyaudit check ARGS…` as the cluster's admin:
// its exit code, what it printed (read when it exited 0 or 1: in sync, or
// findings) and its stderr.
func runCheck(ctx context.Context, t *testing.T, c *localcluster.Cluster, args ...string) (int, *checkResult, string) {
	t.Helper()
	cmd := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, append([]string{"check"}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	var r checkResult
	if code < 2 {
		if err := json.Unmarshal(out, &r); err != nil {
			t.Fatalf("check %v: %v\n%s\n%s", args, err, out, stderr.String())
		}
	}
	return code, &r, stderr.String()
}
