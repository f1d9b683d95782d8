// Package dualstack audits dual-stack and IPv6-only local clusters:
// genuine kube-proxy in iptables (both backends) and nftables mode
// programming IPv4 and IPv6 services, read by the collector's own readers
// and by the tools an SRE would run, judged by the audit and by
// `proxyaudit diff`.
package dualstack

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane"
	"github.com/proxyaudit/proxyaudit/internal/collector"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/testkit"
)

var (
	capture    = flag.Bool("capture", false, "rewrite audit/testdata/dualstack from the dual-stack cluster (make fixtures)")
	captureDir = flag.String("capture-dir", "audit/testdata/dualstack", "where -capture writes, below the repository (make fixtures K8S_VERSION=vX.Y.Z: audit/testdata/k8s/vX.Y/dualstack, with that release's kube-proxy in "+localcluster.KubeProxyEnv+")")
)

// save writes the cluster and every node's rules (both families, as an
// SRE's tools print them; more, such as a VM's ipvsadm -Sn, by name)
// under -capture-dir's dir.
func save(ctx context.Context, t *testing.T, c *localcluster.Cluster, dir string, more map[string]string) {
	t.Helper()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir = filepath.Join(root, *captureDir, dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	data, err := c.DumpClusterJSON(ctx)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{"cluster.json": string(data)}
	for _, n := range c.Nodes() {
		if files[n.Name+".rules"], err = n.Rules(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for name, content := range more {
		files[name] = content
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("captured %s", dir)
}

// cluster is a local cluster of cfg's families with nodes, the test's own
// (the API server's service ranges are fixed at its start).
func cluster(t *testing.T, cfg localcluster.Config, nodes ...localcluster.NodeSpec) *localcluster.Cluster {
	t.Helper()
	return localcluster.Up(t, localcluster.Topology{Own: true, Config: cfg, Nodes: nodes})
}

// read is what the collector reads on node n, with the mode it detected.
func read(ctx context.Context, t *testing.T, n *localcluster.Node) *audit.Observed {
	t.Helper()
	var obs *audit.Observed
	err := localcluster.InNetNS(n.NetNS, func() error {
		h := collector.NewHost()
		src, err := h.Detect(ctx)
		if err != nil {
			return err
		}
		obs, err = h.Reader(src).Read(ctx)
		return err
	})
	if err != nil {
		t.Fatalf("%s: collector read: %v", n.Name, err)
	}
	return obs
}

func state(ctx context.Context, t *testing.T, c *localcluster.Cluster) *audit.State {
	t.Helper()
	data, err := c.DumpClusterJSON(ctx)
	if err != nil {
		t.Fatal(err)
	}
	st, err := audit.ParseClusterList(data)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// audited diffs every node's rules as the collector reads them.
func audited(ctx context.Context, t *testing.T, c *localcluster.Cluster) map[string][]audit.Finding {
	t.Helper()
	st := state(ctx, t, c)
	out := map[string][]audit.Finding{}
	for _, n := range c.Nodes() {
		obs := read(ctx, t, n)
		if !slices.Equal(obs.Families, []int{4, 6}) {
			t.Fatalf("%s: the collector read families %v, want both", n.Name, obs.Families)
		}
		out[n.Name] = audit.Diff(audit.ExpectedFor(st, n.Name), obs)
	}
	return out
}

// until polls the audit until ok accepts it.
func until(ctx context.Context, t *testing.T, c *localcluster.Cluster, limit time.Duration, what string, ok func(map[string][]audit.Finding) bool) map[string][]audit.Finding {
	t.Helper()
	var got map[string][]audit.Finding
	testkit.Await(t, limit, what, func() bool {
		got = audited(ctx, t, c)
		return ok(got)
	}, func() string { return describe(got) })
	return got
}

func describe(m map[string][]audit.Finding) string {
	var b strings.Builder
	for node, fs := range m {
		for _, f := range fs {
			fmt.Fprintf(&b, "  %s %s %s IPv%d %s %s: %s\n", node, f.Kind, f.Service, f.Family, f.Endpoint, f.Scope, f.Detail)
		}
	}
	return b.String()
}

func inSync(m map[string][]audit.Finding) bool {
	for _, fs := range m {
		if len(fs) > 0 {
			return false
		}
	}
	return true
}

func service(name string, policy corev1.IPFamilyPolicy, fams []corev1.IPFamily, typ corev1.ServiceType, local bool) *corev1.Service {
	s := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default"},
		Spec: corev1.ServiceSpec{Type: typ, IPFamilyPolicy: &policy, IPFamilies: fams,
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}}
	if local {
		s.Spec.ExternalTrafficPolicy = corev1.ServiceExternalTrafficPolicyLocal
	}
	return s
}

// Every policy and type of a dual-stack cluster, audited in both families
// on iptables (nf_tables and legacy) and nftables nodes: in sync when
// kube-proxy is; a stuck node's stale IPv6 endpoint, a service it never
// programmed (both families) and a flushed IPv6 table each found, with
// the family; `proxyaudit diff` given one family's dump says the other
// was not audited.
func TestE2EDualStack(t *testing.T) {
	c := cluster(t, localcluster.Config{DualStack: true},
		localcluster.NodeSpec{Name: "ds-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
		localcluster.NodeSpec{Name: "ds-legacy", Mode: localcluster.ModeIPTables, Zone: "zone-b", LegacyIPTables: true},
		localcluster.NodeSpec{Name: "ds-nft", Mode: localcluster.ModeNFTables, Zone: "zone-a"})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	v4, v6 := corev1.IPv4Protocol, corev1.IPv6Protocol
	svcs := map[string]*corev1.Service{}
	for _, s := range []*corev1.Service{
		service("single-v4", corev1.IPFamilyPolicySingleStack, []corev1.IPFamily{v4}, corev1.ServiceTypeClusterIP, false),
		service("single-v6", corev1.IPFamilyPolicySingleStack, []corev1.IPFamily{v6}, corev1.ServiceTypeNodePort, false),
		service("prefer", corev1.IPFamilyPolicyPreferDualStack, []corev1.IPFamily{v4, v6}, corev1.ServiceTypeNodePort, false),
		service("require-v6-first", corev1.IPFamilyPolicyRequireDualStack, []corev1.IPFamily{v6, v4}, corev1.ServiceTypeNodePort, true),
	} {
		created, err := c.CreateService(ctx, s)
		if err != nil {
			t.Fatal(err)
		}
		svcs[s.Name] = created
	}
	if got := svcs["prefer"].Spec.ClusterIPs; len(got) != 2 {
		t.Fatalf("PreferDualStack got cluster IPs %v: the API server is not dual-stack", got)
	}
	slices4 := map[string][]string{"single-v4": {"198.18.140.1"}, "prefer": {"198.18.140.2", "198.18.140.3"}, "require-v6-first": {"198.18.140.4"}}
	slices6 := map[string][]string{"single-v6": {"2001:2:0:8001::1"}, "prefer": {"2001:2:0:8001::2"}, "require-v6-first": {"2001:2:0:8001::3", "2001:2:0:8001::4"}}
	apply := func(name string, ips []string, fam string) {
		t.Helper()
		s := localcluster.Slice(svcs[name], name+"-"+fam, "http", 8080, corev1.ProtocolTCP, ips...)
		if name == "require-v6-first" {
			// externalTrafficPolicy Local: one endpoint on ds-ipt, the
			// others nowhere the nodes are.
			s.Endpoints[0] = localcluster.ReadyEndpoint(ips[0], "ds-ipt")
		}
		if err := c.ApplySlice(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	for name, ips := range slices4 {
		apply(name, ips, "v4")
	}
	for name, ips := range slices6 {
		apply(name, ips, "v6")
	}

	until(ctx, t, c, time.Minute, "every node in sync in both families", inSync)
	if *capture {
		save(ctx, t, c, "clean", nil)
	}
	// What an SRE's tools print parses to what the collector read from
	// the kernel (iptables-nft over netlink, legacy with getsockopt,
	// nftables over netlink), frontend by frontend and endpoint by
	// endpoint, and holds IPv6 frontends of every kind, node ports
	// included.
	for _, n := range c.Nodes() {
		text, err := n.Rules(ctx)
		if err != nil {
			t.Fatal(err)
		}
		ref, err := dataplane.ParseRules(strings.NewReader(text))
		if err != nil {
			t.Fatalf("%s: %v", n.Name, err)
		}
		got := read(ctx, t, n)
		if !slices.Equal(ref.Families, got.Families) || !reflect.DeepEqual(ref.Frontends, got.Frontends) {
			t.Errorf("%s: the tools' dump (families %v, %d frontends) and the collector (%v, %d) differ", n.Name, ref.Families, len(ref.Frontends), got.Families, len(got.Frontends))
			for i := range min(len(ref.Frontends), len(got.Frontends)) {
				if !reflect.DeepEqual(ref.Frontends[i], got.Frontends[i]) {
					t.Logf("first difference:\n tools     %+v\n collector %+v", ref.Frontends[i], got.Frontends[i])
					break
				}
			}
		}
		kinds := map[string]bool{}
		for _, f := range got.Frontends {
			if f.Family() == 6 {
				kinds[map[bool]string{true: "node port", false: "cluster IP"}[f.NodePort]] = true
			}
		}
		if !kinds["node port"] || !kinds["cluster IP"] {
			t.Errorf("%s: IPv6 frontends read: %v", n.Name, kinds)
		}
	}

	// ds-nft's kube-proxy frozen: the IPv6 service's endpoint moves and a
	// new dual-stack service appears.
	nft := c.Node("ds-nft")
	thaw, err := nft.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	apply("single-v6", []string{"2001:2:0:8001::9"}, "v6")
	late, err := c.CreateService(ctx, service("late", corev1.IPFamilyPolicyRequireDualStack, []corev1.IPFamily{v4, v6}, corev1.ServiceTypeClusterIP, false))
	if err != nil {
		t.Fatal(err)
	}
	svcs["late"] = late
	apply("late", []string{"198.18.140.9"}, "v4")
	apply("late", []string{"2001:2:0:8001::a"}, "v6")
	got := until(ctx, t, c, time.Minute, "the healthy nodes in sync and the frozen one drifted", func(m map[string][]audit.Finding) bool {
		return len(m["ds-ipt"]) == 0 && len(m["ds-legacy"]) == 0 && len(m["ds-nft"]) > 0
	})
	if *capture {
		save(ctx, t, c, "drift", nil)
	}
	want := map[string]bool{
		"StaleEndpoint default/single-v6 IPv6 [2001:2:0:8001::1]:8080":   true,
		"MissingEndpoint default/single-v6 IPv6 [2001:2:0:8001::9]:8080": true,
		"MissingService default/late IPv4 ":                              true,
		"MissingService default/late IPv6 ":                              true,
	}
	seen := map[string]bool{}
	for _, f := range got["ds-nft"] {
		seen[fmt.Sprintf("%s %s IPv%d %s", f.Kind, f.Service, f.Family, f.Endpoint)] = true
	}
	for w := range want {
		if !seen[w] {
			t.Errorf("ds-nft: missing finding %q; got:\n%s", w, describe(got))
		}
	}
	for s := range seen {
		if !want[s] {
			t.Errorf("ds-nft: unexpected finding %q", s)
		}
	}
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	until(ctx, t, c, time.Minute, "ds-nft in sync once thawed", inSync)

	// An IPv6 table flushed by hand: every IPv6 frontend missing, IPv4
	// untouched, on each kind of node.
	for _, n := range c.Nodes() {
		flush := []string{"ip6tables", "-w", "5", "-t", "nat", "-F"}
		if n.Legacy {
			flush[0] = "ip6tables-legacy"
		}
		if n.Mode == localcluster.ModeNFTables {
			flush = []string{"nft", "flush", "table", "ip6", "kube-proxy"}
		}
		if _, err := n.Exec(ctx, flush...); err != nil {
			t.Fatal(err)
		}
		fs := audit.Diff(audit.ExpectedFor(state(ctx, t, c), n.Name), read(ctx, t, n))
		missing := 0
		for _, f := range fs {
			if f.Family != 6 || f.Kind != audit.MissingService {
				t.Errorf("%s: after flushing the IPv6 table: %s %s IPv%d", n.Name, f.Kind, f.Service, f.Family)
			}
			missing++
		}
		if missing == 0 {
			t.Errorf("%s: flushed IPv6 table not found", n.Name)
		}
		t.Logf("%s: flushed IPv6 table found as %d IPv6 MissingService finding(s), none in IPv4", n.Name, missing)
		if err := n.RestartProxy(ctx); err != nil { // kube-proxy repairs it at its next full sync; a restart is quicker
			t.Fatal(err)
		}
	}
	until(ctx, t, c, time.Minute, "every node in sync after the restarts", inSync)

	// proxyaudit diff: one family's dump of a dual-stack node is not
	// "in sync"; both (two files, or one holding both) are.
	bin := localcluster.BuildForTest(t)
	dir := t.TempDir()
	data, err := c.DumpClusterJSON(ctx)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	clusterFile := write("cluster.json", string(data))
	ipt := c.Node("ds-ipt")
	v4dump, err := ipt.Exec(ctx, "iptables-save", "-t", "nat")
	if err != nil {
		t.Fatal(err)
	}
	v6dump, err := ipt.Exec(ctx, "ip6tables-save", "-t", "nat")
	if err != nil {
		t.Fatal(err)
	}
	diff := func(rules ...string) (string, int) {
		args := []string{"diff", "--cluster", clusterFile}
		for _, r := range rules {
			args = append(args, "--rules", "ds-ipt="+r)
		}
		var out, errb bytes.Buffer
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "proxyaudit"), args...)
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String() + errb.String(), code
	}
	out, code := diff(write("v4.rules", v4dump))
	if code != 3 || !strings.Contains(out, "ds-ipt: IPv6 NOT AUDITED") || strings.Contains(out, "ds-ipt: in sync\n") {
		t.Errorf("diff with the IPv4 dump only: exit %d\n%s", code, out)
	}
	out, code = diff(filepath.Join(dir, "v4.rules"), write("v6.rules", v6dump))
	if code != 0 || !strings.Contains(out, "v4.rules: IPv4") || !strings.Contains(out, "v6.rules: IPv6") || !strings.Contains(out, "ds-ipt: in sync") {
		t.Errorf("diff with both families' dumps: exit %d\n%s", code, out)
	}
	out, code = diff(write("both.rules", v4dump+v6dump))
	if code != 0 || !strings.Contains(out, "ds-ipt: in sync") {
		t.Errorf("diff with one file holding both families: exit %d\n%s", code, out)
	}
	out, code = diff(filepath.Join(dir, "v6.rules"), filepath.Join(dir, "both.rules"))
	if code != 2 || !strings.Contains(out, "IPv6 rules given twice") {
		t.Errorf("diff given IPv6 twice: exit %d\n%s", code, out)
	}
}

// An IPv6-only cluster: kube-proxy's primary family is IPv6 and its IPv4
// tables stay empty by design. No false finding (and no "no rules"); a
// frozen node's stale IPv6 endpoint found.
func TestE2EIPv6Only(t *testing.T) {
	c := cluster(t, localcluster.Config{IPv6Only: true},
		localcluster.NodeSpec{Name: "v6-ipt", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
		localcluster.NodeSpec{Name: "v6-nft", Mode: localcluster.ModeNFTables, Zone: "zone-b"})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	web, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "default"},
		Spec: corev1.ServiceSpec{Type: corev1.ServiceTypeNodePort, Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(web.Spec.ClusterIPs) != 1 || !strings.Contains(web.Spec.ClusterIP, ":") {
		t.Fatalf("a default service got cluster IPs %v: the API server is not IPv6-only", web.Spec.ClusterIPs)
	}
	move := func(ip string) {
		t.Helper()
		if err := c.ApplySlice(ctx, localcluster.Slice(web, "web-1", "http", 8080, corev1.ProtocolTCP, ip)); err != nil {
			t.Fatal(err)
		}
	}
	move("2001:2:0:8002::1")
	until(ctx, t, c, time.Minute, "every node in sync", inSync)
	for _, n := range c.Nodes() {
		obs := read(ctx, t, n)
		v4 := 0
		for _, f := range obs.Frontends {
			if f.Family() == 4 {
				v4++
			}
		}
		if obs.NoRules || v4 > 0 || len(obs.Frontends) < 3 { // default/kubernetes, web's cluster IP and node port
			t.Errorf("%s: no rules %v, %d IPv4 of %d frontends", n.Name, obs.NoRules, v4, len(obs.Frontends))
		}
	}
	ipt := c.Node("v6-ipt")
	thaw, err := ipt.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer thaw(context.Background())
	move("2001:2:0:8002::2")
	got := until(ctx, t, c, time.Minute, "v6-nft in sync and v6-ipt drifted", func(m map[string][]audit.Finding) bool {
		return len(m["v6-nft"]) == 0 && len(m["v6-ipt"]) > 0
	})
	kinds := map[string]bool{}
	for _, f := range got["v6-ipt"] {
		if f.Family != 6 || f.Service != "default/web" {
			t.Errorf("v6-ipt: %s %s IPv%d %s", f.Kind, f.Service, f.Family, f.Endpoint)
		}
		kinds[string(f.Kind)+" "+f.Endpoint] = true
	}
	if !kinds["StaleEndpoint [2001:2:0:8002::1]:8080"] || !kinds["MissingEndpoint [2001:2:0:8002::2]:8080"] {
		t.Errorf("v6-ipt findings: %v", kinds)
	}
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	until(ctx, t, c, time.Minute, "v6-ipt in sync once thawed", inSync)
}

// IPVS mode, dual-stack, in the VM (the host kernel has no IPVS): the
// IPv6 virtual servers (cluster IPs and the node's IPv6 node ports) read
// and in sync; a kube-proxy cut off from the API keeps a stale IPv6 real
// server, found with its family.
func TestE2EDualStackIPVS(t *testing.T) {
	localcluster.NeedRoot(t, true)
	c := cluster(t, localcluster.Config{DualStack: true})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	v, err := c.AddVMNode(ctx, localcluster.NodeSpec{Name: "ds-ipvs", Zone: "zone-a"})
	if err != nil {
		t.Fatal(err)
	}
	prefer, err := c.CreateService(ctx, service("prefer", corev1.IPFamilyPolicyPreferDualStack, []corev1.IPFamily{corev1.IPv4Protocol, corev1.IPv6Protocol}, corev1.ServiceTypeNodePort, false))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*discoveryv1.EndpointSlice{
		localcluster.Slice(prefer, "prefer-v4", "http", 8080, corev1.ProtocolTCP, "198.18.140.2"),
		localcluster.Slice(prefer, "prefer-v6", "http", 8080, corev1.ProtocolTCP, "2001:2:0:8001::2", "2001:2:0:8001::3"),
	} {
		if err := c.ApplySlice(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	audit1 := func() (*audit.Observed, []audit.Finding) {
		dump, err := v.IPVS(ctx)
		if err != nil {
			t.Fatal(err)
		}
		obs, err := dataplane.ParseRules(strings.NewReader(dump))
		if err != nil {
			t.Fatal(err)
		}
		return obs, audit.Diff(audit.ExpectedFor(state(ctx, t, c), v.Name), obs)
	}
	waitFor := func(what string, ok func(*audit.Observed, []audit.Finding) bool) []audit.Finding {
		t.Helper()
		for start := time.Now(); ; time.Sleep(2 * time.Second) {
			obs, fs := audit1()
			if ok(obs, fs) {
				return fs
			}
			if time.Since(start) > 2*time.Minute {
				t.Fatalf("after 2m, still waiting for %s; families %v, findings:\n%s\nkube-proxy:\n%s", what, obs.Families, describe(map[string][]audit.Finding{v.Name: fs}), v.Log("kube-proxy", 20))
			}
		}
	}
	waitFor("the IPVS node in sync with IPv6 virtual servers", func(obs *audit.Observed, fs []audit.Finding) bool {
		v6 := map[bool]int{}
		for _, f := range obs.Frontends {
			if f.Family() == 6 {
				v6[f.NodePort || f.IP.String() == localcluster.VMGuestIP6]++
			}
		}
		return len(fs) == 0 && v6[false] > 0 && v6[true] > 0
	})
	capture := func(dir string) {
		if *capture {
			dump, err := v.IPVS(ctx)
			if err != nil {
				t.Fatal(err)
			}
			save(ctx, t, c, dir, map[string]string{v.Name + ".rules": dump})
		}
	}
	capture("ipvs-clean")
	undo, err := v.HangInformer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer undo(context.Background())
	if err := c.ApplySlice(ctx, localcluster.Slice(prefer, "prefer-v6", "http", 8080, corev1.ProtocolTCP, "2001:2:0:8001::3")); err != nil {
		t.Fatal(err)
	}
	fs := waitFor("the stale IPv6 real server found", func(_ *audit.Observed, fs []audit.Finding) bool { return len(fs) > 0 })
	capture("ipvs-drift")
	for _, f := range fs {
		if f.Family != 6 || f.Kind != audit.StaleEndpoint || f.Endpoint != "[2001:2:0:8001::2]:8080" {
			t.Errorf("finding %s %s IPv%d %s: %s", f.Kind, f.Service, f.Family, f.Endpoint, f.Detail)
		}
	}
}
