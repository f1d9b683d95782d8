package live

import (
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

// CiliumEnv runs TestE2ECiliumNode: it builds the genuine Cilium agent
// (~6 min cold) and needs clang-19, so `make e2e-cilium` (part of `make
// e2e-long`) runs it, not `make test`, whose CI budget the build does not
// fit.
const CiliumEnv = "PROXYAUDIT_CILIUM"

// The genuine Cilium agent (kube-proxy replacement) on a node of the live
// system, beside the genuine kube-proxies, audited by the real collector
// (cilium mode, detected) and aggregator from the chart with
// cilium.enabled and remediation on:
//   - in sync after install, with every churn service;
//   - frozen (SIGSTOP, the hung agent of cilium#48050), while the cluster
//     moves one churn service's endpoints, drops one of a Local node
//     port's and adds a service: the Cilium node alone is found stale (its
//     maps keep the endpoints that left, the node port's in the internal
//     scope its own pods use) and missing the new service, and said to be
//     Cilium's;
//   - remediation deletes that node's Cilium agent pod — a stand-in Pod
//     object: a namespace-only node has no kubelet, so the test plays the
//     DaemonSet and restarts the agent when its pod is deleted — and the
//     node heals.
func TestE2ECiliumNode(t *testing.T) {
	if os.Getenv(CiliumEnv) != "1" {
		t.Skipf("needs the genuine Cilium agent (built from its module, ~6 min cold, and Debian's clang-19): make e2e-cilium runs it (%s=1)", CiliumEnv)
	}
	localcluster.NeedRoot(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c := localcluster.Shared(t)
	spec := localcluster.NodeSpec{Name: "agg-cil", Mode: localcluster.ModeCilium, Zone: "zone-b"}
	n := c.Node(spec.Name)
	if n == nil {
		var err error
		start := time.Now()
		if n, err = c.AddNode(ctx, spec); err != nil {
			t.Fatal(err)
		}
		t.Logf("Cilium agent on %s programmed default/kubernetes %s after start", n.Name, time.Since(start).Round(time.Second))
	}
	// The agent's pod, as the cilium DaemonSet would run it.
	if _, err := c.Client.CoreV1().ServiceAccounts("kube-system").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "cilium-" + n.Name, Labels: map[string]string{"k8s-app": "cilium"}},
		Spec: corev1.PodSpec{NodeName: n.Name, Containers: []corev1.Container{{Name: "cilium-agent", Image: "quay.io/cilium/cilium:v1.20.2"}}}}
	if _, err := c.Client.CoreV1().Pods("kube-system").Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	restarted, proceed := make(chan error, 1), make(chan struct{})
	var once sync.Once
	go daemonSetStandIn(ctx, t, c, n, pod, proceed, func(err error) { once.Do(func() { restarted <- err }) })

	// A node port with externalTrafficPolicy Local whose endpoints are on
	// other nodes: on the Cilium node its external scope drops, its
	// internal scope (the node's own pods) holds every endpoint.
	local, err := c.Client.CoreV1().Services(churnNS).Get(ctx, "cil-local", metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		local, err = c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: churnNS, Name: "cil-local"},
			Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort, ExternalTrafficPolicy: corev1.ServiceExternalTrafficPolicyLocal,
				Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	}
	if err != nil {
		t.Fatal(err)
	}
	localSlice := func(ips ...string) error {
		sl := localcluster.Slice(local, "cil-local-1", "http", 8080, corev1.ProtocolTCP, ips...)
		node := "agg-ipt"
		for i := range sl.Endpoints {
			sl.Endpoints[i].NodeName = &node
		}
		return c.ApplySlice(ctx, sl)
	}
	if err := localSlice("198.18.139.20", "198.18.139.21"); err != nil {
		t.Fatal(err)
	}
	l := newLiveOn(ctx, t, c, append(append([]localcluster.NodeSpec(nil), liveNodes...), spec), replicaIPs,
		"cilium.enabled=true", "remediation.mode=restart", "remediation.recheck=2m", "remediation.maxUnhealthy=100%")
	if st := l.nodes()[n.Name]; st.Mode != audit.ModeCilium {
		t.Fatalf("%s audited in mode %q; want cilium (detected: no kube-proxy, the agent's maps pinned)", n.Name, st.Mode)
	}

	// Hung: the agent keeps its maps and follows nothing.
	if err := n.FreezeProxy(); err != nil {
		t.Fatal(err)
	}
	frozenAt := time.Now()
	l.epoch++
	if err := l.setEndpoints(ctx, 0, l.epoch); err != nil {
		t.Fatal(err)
	}
	if err := localSlice("198.18.139.20"); err != nil {
		t.Fatal(err)
	}
	late, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: churnNS, Name: "cil-late"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ApplySlice(ctx, localcluster.Slice(late, "cil-late-1", "http", 8080, corev1.ProtocolTCP, "198.18.139.9")); err != nil {
		t.Fatal(err)
	}
	var seen []audit.TimedFinding
	took := l.waitFor("the frozen Cilium node stale and missing the new service, and no other node", 3*time.Minute, func(fs []audit.TimedFinding) bool {
		for _, f := range fs {
			if f.Node != n.Name {
				t.Fatalf("a finding on another node: %s", findings.Describe([]audit.TimedFinding{f}))
			}
		}
		stale, missing, internal := false, false, false
		for _, f := range fs {
			stale = stale || (f.Kind == audit.StaleEndpoint && f.Service == churnNS+"/churn-00")
			missing = missing || (f.Kind == audit.MissingService && f.Service == churnNS+"/cil-late")
			internal = internal || (f.Kind == audit.StaleEndpoint && f.Service == churnNS+"/cil-local" && f.Endpoint == "198.18.139.21:8080" &&
				strings.Contains(f.Detail, "(internal scope)"))
		}
		if stale && missing && internal {
			seen = fs
			return true
		}
		return false
	})
	t.Logf("frozen agent found %s after the changes (grace %s):\n%s", took.Round(time.Second), grace, findings.Describe(seen))
	for _, f := range seen {
		if f.Kind == audit.StuckProxy && (!strings.Contains(f.Detail, "Cilium") || strings.Contains(f.Detail, "kube-proxy")) {
			t.Errorf("StuckProxy on a Cilium node does not say Cilium, or speaks of kube-proxy: %s", f.Detail)
		}
	}

	// An SRE's trace of the frozen node, through the API server, before
	// the restart goes ahead: each endpoint that left still in the maps,
	// each new one missing, named by Cilium's service entry.
	if out, code := l.cli(t, "explain", "node", n.Name, "--service", churnNS+"/churn-00"); code != 1 ||
		strings.Count(out, "STALE") != 3 || strings.Count(out, "MISSING") != 3 || !strings.Contains(out, "cilium_lb4 service") {
		t.Errorf("proxyaudit explain of the frozen Cilium node: exit %d\n%s", code, out)
	} else {
		t.Logf("proxyaudit explain node %s --service %s/churn-00:\n%s", n.Name, churnNS, out)
	}
	close(proceed)

	// Remediation: the node's agent pod deleted (the restart), and healed.
	select {
	case err := <-restarted:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(3 * time.Minute):
		t.Fatalf("no restart of the Cilium agent %s after it froze\n%s", time.Since(frozenAt).Round(time.Second), l.logs())
	}
	l.waitAllInSync("the Cilium node healed by its agent's restart")
	evs, err := c.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", n.Name).String()})
	if err != nil {
		t.Fatal(err)
	}
	said := false
	for _, e := range evs.Items {
		said = said || strings.Contains(e.Message, "restarting the Cilium agent on the node")
	}
	if !said {
		t.Errorf("no Event on %s says the Cilium agent was restarted", n.Name)
	}
	pods, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil {
			t.Errorf("pod %s deleted besides the agent's", p.Name)
		}
	}
	t.Logf("healed %s after the freeze", time.Since(frozenAt).Round(time.Second))
}

// daemonSetStandIn plays the cilium DaemonSet and its kubelet for a
// namespace-only node: when the agent's pod is deleted it restarts the
// agent (which waits until it has programmed default/kubernetes again)
// and makes the pod anew, once proceed is closed (the test looks at the
// frozen node first). It tells done once, after the first restart.
func daemonSetStandIn(ctx context.Context, t *testing.T, c *localcluster.Cluster, n *localcluster.Node, pod *corev1.Pod, proceed <-chan struct{}, done func(error)) {
	for ctx.Err() == nil {
		time.Sleep(200 * time.Millisecond)
		p, err := c.Client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err == nil && p.DeletionTimestamp == nil || err != nil && !apierrors.IsNotFound(err) {
			continue
		}
		if err == nil {
			// Deleted gracefully: the kubelet would end it and remove it.
			zero := int64(0)
			if err := c.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
				done(err)
				return
			}
		}
		t.Logf("the agent pod %s was deleted: restarting the agent", pod.Name)
		select {
		case <-proceed:
		case <-ctx.Done():
			return
		}
		err = n.RestartProxy(ctx)
		if _, cerr := c.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{}); cerr != nil && err == nil {
			err = cerr
		}
		done(err)
	}
}
