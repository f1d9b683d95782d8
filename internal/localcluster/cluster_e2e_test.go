package localcluster

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

func TestMain(m *testing.M) {
	if os.Getenv("PROXYAUDIT_CRASH_HELPER") == "1" {
		crashHelper()
		return
	}
	Main(m,
		NodeSpec{Name: "ipt-a", Mode: ModeIPTables, Zone: "zone-a"},
		NodeSpec{Name: "ipt-b", Mode: ModeIPTables, Zone: "zone-b"},
		NodeSpec{Name: "nft-a", Mode: ModeNFTables, Zone: "zone-a"},
	)
}

// crashHelper starts a cluster with one node, says READY and waits to be
// killed, leaving its namespaces behind as a crashed run would.
func crashHelper() {
	ctx := context.Background()
	// The parent test holds its lane's lock for the package (Main) and
	// hands this process its descriptor: a flock held by the same open
	// file, so the helper's cluster runs under it instead of waiting for
	// it forever.
	if os.Getenv("PROXYAUDIT_CRASH_LOCK") == "1" {
		procLock.f, procLock.holds = os.NewFile(3, lockPath), 1
	}
	c, err := Start(ctx, Config{})
	if err == nil {
		_, err = c.AddNode(ctx, NodeSpec{Name: "crash", Mode: ModeIPTables})
	}
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	fmt.Println("READY")
	select {}
}

