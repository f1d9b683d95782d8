package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/api"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/ipvs"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/scenario"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
	"github.com/proxyaudit/proxyaudit/internal/testkit/findings"
)

const (
	vmName     = "ipvs-a"
	aggIP      = "198.18.1.9"
	ipvsGrace  = 10 * time.Second
	ipvsEvery  = 2 * time.Second
	weightZero = 20 * time.Second
	skew       = 10 * time.Minute
)

// TestE2EIPVS proves IPVS mode on a real kernel: a QEMU VM runs the
// genuine kube-proxy in --proxy-mode ipvs against the host's API server,
// and proxyaudit's collector inside it streams the table it reads over
// netlink to the aggregator on the host, beside the netns nodes' iptables
// and nftables collectors. The service matrix audits clean, from ipvsadm's
// text and from the collector's netlink read alike; a hung informer gives
// the stale and missing real servers and StuckProxy; a real server left at
// weight 0 is reported only once past the weight-zero limit. The VM's
// clock runs ten minutes ahead throughout: a clock-skewed node is judged
// on time. With -capture the tables become audit/testdata/ipvs (with
// -capture-dir, the ipvs directory beside it).
func TestE2EIPVS(t *testing.T) {
	localcluster.NeedRoot(t, true)
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	bin := localcluster.BuildForTest(t)
	start := time.Now()
	vm, err := c.AddVMNode(ctx, localcluster.NodeSpec{Name: vmName, Zone: "zone-a"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			keep := filepath.Join(os.TempDir(), "proxyaudit-ipvs-failure")
			os.RemoveAll(keep)
			_ = exec.Command("cp", "-r", vm.Dir, keep).Run()
			// The guest's console (beside the work dir): a guest that died
			// says why there only.
			_ = exec.Command("cp", vm.Dir+".console.log", filepath.Join(keep, "console.log")).Run()
			t.Logf("VM logs kept in %s; kube-proxy's last lines:\n%s", keep, vm.Log("kube-proxy", 15))
		}
		vm.Stop()
		_ = c.Client.CoreV1().Nodes().Delete(context.Background(), vmName, metav1.DeleteOptions{})
	})
	t.Logf("injected: a VM (boot %s) with kube-proxy in IPVS mode; default/kubernetes programmed %s after start",
		vm.Boot.Round(time.Second), time.Since(start).Round(time.Second))
	// The VM has a kernel and a clock of its own: a node whose clock is
	// minutes off. Nothing the collector sends may count for grace.
	if _, err := vm.Run(ctx, fmt.Sprintf("date -s @$(( $(date +%%s) + %d ))", int(skew.Seconds()))); err != nil {
		t.Fatal(err)
	}
	t.Logf("injected: the VM's clock set %s ahead", skew)

	if err := Reset(ctx, c); err != nil {
		t.Fatal(err)
	}
	if err := scenario.Apply(ctx, c, scenario.Matrix()); err != nil {
		t.Fatal(err)
	}
	vmSynced := func(round int) {
		t.Helper()
		if err := scenario.WaitSynced(ctx, c, round, c.Nodes()); err != nil {
			t.Fatal(err)
		}
		// The sentinel's cluster IP, not just its endpoint: after Reset an
		// earlier test's sentinel may still route to the same endpoint.
		svc, err := c.Client.CoreV1().Services(scenario.Namespace).Get(ctx, scenario.Sentinel(round).Service.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		rs := fmt.Sprintf("-a -t %s:80 -r %s ", svc.Spec.ClusterIP, scenario.SentinelEndpoint(round))
		waitVM(ctx, t, vm, fmt.Sprintf("sentinel %d", round), func(s string) bool { return strings.Contains(s, rs) })
	}
	vmSynced(1)
	fixtures := ""
	if *capture {
		root, err := localcluster.RepoRoot()
		if err != nil {
			t.Fatal(err)
		}
		// Beside the matrix's capture: audit/testdata/ipvs for the pinned
		// release, audit/testdata/k8s/vX.Y/ipvs for another's.
		fixtures = filepath.Join(root, filepath.Dir(filepath.FromSlash(*captureDir)), "ipvs")
		os.RemoveAll(fixtures)
	}

	// 1. The matrix audits clean, and the collector's netlink read is the
	// table ipvsadm prints.
	// One IPVS sync takes kube-proxy 10-35 s under emulation, and it adds
	// new virtual servers before it deletes old ones at the end: the
	// table may be half-way when the sentinel shows. Read until it settles.
	var st *audit.State
	var obs *audit.Observed
	for settle := time.Now().Add(3 * time.Minute); ; time.Sleep(3 * time.Second) {
		var same bool
		st, obs, same = readVM(ctx, t, c, vm, bin, filepath.Join(fixtures, "clean"))
		fs := audit.Diff(audit.ExpectedFor(st, vmName), obs)
		if same && len(fs) == 0 {
			break
		}
		if time.Now().After(settle) {
			t.Fatalf("healthy IPVS node still has findings after 3m:\n%s", findingLines(fs))
		}
	}
	t.Logf("the matrix on IPVS: %d virtual servers, no findings", len(obs.Frontends))
	if out, err := vm.Run(ctx, "grep -m3 -A3 'Failed to execute iptables-restore' "+filepath.Join(vm.Dir, "kube-proxy.log")); err == nil {
		t.Fatalf("kube-proxy's iptables-restore fails in the VM (a netfilter module the guest cannot load?):\n%s", out)
	}

	// 2. The collector in the VM streams to the host's aggregator.
	agg := startFleet(ctx, t, c, vm, bin)
	var vmStatus audit.NodeStatus
	agg.waitFor("every node in sync, IPVS included", 3*time.Minute, func(fs []audit.TimedFinding, ns map[string]audit.NodeStatus) bool {
		vmStatus = ns[vmName]
		return len(fs) == 0 && vmStatus.State == audit.NodeInSync && vmStatus.Mode == audit.ModeIPVS && ns["ipt-a"].State == audit.NodeInSync &&
			vmStatus.KubeProxy != nil && !vmStatus.KubeProxy.LastSync.IsZero()
	})
	ahead := time.Until(vmStatus.KubeProxy.LastSync)
	t.Logf("system: the IPVS node in sync; its kube-proxy last synced at %s by its own clock, %s ahead of the host's",
		vmStatus.KubeProxy.LastSync.Format(time.RFC3339), ahead.Round(time.Second))
	if ahead < skew-2*time.Minute || len(vmStatus.Warnings) != 0 {
		t.Errorf("the VM's kube-proxy signal: %+v, warnings %q", vmStatus.KubeProxy, vmStatus.Warnings)
	}
	// kube-proxy 1.36 does not export its version; kubelets of the
	// known-bad releases wrote it into the Node's status.
	setVersion := func(v string) {
		t.Helper()
		node, err := c.Client.CoreV1().Nodes().Get(ctx, vmName, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		//lint:ignore SA1019 what kubelets of the known-bad releases wrote
		node.Status.NodeInfo.KubeProxyVersion = v
		if _, err := c.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	setVersion("v1.12.3")
	agg.waitFor("a known-bad kube-proxy warning on the IPVS node", time.Minute, func(fs []audit.TimedFinding, ns map[string]audit.NodeStatus) bool {
		w := ns[vmName].Warnings
		return len(fs) == 0 && len(w) == 1 && strings.Contains(w[0], "v1.12.3") && len(ns["ipt-a"].Warnings) == 0
	})
	t.Log("injected: the Node reports kube-proxy v1.12.3; system: a warning on that node, no finding")
	setVersion("")

	// 3. Hung informer: the VM's API traffic dropped, then the cluster drifts.
	undo, err := vm.HangInformer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := Drift(ctx, c); err != nil {
		t.Fatal(err)
	}
	changed := time.Now()
	if err := scenario.WaitSynced(ctx, c, 2, c.Nodes()); err != nil {
		t.Fatal(err)
	}
	t.Log("injected: the VM's traffic to the API server dropped; endpoints replaced, removed and added, a service deleted and one created")
	var fs []audit.TimedFinding
	agg.waitFor("StuckProxy on the IPVS node", ipvsGrace+2*time.Minute, func(f []audit.TimedFinding, _ map[string]audit.NodeStatus) bool {
		fs = f
		return findings.Has(f, vmName, audit.StuckProxy) && findings.Has(f, vmName, audit.MissingService)
	})
	took := time.Since(changed)
	t.Logf("system: StuckProxy on %s %s after the change (grace %s, node clock %s ahead); findings:\n%s", vmName, took.Round(time.Second), ipvsGrace, skew, findings.Describe(fs))
	if took > ipvsGrace+30*time.Second {
		t.Errorf("StuckProxy %s after the change: detection must not depend on the node's clock (grace %s, interval %s)", took, ipvsGrace, ipvsEvery)
	}
	for _, want := range []string{
		"StaleEndpoint matrix/multi 198.18.128.3:8080", "MissingEndpoint matrix/multi 198.18.128.4:8080",
		"StaleEndpoint matrix/nodeport 198.18.128.11:8080", "MissingEndpoint matrix/two-slices 198.18.128.77:8080",
		"MissingService matrix/created ",
	} {
		if !strings.Contains(findings.Describe(fs), want) {
			t.Errorf("missing finding %q", want)
		}
	}
	for _, f := range fs {
		if f.Node != vmName {
			t.Errorf("finding on a healthy node: %s %s %s %s", f.Node, f.Kind, f.Service, f.Endpoint)
		}
	}
	st, obs = mustReadVM(ctx, t, c, vm, bin, filepath.Join(fixtures, "drift"))
	want := driftFindings("StaleService : ") // the deleted affinity service: IPVS names nothing
	if got := findingLines(audit.Diff(audit.ExpectedFor(st, vmName), obs)); got != want {
		t.Errorf("static diff of the drifted IPVS table:\n%s\nwant:\n%s", got, want)
	}
	if err := undo(ctx); err != nil {
		t.Fatal(err)
	}
	agg.waitFor("the IPVS node back in sync after the fault was lifted", 3*time.Minute, func(fs []audit.TimedFinding, ns map[string]audit.NodeStatus) bool {
		return len(fs) == 0 && ns[vmName].State == audit.NodeInSync
	})

	// 4. Weight 0: kube-proxy hangs (SIGSTOP, as in kubernetes#71071) with a
	// removed endpoint's real server left at weight 0.
	if _, err := vm.Run(ctx, "kill -STOP $(cat "+filepath.Join(vm.Dir, "kube-proxy.pid")+")"); err != nil {
		t.Fatal(err)
	}
	var two scenario.Entry
	for _, e := range scenario.Matrix() {
		if e.Service.Name == "two-slices" {
			two = e
		}
	}
	if err := c.ApplySlice(ctx, two.Slices[1]); err != nil { // .77 (added by Drift) removed again
		t.Fatal(err)
	}
	if _, err := vm.Run(ctx, `ipvsadm -Sn | grep -- '-r 198.18.128.77:8080' | sed 's/^-a/-e/; s/-w [0-9]*/-w 0/' | ipvsadm -R`); err != nil {
		t.Fatal(err)
	}
	zeroed := time.Now()
	t.Logf("injected: kube-proxy frozen, 198.18.128.77 removed from two-slices, its real server set to weight 0 (limit %s)", weightZero)
	for time.Since(zeroed) < weightZero-3*time.Second {
		fs, _, err := agg.get()
		// A frozen kube-proxy must not slow the collector's heartbeats
		// either: its metrics scrape hangs, the reports go on
		// (TestFrozenKubeProxyDoesNotDelayHeartbeats); before, this node
		// looked CollectorMissing here.
		if err == nil && len(fs) > 0 {
			t.Fatalf("a draining real server was reported before the %s limit (%s):\n%s", weightZero, time.Since(zeroed).Round(time.Second), findings.Describe(fs))
		}
		time.Sleep(time.Second)
	}
	agg.waitFor("the weight-0 leftover reported", weightZero+time.Minute, func(fs []audit.TimedFinding, _ map[string]audit.NodeStatus) bool {
		for _, f := range fs {
			if f.Node == vmName && f.Kind == audit.StaleEndpoint && f.Endpoint == "198.18.128.77:8080" && strings.Contains(f.Detail, "weight 0") {
				t.Logf("system: %s after the weight was zeroed: %s %s %s (%s)", time.Since(zeroed).Round(time.Second), f.Kind, f.Service, f.Endpoint, f.Detail)
				return len(fs) == 1
			}
		}
		return false
	})
	st, obs = mustReadVM(ctx, t, c, vm, bin, filepath.Join(fixtures, "weight0"))
	if d := audit.Draining(audit.ExpectedFor(st, vmName), obs); len(d) == 0 {
		t.Errorf("the static reader sees no draining real server:\n%v", obs.Frontends)
	}
	if _, err := vm.Run(ctx, "kill -CONT $(cat "+filepath.Join(vm.Dir, "kube-proxy.pid")+")"); err != nil {
		t.Fatal(err)
	}
	agg.waitFor("kube-proxy, thawed, removed the leftover", 3*time.Minute, func(fs []audit.TimedFinding, ns map[string]audit.NodeStatus) bool {
		return len(fs) == 0 && ns[vmName].State == audit.NodeInSync
	})
	if out, err := vm.IPVS(ctx); err != nil || strings.Contains(out, "198.18.128.77:8080") {
		t.Errorf("the weight-0 real server is still there (%v):\n%s", err, out)
	}
}

// Reset deletes every matrix object so that the matrix can be applied
// afresh (earlier tests in the package drifted it).
func Reset(ctx context.Context, c *localcluster.Cluster) error {
	svcs, err := c.Client.CoreV1().Services(scenario.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, s := range svcs.Items {
		if err := c.Client.CoreV1().Services(scenario.Namespace).Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil {
			return err
		}
	}
	return c.Client.DiscoveryV1().EndpointSlices(scenario.Namespace).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
}

func waitVM(ctx context.Context, t *testing.T, vm *localcluster.VMNode, what string, cond func(string) bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		out, err := vm.IPVS(ctx)
		if err == nil && cond(out) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("IPVS in the VM: no %s after 3m (%v):\n%s\nkube-proxy log:\n%s", what, err, out, vm.Log("kube-proxy", 20))
		}
		time.Sleep(2 * time.Second)
	}
}

// mustReadVM is readVM until both reads agree: even a hung kube-proxy
// keeps running its periodic sync, which can touch the table between the
// two reads. Ten disagreements in a row fail the test.
func mustReadVM(ctx context.Context, t *testing.T, c *localcluster.Cluster, vm *localcluster.VMNode, bin, dir string) (*audit.State, *audit.Observed) {
	t.Helper()
	for range 10 {
		if st, obs, same := readVM(ctx, t, c, vm, bin, dir); same {
			return st, obs
		}
		time.Sleep(3 * time.Second)
	}
	t.Fatalf("the collector's netlink read and ipvsadm -Sn never agreed in 10 tries")
	return nil, nil
}

// readVM reads the VM's table twice, as ipvsadm prints it and as the
// collector reads it over netlink, says whether both give the same model
// (they may not while kube-proxy is changing the table), and writes them
// (with the cluster state) under dir when capturing.
func readVM(ctx context.Context, t *testing.T, c *localcluster.Cluster, vm *localcluster.VMNode, bin, dir string) (*audit.State, *audit.Observed, bool) {
	t.Helper()
	cluster, err := c.DumpClusterJSON(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(cluster)
	if err != nil {
		t.Fatal(err)
	}
	save, err := vm.Run(ctx, "ipvsadm -Sn")
	if err != nil {
		t.Fatal(err)
	}
	list, err := vm.Run(ctx, "ipvsadm -Ln")
	if err != nil {
		t.Fatal(err)
	}
	snapPath := filepath.Join(vm.Dir, "snapshot.json")
	if out, err := vm.Run(ctx, filepath.Join(bin, "proxyaudit-collector")+" --once --mode ipvs --snapshot "+snapPath); err != nil {
		t.Fatalf("collector --once in the VM: %v\n%s", err, out)
	}
	snap, err := os.ReadFile(snapPath)
	if err != nil {
		t.Fatal(err)
	}
	fromSave, err := ipvs.Parse(strings.NewReader(save))
	if err != nil {
		t.Fatalf("ipvsadm -Sn: %v\n%s", err, save)
	}
	var m stream.Message
	if err := json.Unmarshal(snap, &m); err != nil || m.Report == nil {
		t.Fatalf("collector snapshot: %v", err)
	}
	if root := stream.FromModel(fromSave).Root(); root != m.Report.Root {
		t.Logf("the collector's netlink read differs from the ipvsadm -Sn just before it (the table is changing)")
		return st, fromSave, false
	}
	if dir != "" && *capture {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for name, data := range map[string][]byte{"cluster.json": cluster, vmName + ".save": []byte(save + "\n"),
			vmName + ".list": []byte(list + "\n"), vmName + ".snapshot.json": snap} {
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	return st, fromSave, true
}

func findingLines(fs []audit.Finding) string {
	var out []string
	for _, f := range fs {
		out = append(out, string(f.Kind)+" "+f.Service+":"+f.Port+" "+f.Endpoint)
	}
	return strings.Join(out, "\n")
}

// fleet is one aggregator on the host with a collector on every node: the
// netns nodes' (iptables, nftables) and the VM's (IPVS).
type fleet struct {
	t    *testing.T
	agg  *localcluster.Process
	http *http.Client
}

func startFleet(ctx context.Context, t *testing.T, c *localcluster.Cluster, vm *localcluster.VMNode, bin string) *fleet {
	t.Helper()
	const ns, sa, aud = "proxyaudit", "proxyaudit-collector", "proxyaudit"
	if err := c.AddHostAddress(ctx, aggIP); err != nil {
		t.Fatal(err)
	}
	agg, err := c.StartProcess("ipvs-aggregator", filepath.Join(bin, "proxyaudit-aggregator"),
		"--kubeconfig="+c.AdminKubeconfig, "--leader-elect=false", "--advertise-address="+aggIP,
		"--stream-listen="+aggIP+":9443", "--http-listen="+aggIP+":8080",
		"--grace="+ipvsGrace.String(), "--ipvs-weight-zero-limit="+weightZero.String(),
		"--token-audience="+aud, "--collector-service-accounts="+ns+"/"+sa)
	if err != nil {
		t.Fatal(err)
	}
	f := &fleet{t: t, agg: agg, http: &http.Client{Timeout: 5 * time.Second}}
	t.Cleanup(agg.Stop)
	dir := t.TempDir()
	token := func(node string) string {
		tok, err := c.PodToken(ctx, ns, sa, node, aud)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, node+".token")
		if err := os.WriteFile(path, []byte(tok), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	args := func(node string) []string {
		return []string{filepath.Join(bin, "proxyaudit-collector"), "--node-name=" + node, "--aggregator=" + aggIP + ":9443",
			"--interval=" + ipvsEvery.String(), "--token-file=" + token(node)}
	}
	for _, n := range c.Nodes() {
		p, err := n.StartProcess("ipvs-fleet-collector-"+n.Name, args(n.Name)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Stop)
	}
	if err := vm.Start(ctx, "collector", args(vmName)...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = vm.StopProcess(context.Background(), "collector") })
	return f
}

func (f *fleet) get() ([]audit.TimedFinding, map[string]audit.NodeStatus, error) {
	var fr api.FindingsResponse
	var nr api.NodesResponse
	for path, v := range map[string]any{"/api/v1/findings": &fr, "/api/v1/nodes": &nr} {
		r, err := f.http.Get("http://" + aggIP + ":8080" + path)
		if err != nil {
			return nil, nil, err
		}
		body, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != http.StatusOK {
			return nil, nil, fmt.Errorf("GET %s: %s: %s", path, r.Status, body)
		}
		if err := json.Unmarshal(body, v); err != nil {
			return nil, nil, err
		}
	}
	ns := map[string]audit.NodeStatus{}
	for _, n := range nr.Nodes {
		ns[n.Node] = n
	}
	return fr.Findings, ns, nil
}

func (f *fleet) waitFor(what string, deadline time.Duration, cond func([]audit.TimedFinding, map[string]audit.NodeStatus) bool) time.Duration {
	f.t.Helper()
	var fs []audit.TimedFinding
	var ns map[string]audit.NodeStatus
	var err error
	return testkit.Await(f.t, deadline, what, func() bool {
		fs, ns, err = f.get()
		return err == nil && cond(fs, ns)
	}, func() string {
		var states []string
		for n, s := range ns {
			states = append(states, n+"="+string(s.State)+"/"+string(s.Mode)+" "+s.ReadError)
		}
		return fmt.Sprintf("findings:\n%s\nnodes: %s\n(error: %v)\naggregator log:\n%s", findings.Describe(fs), strings.Join(states, ", "), err, f.agg.Tail(20))
	})
}
