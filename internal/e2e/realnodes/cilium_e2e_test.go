package realnodes

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// ciliumEnv runs TestE2ECiliumOnRealNodes: it builds the genuine Cilium
// agent (~6 min cold) and its image (clang-19 and LLVM inside), so `make
// e2e-cilium` (part of `make e2e-long`) runs it alone, not `make test`.
// It adds a node to the package's cluster: run it alone.
const ciliumEnv = "PROXYAUDIT_CILIUM"

// Cilium's agent as its DaemonSet runs it, on a real kubelet node of the
// shared cluster (kube-proxy's DaemonSets run on the others), audited by
// the chart with cilium.enabled and restart remediation:
//   - the node's collector, in its pod, reaches the aggregators through
//     Cilium's socket load balancing (DNS, its Service) and reads the
//     agent's maps from the node's BPF filesystem: in sync;
//   - the agent frozen (SIGSTOP) while a service's endpoint moves and a
//     service appears: that node alone is found, the stale and the missing
//     endpoint and the missing service, said to be Cilium's;
//   - remediation deletes that node's agent pod through the API; the
//     DaemonSet controller and the kubelet replace it (the frozen
//     container killed), and the node heals. kube-proxy's pods elsewhere
//     are untouched.
func TestE2ECiliumOnRealNodes(t *testing.T) {
	if os.Getenv(ciliumEnv) != "1" {
		t.Skipf("needs the genuine Cilium agent and its image (built here, ~8 min cold, Debian's clang-19): make e2e-cilium runs it (%s=1)", ciliumEnv)
	}
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	spec := localcluster.KubeletNodeSpec{Name: "real-cil", Mode: localcluster.ModeCilium, Zone: "zone-a"}
	n := c.Node(spec.Name)
	if n == nil {
		start := time.Now()
		var err error
		if n, err = c.AddKubeletNode(ctx, spec); err != nil {
			t.Fatal(err)
		}
		fleet = append(fleet, spec)
		if err := c.DeployCilium(ctx); err != nil {
			t.Fatal(err)
		}
		waitPods(ctx, t, c, "kube-system", "k8s-app=cilium", 1, 5*time.Minute)
		if err := n.WaitRules(ctx, 5*time.Minute, "Cilium's maps with default/kubernetes", func(rules string) bool {
			return strings.Contains(rules, "cilium_lb4_services_v2") && n.RoutesTo(rules, c.KubernetesEndpoint())
		}); err != nil {
			t.Fatal(err)
		}
		t.Logf("Cilium's agent pod on %s programmed default/kubernetes %s after the node was added", n.Name, time.Since(start).Round(time.Second))
	}
	if err := n.CheckCiliumCgroup(); err != nil {
		t.Fatal(err)
	}
	agentPod := func() *corev1.Pod { return systemPod(ctx, t, c, "k8s-app=cilium", n.Name) }

	// The drill: a service with two endpoints (no pods needed: the maps
	// are what is audited).
	const ns = "cil-drill"
	if err := c.EnsureNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	defer c.Client.CoreV1().Namespaces().Delete(context.Background(), ns, metav1.DeleteOptions{})
	service := func(name string, ips ...string) *corev1.Service {
		svc, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.ApplySlice(ctx, localcluster.Slice(svc, name+"-x1", "http", 8080, corev1.ProtocolTCP, ips...)); err != nil {
			t.Fatal(err)
		}
		return svc
	}
	drill := service("web", "198.18.200.1", "198.18.200.2")
	// A migration's leftover: kube-proxy's chain, which nothing maintains
	// here (no kube-proxy runs): Cilium's maps are audited, with a warning.
	if out, err := n.Exec(ctx, "iptables", "-t", "nat", "-N", "KUBE-SERVICES"); err != nil && !strings.Contains(out, "exists") {
		t.Fatalf("leftover chain: %v: %s", err, out)
	}

	checkCiliumNode(ctx, t, c, n, ns, service)

	helm(ctx, t, c, "install", "proxyaudit", "charts/proxyaudit", "--namespace", "proxyaudit", "--create-namespace",
		"--set", "grace=10s", "--set", "collector.interval=5s",
		"--set", "cilium.enabled=true", "--set", "cilium.bpfRoot="+c.CiliumBPFRoot(),
		"--set", "remediation.mode=restart", "--set", "remediation.maxNodes=3", "--set", "remediation.maxUnhealthy=100%", "--set", "remediation.breakerShare=1")
	defer uninstall(t, c)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 3*time.Minute)
	r := waitInSync(ctx, t, c, 3*time.Minute, time.Time{}, "after helm install with cilium.enabled")
	for _, s := range r.Nodes {
		if s.Node == n.Name && s.Mode != audit.ModeCilium {
			t.Fatalf("%s audited in mode %q, want %q", n.Name, s.Mode, audit.ModeCilium)
		}
		if s.Node == n.Name && !slices.ContainsFunc(s.Warnings, func(w string) bool { return strings.Contains(w, "kube-proxy's iptables rules remain") }) {
			t.Errorf("%s keeps kube-proxy's leftover chain and its status does not warn of it: %q", n.Name, s.Warnings)
		}
	}
	if log := collectorLog(ctx, c, n.Name, 1000); !strings.Contains(log, "kube-proxy's iptables rules remain on this node but kube-proxy is not running") {
		t.Errorf("%s keeps kube-proxy's leftover chain and its collector does not warn of it:\n%s", n.Name, log)
	}
	proxies := map[string]string{}
	for _, s := range fleet {
		if p := kubeProxyPod(ctx, t, c, s.Name); p != nil {
			proxies[s.Name] = p.Name
		}
	}
	before := agentPod()
	if before == nil {
		t.Fatalf("no Cilium agent pod on %s", n.Name)
	}

	// The hung agent of cilium#48050: alive, its maps kept, following
	// nothing.
	thaw, err := n.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer thaw(context.Background())
	frozen := time.Now()
	seen := watchFindings(ctx, t, c)
	if err := c.ApplySlice(ctx, localcluster.Slice(drill, "web-x1", "http", 8080, corev1.ProtocolTCP, "198.18.200.1", "198.18.200.3")); err != nil {
		t.Fatal(err)
	}
	service("late", "198.18.200.4")

	// Remediation deletes the agent's pod; its replacement runs.
	for deadline := time.Now().Add(4 * time.Minute); ; time.Sleep(time.Second) {
		if p := agentPod(); p != nil && p.UID != before.UID {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 4m, Cilium's agent pod on %s not replaced; findings seen: %v\n%s", n.Name, seen(), aggregatorLogs(ctx, c, "RestartProxy"))
		}
	}
	replaced := time.Since(frozen)
	waitInSync(ctx, t, c, 4*time.Minute, time.Now(), "after the agent's restart")
	got := seen()
	slices.Sort(got)
	t.Logf("agent frozen: pod replaced %s later, node in sync %s later; findings seen: %s", replaced.Round(time.Second),
		time.Since(frozen).Round(time.Second), strings.Join(got, "; "))
	for _, want := range []string{
		"StuckProxy " + n.Name,
		"StaleEndpoint " + n.Name + " " + ns + "/web",
		"MissingEndpoint " + n.Name + " " + ns + "/web",
		"MissingService " + n.Name + " " + ns + "/late",
	} {
		if !slices.ContainsFunc(got, func(f string) bool { return strings.HasPrefix(f, want) }) {
			t.Errorf("never found %q; found: %v", want, got)
		}
	}
	for _, f := range got {
		if !strings.Contains(f, " "+n.Name+" ") && !strings.HasSuffix(f, " "+n.Name) {
			t.Errorf("a finding on a node whose kube-proxy followed the API: %s", f)
		}
	}
	for node, name := range proxies {
		if p := kubeProxyPod(ctx, t, c, node); p == nil || p.Name != name {
			t.Errorf("%s's kube-proxy pod was replaced (%s): only %s's Cilium agent was behind", node, name, n.Name)
		}
	}
	evs, err := c.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + n.Name + ",reason=ProxyauditRestartProxy"})
	if err != nil {
		t.Fatal(err)
	}
	if len(evs.Items) == 0 || !strings.Contains(evs.Items[0].Message, "Cilium") {
		t.Fatalf("no RestartProxy event naming Cilium on %s: %v", n.Name, evs.Items)
	}
	e := evs.Items[0]
	at := e.FirstTimestamp.Time
	if at.IsZero() {
		at = e.EventTime.Time
	}
	t.Logf("remediation restarted the agent %s after the freeze: %s", at.Sub(frozen).Round(time.Second), e.Message)
}