// TestE2ERunAfterCrashStartsClean kills a harness process outright (SIGKILL,
// no teardown), then checks a new run removes what it left and that a
// stopped cluster leaves nothing.
func TestE2ERunAfterCrashStartsClean(t *testing.T) {
	if err := CanRun(); err != nil {
		t.Skipf("END-TO-END TEST SKIPPED: %v", err)
	}
	if testing.Short() {
		t.Skip("end-to-end test skipped in -short mode (make unit); make test runs it")
	}
	if shared.cluster != nil {
		t.Skip("the shared cluster is already running; this test must run first")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	if _, err := EnsureBinaries(ctx, t.Logf); err != nil {
		t.Fatal(err)
	}
	helper := exec.Command(os.Args[0], "-test.run=^$")
	helper.Env = append(os.Environ(), "PROXYAUDIT_CRASH_HELPER=1")
	procLock.Lock()
	if procLock.f != nil {
		helper.ExtraFiles = []*os.File{procLock.f}
		helper.Env = append(helper.Env, "PROXYAUDIT_CRASH_LOCK=1")
	}
	procLock.Unlock()
	out, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	helper.Stderr = os.Stderr
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "READY" {
		helper.Process.Kill()
		helper.Wait()
		t.Fatalf("crash helper did not start a cluster: %q", line)
	}
	helper.Process.Signal(syscall.SIGKILL)
	helper.Wait()

	left := Leftovers()
	if !containsPrefix(left, "network namespace pa-crash") {
		t.Fatalf("expected the killed run to leave its namespace behind, found %q", left)
	}
	c, err := Start(ctx, Config{Logf: t.Logf})
	if err != nil {
		t.Fatalf("start after crash: %v", err)
	}
	if containsPrefix(Leftovers(), "network namespace pa-crash") {
		c.Stop()
		t.Fatal("start after a crash did not remove the crashed run's namespace")
	}
	if _, err := c.AddNode(ctx, NodeSpec{Name: "crash", Mode: ModeNFTables}); err != nil {
		c.Stop()
		t.Fatalf("the crashed node's name is not reusable: %v", err)
	}
	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	if left := Leftovers(); len(left) > 0 {
		t.Fatalf("stopped cluster left: %q", left)
	}
}

func containsPrefix(list []string, prefix string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}

// waitAll waits until every node's rules satisfy cond.
func waitAll(t *testing.T, ctx context.Context, nodes []*Node, what string, cond func(n *Node, rules string) bool) {
	t.Helper()
	for _, n := range nodes {
		if err := n.WaitRules(ctx, 60*time.Second, what, func(r string) bool { return cond(n, r) }); err != nil {
			t.Fatal(err)
		}
	}
}

func TestE2EServiceRulesAppearOnEveryMode(t *testing.T) {
	c := Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	svc, err := c.CreateService(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "e2e-basic", Name: "web"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ApplySlice(ctx, Slice(svc, "web-1", "http", 8080, corev1.ProtocolTCP, "198.18.128.10", "198.18.128.11")); err != nil {
		t.Fatal(err)
	}
	vip := svc.Spec.ClusterIP
	waitAll(t, ctx, c.Nodes(), "web endpoints", func(n *Node, r string) bool {
		ok := n.RoutesTo(r, "198.18.128.10:8080") && n.RoutesTo(r, "198.18.128.11:8080")
		if n.Mode == ModeNFTables {
			return ok && strings.Contains(r, `"name": "service-`) && strings.Contains(r, vip)
		}
		return ok && strings.Contains(r, "-A KUBE-SERVICES -d "+vip+"/32 -p tcp") && strings.Contains(r, "-j KUBE-SVC-")
	})
}

// TestE2EHungInformerLeavesStaleRulesWithGreenLivez reproduces the field
// failure: one node's kube-proxy loses the API, an endpoint changes, the
// other nodes follow while that node keeps DNATing to the removed pod, and
// its /livez keeps answering 200. Lifting the fault lets it recover.
func TestE2EHungInformerLeavesStaleRulesWithGreenLivez(t *testing.T) {
	c := Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	svc, err := c.CreateService(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "e2e-hung", Name: "dns"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ApplySlice(ctx, Slice(svc, "dns-1", "dns", 53, corev1.ProtocolUDP, "198.18.128.20", "198.18.128.21")); err != nil {
		t.Fatal(err)
	}
	waitAll(t, ctx, c.Nodes(), "dns endpoints", func(n *Node, r string) bool {
		return n.RoutesTo(r, "198.18.128.20:53") && n.RoutesTo(r, "198.18.128.21:53")
	})

	for _, hung := range []*Node{c.Node("ipt-b"), c.Node("nft-a")} {
		t.Run(hung.Name, func(t *testing.T) {
			undo, err := hung.HangInformer(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer undo(context.Background())
			// The pod behind .21 goes away and .22 replaces it.
			old, repl := "198.18.128.21:53", "198.18.128.22:53"
			if err := c.ApplySlice(ctx, Slice(svc, "dns-1", "dns", 53, corev1.ProtocolUDP, "198.18.128.20", strings.Split(repl, ":")[0])); err != nil {
				t.Fatal(err)
			}
			var healthy []*Node
			for _, n := range c.Nodes() {
				if n != hung {
					healthy = append(healthy, n)
				}
			}
			waitAll(t, ctx, healthy, "dns endpoints updated", func(n *Node, r string) bool {
				return n.RoutesTo(r, repl) && !n.RoutesTo(r, old)
			})
			// The healthy nodes have converged, so a working kube-proxy on the
			// hung node would have too; watch it for a few sync periods.
			for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
				r, err := hung.Rules(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if !hung.RoutesTo(r, old) || hung.RoutesTo(r, repl) {
					t.Fatalf("%s picked up the change despite the hung informer:\n%s", hung.Name, r)
				}
			}
			code, err := hung.Livez(ctx)
			if err != nil || code != 200 {
				t.Fatalf("expected kube-proxy /livez 200 on the hung node (the green health check), got %d, %v", code, err)
			}
			t.Logf("%s: stale rule to %s kept, /livez %d", hung.Name, old, code)

			if err := undo(ctx); err != nil {
				t.Fatal(err)
			}
			// After the drop is lifted kube-proxy recovers on its own (HTTP/2
			// health checks close the dead connection) within about a minute.
			if err := hung.WaitRules(ctx, 3*time.Minute, "recovery", func(r string) bool {
				return hung.RoutesTo(r, repl) && !hung.RoutesTo(r, old)
			}); err != nil {
				t.Fatal(err)
			}
			// Put the first endpoint set back for the next subtest.
			if err := c.ApplySlice(ctx, Slice(svc, "dns-1", "dns", 53, corev1.ProtocolUDP, "198.18.128.20", "198.18.128.21")); err != nil {
				t.Fatal(err)
			}
			waitAll(t, ctx, c.Nodes(), "dns endpoints restored", func(n *Node, r string) bool {
				return n.RoutesTo(r, old) && !n.RoutesTo(r, repl)
			})
		})
	}
}

func TestE2EFaultInjectors(t *testing.T) {
	c := Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	svc, err := c.CreateService(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "e2e-faults", Name: "api"},
		Spec:       corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "https", Port: 443, Protocol: corev1.ProtocolTCP}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ApplySlice(ctx, Slice(svc, "api-1", "https", 8443, corev1.ProtocolTCP, "198.18.128.30")); err != nil {
		t.Fatal(err)
	}
	waitAll(t, ctx, c.Nodes(), "api endpoint", func(n *Node, r string) bool { return n.RoutesTo(r, "198.18.128.30:8443") })

	for _, n := range []*Node{c.Node("ipt-a"), c.Node("nft-a")} {
		t.Run("tamper/"+n.Name, func(t *testing.T) {
			if err := n.TamperEndpoint(ctx, "198.18.128.30:8443", "198.18.200.1:8443"); err != nil {
				t.Fatal(err)
			}
			r, _ := n.Rules(ctx)
			if n.RoutesTo(r, "198.18.128.30:8443") || !n.RoutesTo(r, "198.18.200.1:8443") {
				t.Fatalf("tamper did not rewrite the DNAT:\n%s", r)
			}
		})
		t.Run("flush-and-restart/"+n.Name, func(t *testing.T) {
			if err := n.FlushRules(ctx); err != nil {
				t.Fatal(err)
			}
			r, _ := n.Rules(ctx)
			if n.RoutesTo(r, "198.18.128.30:8443") || n.RoutesTo(r, APIServerIP+":6443") {
				t.Fatalf("flush left service rules:\n%s", r)
			}
			pid := n.ProxyPID()
			if err := n.RestartProxy(ctx); err != nil {
				t.Fatal(err)
			}
			if n.ProxyPID() == pid {
				t.Fatal("restart kept the same kube-proxy process")
			}
			if err := n.WaitRules(ctx, time.Minute, "rules restored", func(r string) bool { return n.RoutesTo(r, "198.18.128.30:8443") }); err != nil {
				t.Fatal(err)
			}
		})
		t.Run("freeze/"+n.Name, func(t *testing.T) {
			thaw, err := n.Freeze(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st := procState(n.ProxyPID()); st != 'T' {
				thaw(ctx)
				t.Fatalf("kube-proxy in state %c after freeze, want T (stopped)", st)
			}
			if err := thaw(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
	t.Run("drop-api-connection", func(t *testing.T) {
		n := c.Node("ipt-a")
		undo, err := n.DropAPIConnection(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer undo(context.Background())
		if err := c.ApplySlice(ctx, Slice(svc, "api-1", "https", 8443, corev1.ProtocolTCP, "198.18.128.31")); err != nil {
			t.Fatal(err)
		}
		waitAll(t, ctx, []*Node{c.Node("ipt-b")}, "endpoint moved", func(n *Node, r string) bool { return n.RoutesTo(r, "198.18.128.31:8443") })
		if r, _ := n.Rules(ctx); n.RoutesTo(r, "198.18.128.31:8443") {
			t.Fatalf("kube-proxy with a dropped connection saw the change")
		}
		// A restart opens a new connection and converges: the repair
		// proxyaudit automates.
		if err := n.RestartProxy(ctx); err != nil {
			t.Fatal(err)
		}
		if err := n.WaitRules(ctx, time.Minute, "converged after restart", func(r string) bool { return n.RoutesTo(r, "198.18.128.31:8443") }); err != nil {
			t.Fatal(err)
		}
	})
}

// TestE2EAuditedWritesCountProxyauditsOwn: the API server's audit log
// records the writes of the proxyaudit namespace's service accounts, and
// AuditedWrites counts them by account, verb and resource (refusals
// apart); the admin's writes and everyone's reads are not there.
func TestE2EAuditedWritesCountProxyauditsOwn(t *testing.T) {
	c := Shared(t)
	ctx := context.Background()
	since := time.Now()
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "proxyaudit"}}, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().ServiceAccounts("proxyaudit").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "audit-probe"}}, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	tok, err := c.Client.CoreV1().ServiceAccounts("proxyaudit").CreateToken(ctx, "audit-probe", &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := rest.CopyConfig(c.RESTConfig)
	cfg.BearerToken = tok.Status.Token
	as, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// No RBAC: the account's write is refused, its read too (not logged).
	if _, err := as.CoreV1().ConfigMaps("proxyaudit").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "probe"}}, metav1.CreateOptions{}); err == nil {
		t.Fatal("a service account without RBAC wrote a ConfigMap")
	}
	_, _ = as.CoreV1().ConfigMaps("proxyaudit").List(ctx, metav1.ListOptions{})
	// The admin's write is not proxyaudit's.
	if _, err := c.Client.CoreV1().ConfigMaps("proxyaudit").Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "admin-probe"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer c.Client.CoreV1().ConfigMaps("proxyaudit").Delete(ctx, "admin-probe", metav1.DeleteOptions{})
	var ok, refused map[string]int
	testkit.Await(t, 10*time.Second, "audit-probe's refused create in the audit log", func() bool {
		ok, refused, err = c.AuditedWrites(since)
		return err == nil && refused["audit-probe create configmaps"] == 1
	}, func() string { return fmt.Sprintf("writes %v, refused %v, error %v", ok, refused, err) })
	if len(ok) != 0 || len(refused) != 1 {
		t.Errorf("audited writes since the test began: %v, refused %v; want only audit-probe's refused create", ok, refused)
	}
}