// checkCiliumNode runs `kubectl proxyaudit check node/…` on the Cilium
// node before the chart is installed (issue #57): in sync, the node's own
// detection reads Cilium's maps (from where its agent pins them,
// --bpf-root); with the agent frozen while a Service is made, the check
// finds that Service missing, as the aggregator would.
func checkCiliumNode(ctx context.Context, t *testing.T, c *localcluster.Cluster, n *localcluster.Node, ns string, service func(string, ...string) *corev1.Service) {
	t.Helper()
	check := func() (int, *checkResult, string) {
		return runCheck(ctx, t, c, "node/"+n.Name, "-n", ns, "-o", "json", "--bpf-root", c.CiliumBPFRoot())
	}
	code, r, stderr := check()
	if code != 0 || r.Read.Mode != string(audit.ModeCilium) || r.Read.Frontends < 1 || len(r.Findings) != 0 {
		t.Fatalf("check node/%s (Cilium, in sync): exit %d, read %+v, findings %+v\n%s", n.Name, code, r.Read, r.Findings, stderr)
	}
	t.Logf("check node/%s: %s, %d frontends, the pod took %.1fs", n.Name, r.Read.Mode, r.Read.Frontends, r.Read.PodSeconds)

	thaw, err := n.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	service("checked", "198.18.200.9")
	time.Sleep(2 * time.Second) // the API has it; the frozen agent does not
	code, r, stderr = check()
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	missing := slices.ContainsFunc(r.Findings, func(f audit.Finding) bool {
		return f.Service == ns+"/checked" && (f.Kind == audit.MissingService || f.Kind == audit.MissingEndpoint)
	})
	if code != 1 || !missing {
		t.Errorf("check node/%s with its agent frozen: exit %d, findings %+v\n%s", n.Name, code, r.Findings, stderr)
	}
	if err := n.WaitRules(ctx, 2*time.Minute, "the checked service, the agent thawed", func(rules string) bool { return n.RoutesTo(rules, "198.18.200.9:8080") }); err != nil {
		t.Fatal(err)
	}
	t.Logf("check node/%s with its agent frozen: exit 1, %d finding(s), the checked Service among them", n.Name, len(r.Findings))
}
