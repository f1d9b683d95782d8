// Package realnodes tests proxyaudit where it runs in pods: real nodes
// (each a network namespace with containerd and the genuine kubelet), the
// controller manager and scheduler, kube-proxy as a DaemonSet, CoreDNS,
// and the chart installed with helm.
package realnodes

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
	"github.com/proxyaudit/proxyaudit/internal/release"
)

// The fleet: kube-proxy in both modes the host kernel runs, two zones.
var fleet = []localcluster.KubeletNodeSpec{
	{Name: "real-ipt-a", Mode: localcluster.ModeIPTables, Zone: "zone-a"},
	{Name: "real-ipt-b", Mode: localcluster.ModeIPTables, Zone: "zone-b"},
	{Name: "real-nft-a", Mode: localcluster.ModeNFTables, Zone: "zone-a"},
	// kube-proxy as a static pod (GKE, older kubeadm): its mirror pod
	// cannot be restarted through the API.
	{Name: "real-static", Mode: localcluster.ModeIPTables, Zone: "zone-b", StaticProxy: true},
}

// The package's cluster: the control plane with the controller manager
// and scheduler, the real nodes, kube-proxy's DaemonSets and CoreDNS, all
// Ready. Debugging: PROXYAUDIT_KEEP=1 keeps the cluster's work directory
// (logs, kubeconfigs) after the run; PROXYAUDIT_HOLD=1 holds a failing
// wait for ten minutes so that the cluster can be looked at.
var topology = localcluster.Topology{Kubelets: fleet,
	ProxyModes: []localcluster.Mode{localcluster.ModeIPTables, localcluster.ModeNFTables}, DNS: true}

// shared holds the proxyaudit binaries the tests run (built once).
var shared struct {
	once sync.Once
	bin  string
	err  error
}

func TestMain(m *testing.M) { localcluster.Main(m) }

// cluster is the package's cluster (once per package), with the
// proxyaudit binaries built.
func cluster(t *testing.T) *localcluster.Cluster {
	t.Helper()
	c := localcluster.Up(t, topology)
	shared.once.Do(func() {
		if shared.bin, shared.err = os.MkdirTemp("", "proxyaudit-realnodes-bin-"); shared.err == nil {
			shared.err = localcluster.BuildProxyaudit(shared.bin)
		}
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return c
}

// waitPods waits until want pods match selector in ns, all Ready.
func waitPods(ctx context.Context, t *testing.T, c *localcluster.Cluster, ns, selector string, want int, timeout time.Duration) []corev1.Pod {
	t.Helper()
	pods, err := c.WaitPodsReady(ctx, ns, selector, want, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return pods
}

func TestE2ERealNodesRunKubeProxyAndDNS(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-proxy", len(fleet), 2*time.Minute)
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	for _, n := range c.Nodes() {
		if err := n.WaitRules(ctx, time.Minute, "default/kubernetes programmed by the DaemonSet's kube-proxy", func(rules string) bool {
			return n.RoutesTo(rules, localcluster.APIServerIP+":6443")
		}); err != nil {
			t.Fatalf("%v\nkubelet:\n%s", err, n.KubeletLog(20))
		}
	}
}

// system drives the chart and the CLI on c as users do.
func system(c *localcluster.Cluster) *localcluster.System {
	return &localcluster.System{C: c, Bin: shared.bin}
}

// uninstall removes the chart and the incident record it leaves by design
// (open incidents survive a reinstall): a test's incidents must not hold
// the next test's repairs (the fleet budget counts nodes not yet
// re-audited).
func uninstall(t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	if err := system(c).Uninstall(context.Background()); err != nil {
		t.Error(err)
	}
}

func helm(ctx context.Context, t *testing.T, c *localcluster.Cluster, args ...string) string {
	t.Helper()
	out, err := system(c).Helm(ctx, args...)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// fleetReport is what `proxyaudit report -o json` prints.
type fleetReport = localcluster.Report

// report runs `kubectl proxyaudit report -o json` as the chart's README
// says, through the API server's proxy to the aggregator's pods.
func report(ctx context.Context, t *testing.T, c *localcluster.Cluster) (*fleetReport, string, error) {
	t.Helper()
	return system(c).Report(ctx)
}

// reportFormats runs `kubectl proxyaudit report` in every output format
// against the cluster while node has a finding for service (and only it):
// each format shows it, and the command says findings (status 1).
func reportFormats(ctx context.Context, t *testing.T, c *localcluster.Cluster, node, service string) {
	t.Helper()
	for _, tc := range []struct {
		format string
		shows  func(out string) bool
	}{
		{"table", func(out string) bool { return strings.Contains(out, node) && strings.Contains(out, service) }},
		{"wide", func(out string) bool { return strings.Contains(out, node) && strings.Contains(out, service) }},
		{"markdown", func(out string) bool { return strings.Contains(out, "| ") && strings.Contains(out, service) }},
		{"yaml", func(out string) bool {
			var r fleetReport
			if yaml.Unmarshal([]byte(out), &r) != nil {
				return false
			}
			for _, f := range r.Findings {
				if f.Node == node && f.Service == service {
					return true
				}
			}
			return false
		}},
		{"name", func(out string) bool { return strings.TrimSpace(out) == "node/"+node }},
		{"jsonpath={.findings[*].node}", func(out string) bool {
			return len(strings.Fields(out)) > 0 && !slices.ContainsFunc(strings.Fields(out), func(n string) bool { return n != node })
		}},
		{"custom-columns=NODE:.node,SERVICE:.service", func(out string) bool {
			lines := strings.Split(strings.TrimSpace(out), "\n")
			return len(lines) > 1 && strings.Fields(lines[0])[0] == "NODE" && slices.ContainsFunc(lines[1:], func(l string) bool {
				return slices.Equal(strings.Fields(l), []string{node, service})
			})
		}},
	} {
		out, err := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "report", "-n", "proxyaudit", "-o", tc.format).Output()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 1 || !tc.shows(string(out)) {
			t.Errorf("kubectl proxyaudit report -o %s with a finding on %s: %v (want status 1)\n%s", tc.format, node, err, out)
		}
	}
	t.Logf("kubectl proxyaudit report -o table, wide, markdown, yaml, name, jsonpath, custom-columns: each shows %s's finding", node)
}

// kubectlProxyaudit is `kubectl proxyaudit args...` (the CLI as a kubectl
// plugin) with kubeconfig.
func kubectlProxyaudit(ctx context.Context, t *testing.T, c *localcluster.Cluster, kubeconfig string, args ...string) *exec.Cmd {
	t.Helper()
	cmd, err := system(c).Kubectl(ctx, kubeconfig, args...)
	if err != nil {
		t.Fatal(err)
	}
	return cmd
}

// waitInSync waits for a report with every node in sync and no finding.
// Every node must also have reported after since (zero: any time).
func waitInSync(ctx context.Context, t *testing.T, c *localcluster.Cluster, timeout time.Duration, since time.Time, what string) *fleetReport {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		r, raw, err := report(ctx, t, c)
		if err == nil && r.Stale == nil && inSync(r) == len(fleet) && len(r.Nodes) == len(fleet) && len(r.Findings) == 0 &&
			heardSince(r, since) == len(fleet) {
			return r
		}
		if time.Now().After(deadline) {
			if os.Getenv("PROXYAUDIT_HOLD") != "" { // debugging: look at the cluster before it goes
				t.Logf("HOLD: %s: %v\n%s", what, err, raw)
				time.Sleep(10 * time.Minute)
			}
			t.Fatalf("%s: no report with %d nodes in sync within %s; last: %v\n%s", what, len(fleet), timeout, err, raw)
		}
		time.Sleep(time.Second)
	}
}

// releases are versions of this tree pushed to a registry the real
// nodes trust.
type releases struct {
	reg    *localcluster.Registry
	chart  string            // oci://REGISTRY/charts/proxyaudit
	images map[string]string // by version: the chart's default image, pinned by digest
	dist   map[string]string // by version: make release's output directory
}

// pushReleases runs make release's code for each version (the server
// binaries, the CLI and the image for linux/amd64; no SBOMs), signs the
// image index and the chart with cosign and a key of its own, pushes
// them to a registry on the API server's address, which every real node's
// containerd is told to trust, and verifies both signatures there.
func pushReleases(ctx context.Context, t *testing.T, c *localcluster.Cluster, versions ...string) *releases {
	t.Helper()
	root, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	reg, err := localcluster.StartRegistry(ctx, t.TempDir(), localcluster.APIServerIP)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("registry log:\n%s", reg.Log())
		}
		reg.Stop()
	})
	if err := c.TrustRegistry(reg); err != nil {
		t.Fatal(err)
	}
	helmBin, err := chart.Helm(root)
	if err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	changelog := filepath.Join(t.TempDir(), "CHANGELOG.md")
	var cl strings.Builder
	for _, v := range versions {
		fmt.Fprintf(&cl, "## [%s] - 2026-12-02\n\n", strings.TrimPrefix(v, "v"))
	}
	if err := os.WriteFile(changelog, []byte(cl.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	// Signed with a key of the test's own (offline: no transparency log),
	// verified below as a user would before installing.
	cosignBin, err := localcluster.ReleaseTool(ctx, "cosign")
	if err != nil {
		t.Fatal(err)
	}
	keys := t.TempDir()
	cosignEnv := []string{"COSIGN_PASSWORD=realnodes", "SSL_CERT_FILE=" + reg.CAFile, "HOME=" + t.TempDir(), "TUF_ROOT=" + t.TempDir()}
	cosign := func(dir string, args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, cosignBin, args...)
		cmd.Dir, cmd.Env = dir, append(os.Environ(), cosignEnv...)
		b, err := cmd.CombinedOutput()
		return string(b), err
	}
	if out, err := cosign(keys, "generate-key-pair"); err != nil {
		t.Fatalf("cosign generate-key-pair: %v\n%s", err, out)
	}
	rel := &releases{reg: reg, chart: "oci://" + reg.Addr + "/proxyaudit/charts/proxyaudit", images: map[string]string{}, dist: map[string]string{}}
	amd64 := []release.Platform{{OS: "linux", Arch: "amd64"}}
	for _, v := range versions {
		start := time.Now()
		out := filepath.Join(t.TempDir(), "dist")
		_, err := release.Run(ctx, release.Config{Root: root, Version: v, Out: out, Changelog: changelog, CLI: amd64, Servers: amd64, Image: true,
			Registry: reg.Addr + "/proxyaudit", Push: true, CAFile: reg.CAFile, Helm: helmBin,
			HelmEnv: []string{"HELM_CACHE_HOME=" + home + "/cache", "HELM_CONFIG_HOME=" + home + "/config", "HELM_DATA_HOME=" + home + "/data"},
			Cosign:  cosignBin, SignKey: filepath.Join(keys, "cosign.key"), CosignEnv: cosignEnv})
		if err != nil {
			t.Fatalf("release %s: %v", v, err)
		}
		b, err := os.ReadFile(filepath.Join(out, "image.txt"))
		if err != nil {
			t.Fatal(err)
		}
		first, _, _ := strings.Cut(string(b), "\n")
		rel.images[v] = strings.TrimSpace(first)
		rel.dist[v] = out
		pushed := time.Since(start)
		// The image index and the chart, each by its digest, verified with
		// the release's key.
		tagged, digest, _ := strings.Cut(rel.images[v], "@")
		repo := tagged[:strings.LastIndex(tagged, ":")] // REGISTRY:PORT/proxyaudit/proxyaudit
		chartRef, err := name.ParseReference(reg.Addr + "/proxyaudit/charts/proxyaudit:" + strings.TrimPrefix(v, "v"))
		if err != nil {
			t.Fatal(err)
		}
		chartDesc, err := remote.Head(chartRef, remote.WithContext(ctx), remote.WithTransport(reg.Transport))
		if err != nil {
			t.Fatal(err)
		}
		for _, ref := range []string{repo + "@" + digest, reg.Addr + "/proxyaudit/charts/proxyaudit@" + chartDesc.Digest.String()} {
			if out, err := cosign("", "verify", "--key", filepath.Join(keys, "cosign.pub"), "--insecure-ignore-tlog=true", ref); err != nil {
				t.Fatalf("cosign verify %s: %v\n%s", ref, err, out)
			}
		}
		t.Logf("release %s signed and pushed to %s in %s, index and chart verified: %s", v, reg.Addr, pushed.Round(time.Millisecond), rel.images[v])
	}
	return rel
}

// krewReport installs the release's kubectl plugin with krew (its
// manifest and archive from dist, into a krew root of the test's own) and
// runs `kubectl proxyaudit report` from krew's bin against the cluster,
// as a user who ran `kubectl krew install proxyaudit` would.
func krewReport(ctx context.Context, t *testing.T, c *localcluster.Cluster, dist, version string) {
	t.Helper()
	krew, err := localcluster.ReleaseTool(ctx, "krew")
	if err != nil {
		t.Fatal(err)
	}
	krewRoot := t.TempDir()
	env := append(os.Environ(), "KREW_ROOT="+krewRoot, "KREW_NO_UPGRADE_CHECK=1", "HOME="+t.TempDir(), "KUBECONFIG="+c.AdminKubeconfig,
		"PATH="+filepath.Join(krewRoot, "bin")+":"+os.Getenv("PATH"))
	cmd := exec.CommandContext(ctx, krew, "install", "--manifest", filepath.Join(dist, "krew", "proxyaudit.yaml"),
		"--archive", filepath.Join(dist, "proxyaudit_"+version+"_linux_amd64.tar.gz"))
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("kubectl krew install: %v\n%s", err, out)
	}
	plugin := func(args ...string) ([]byte, error) {
		cmd := exec.CommandContext(ctx, c.Kubectl(), append([]string{"proxyaudit"}, args...)...)
		cmd.Env = env
		return cmd.Output()
	}
	out, err := plugin("version")
	if err != nil || !strings.HasPrefix(string(out), "proxyaudit v"+version+" ") {
		t.Fatalf("kubectl proxyaudit version from krew's bin: %q (%v)", out, err)
	}
	out, err = plugin("report", "-n", "proxyaudit", "-o", "json")
	var r fleetReport
	if jerr := json.Unmarshal(out, &r); jerr != nil || err != nil {
		t.Fatalf("kubectl proxyaudit report from krew's bin: %v (%v)\n%s", err, jerr, out)
	}
	if inSync(&r) != len(fleet) || len(r.Findings) != 0 {
		t.Fatalf("kubectl proxyaudit report from krew's bin: %d of %d nodes in sync, %d findings", inSync(&r), len(fleet), len(r.Findings))
	}
	t.Logf("krew installed the release's plugin; kubectl proxyaudit report from krew's bin: %d nodes in sync", inSync(&r))

	// kubectl's own completion completes the plugin's words once the
	// script the plugin writes is on PATH as kubectl_complete-proxyaudit
	// (as its help says, in krew's bin): a verb, and the cluster's nodes.
	script, err := plugin("completion", "kubectl")
	if err != nil {
		t.Fatalf("kubectl proxyaudit completion kubectl: %v", err)
	}
	if err := os.WriteFile(filepath.Join(krewRoot, "bin", "kubectl_complete-proxyaudit"), script, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ args, want []string }{
		{[]string{"rep"}, []string{"report"}},
		{[]string{"explain", "node", "real-"}, []string{"real-ipt-a", "real-nft-a", "real-static"}},
	} {
		cmd := exec.CommandContext(ctx, c.Kubectl(), append([]string{"__complete", "proxyaudit"}, tc.args...)...)
		cmd.Env = env
		out, err := cmd.Output()
		for _, w := range tc.want {
			if err != nil || !strings.Contains(string(out), w+"\n") && !strings.Contains(string(out), w+"\t") {
				t.Errorf("kubectl __complete proxyaudit %s: %v\n%s; want %s", strings.Join(tc.args, " "), err, out, w)
			}
		}
	}
}

// checkCollectorVersions: every node's collector says it is version v.
func checkCollectorVersions(t *testing.T, r *fleetReport, v string) {
	t.Helper()
	for _, n := range r.Nodes {
		if n.Collector == nil || !strings.HasPrefix(n.Collector.Version, v+" ") && n.Collector.Version != v {
			t.Errorf("node %s: collector version %+v, want %s", n.Node, n.Collector, v)
		}
	}
}

// setImages sets the image of the aggregators' Deployment and of the
// collectors' DaemonSet, as a roll leaves them halfway.
func setImages(ctx context.Context, t *testing.T, c *localcluster.Cluster, aggregator, collector string) {
	t.Helper()
	apps := c.Client.AppsV1()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		d, err := apps.Deployments("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
		if err != nil {
			return err
		}
		d.Spec.Template.Spec.Containers[0].Image = aggregator
		_, err = apps.Deployments("proxyaudit").Update(ctx, d, metav1.UpdateOptions{})
		return err
	})
	if err == nil {
		err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
			ds, err := apps.DaemonSets("proxyaudit").Get(ctx, "proxyaudit-collector", metav1.GetOptions{})
			if err != nil {
				return err
			}
			ds.Spec.Template.Spec.Containers[0].Image = collector
			_, err = apps.DaemonSets("proxyaudit").Update(ctx, ds, metav1.UpdateOptions{})
			return err
		})
	}
	if err != nil {
		t.Fatalf("setting the images: %v", err)
	}
}

// waitImages waits until want pods of component sel are Ready, every one
// running image.
func waitImages(ctx context.Context, t *testing.T, c *localcluster.Cluster, sel string, want int, image string) {
	t.Helper()
	for deadline := time.Now().Add(3 * time.Minute); ; time.Sleep(time.Second) {
		var other []string
		for _, p := range waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component="+sel, want, 3*time.Minute) {
			if p.Spec.Containers[0].Image != image {
				other = append(other, p.Name+" "+p.Spec.Containers[0].Image)
			}
		}
		if len(other) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s pods not all on %s within 3 minutes: %s", sel, image, strings.Join(other, ", "))
		}
	}
}

// The README's quickstart on real nodes: helm install, every pod Ready,
// the collectors in their pods read every node's rules, the report says
// in sync; then the leading aggregator's pod is deleted.
func TestE2EChartOnRealNodes(t *testing.T) {
	c := cluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	waitPods(ctx, t, c, "kube-system", "k8s-app=kube-dns", 1, 2*time.Minute)
	// As a stranger installs it: releases v0.1.0 and v0.1.1 (make release)
	// pushed to a genuine registry the nodes' containerd trusts; helm
	// installs the chart from the registry, and the nodes pull the image
	// it pins by digest (nothing imported).
	rel := pushReleases(ctx, t, c, "v0.1.0", "v0.1.1")
	start := time.Now()
	// With the OpenReports CRD (the chart installs it, as Kyverno or
	// Policy Reporter would): findings are ClusterReports too. A grace of
	// 10 s: the faults below are found 20 s sooner each.
	helm(ctx, t, c, "install", "proxyaudit", rel.chart, "--version", "0.1.0", "--ca-file", rel.reg.CAFile,
		"--namespace", "proxyaudit", "--create-namespace", "--set", "openReports.installCRD=true", "--set", "grace=10s")
	for _, sel := range []string{"collector", "aggregator"} {
		pods := waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component="+sel, map[string]int{"collector": len(fleet), "aggregator": 2}[sel], 3*time.Minute)
		for _, p := range pods {
			if img := p.Spec.Containers[0].Image; img != rel.images["v0.1.0"] {
				t.Errorf("pod %s runs %s, want the release's %s", p.Name, img, rel.images["v0.1.0"])
			}
		}
	}
	t.Logf("helm install oci://%s: every pod Ready after %s, each running %s pulled from the registry", strings.TrimPrefix(rel.chart, "oci://"),
		time.Since(start).Round(time.Millisecond), rel.images["v0.1.0"])
	r := waitInSync(ctx, t, c, 3*time.Minute, time.Time{}, "after helm install")
	t.Logf("report: %d nodes in sync %s after helm install", r.Summary.NodesInSync, time.Since(start).Round(time.Millisecond))
	checkCollectorVersions(t, r, "v0.1.0")
	krewReport(ctx, t, c, rel.dist["v0.1.0"], "0.1.0")

	// The leader's pod is deleted as a node drain or a rollout deletes it.
	lease, err := c.Client.CoordinationV1().Leases("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil || lease.Spec.HolderIdentity == nil {
		t.Fatalf("the aggregators' Lease: %v", err)
	}
	old := *lease.Spec.HolderIdentity
	aggs := waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, time.Minute)
	var oldLeader string
	for _, p := range aggs {
		if strings.HasPrefix(old, p.Status.PodIP+":") {
			oldLeader = p.Name
		}
	}
	if oldLeader == "" {
		t.Fatalf("no aggregator pod holds the Lease (holder %s)", old)
	}
	killed := time.Now()
	if err := c.Client.CoreV1().Pods("proxyaudit").Delete(ctx, oldLeader, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	var took time.Duration
	for {
		l, err := c.Client.CoordinationV1().Leases("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
		if err == nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != "" && *l.Spec.HolderIdentity != old {
			took = time.Since(killed)
			t.Logf("leader pod %s deleted: %s holds the Lease after %s", oldLeader, *l.Spec.HolderIdentity, took.Round(time.Millisecond))
			break
		}
		if time.Since(killed) > time.Minute {
			t.Fatalf("no new leader within a minute of deleting %s (holder %v)", oldLeader, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	r = waitInSync(ctx, t, c, 2*time.Minute, killed, "after the leader's pod was deleted")
	t.Logf("every collector heard again %s after the leader's pod was deleted; %d in sync, no finding",
		time.Since(killed).Round(time.Millisecond), r.Summary.NodesInSync)
	waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component=aggregator", 2, 2*time.Minute)

	// Both pairings of a roll, held still and audited (the stream's rule
	// is N-1 <-> N): aggregators of 0.1.1 judging collectors of 0.1.0, then
	// aggregators of 0.1.0 judging collectors of 0.1.1, as a roll leaves
	// them whichever controller goes first. A kube-proxy frozen behind a
	// service's change is found on its node by both, the others in sync.
	svc, err := c.CreateService(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "probe", Namespace: "default"},
		Spec: corev1.ServiceSpec{Ports: []corev1.ServicePort{{Name: "http", Port: 80, Protocol: corev1.ProtocolTCP}}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.ApplySlice(ctx, localcluster.Slice(svc, "probe-1", "http", 8080, corev1.ProtocolTCP, "198.18.250.1")); err != nil {
		t.Fatal(err)
	}
	waitInSync(ctx, t, c, 2*time.Minute, time.Now(), "after the probe service was made")
	frozen := c.Node("real-ipt-a")
	thaw, err := frozen.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer thaw(context.Background())
	if err := c.ApplySlice(ctx, localcluster.Slice(svc, "probe-1", "http", 8080, corev1.ProtocolTCP, "198.18.250.3")); err != nil {
		t.Fatal(err)
	}
	for _, pair := range []struct{ agg, col string }{{"v0.1.1", "v0.1.0"}, {"v0.1.0", "v0.1.1"}} {
		began := time.Now()
		setImages(ctx, t, c, rel.images[pair.agg], rel.images[pair.col])
		waitImages(ctx, t, c, "aggregator", 2, rel.images[pair.agg])
		waitImages(ctx, t, c, "collector", len(fleet), rel.images[pair.col])
		rolled := time.Since(began)
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
			r, raw, err := report(ctx, t, c)
			leader, leaderImage := leaderPod(ctx, c), ""
			if p, perr := c.Client.CoreV1().Pods("proxyaudit").Get(ctx, leader, metav1.GetOptions{}); leader != "" && perr == nil {
				leaderImage = p.Spec.Containers[0].Image
			}
			if err == nil && leaderImage == rel.images[pair.agg] && len(r.Nodes) == len(fleet) && heardSince(r, began) == len(fleet) {
				var on []string
				versions, other, probe := 0, 0, false
				for _, n := range r.Nodes {
					if n.Collector != nil && strings.HasPrefix(n.Collector.Version+" ", pair.col+" ") {
						versions++
					}
				}
				for _, f := range r.Findings {
					if f.Node == frozen.Name {
						on = append(on, strings.TrimSpace(string(f.Kind)+" "+f.Service))
						probe = probe || f.Service == "default/probe"
					} else {
						other++
					}
				}
				if versions == len(fleet) && probe && other == 0 && inSync(r) == len(fleet)-1 {
					t.Logf("aggregator %s (leader %s) with collectors %s: rolled in %s; %s found on %s, %d nodes in sync, no other finding, %s after the images were set",
						pair.agg, leader, pair.col, rolled.Round(time.Millisecond), strings.Join(on, ", "), frozen.Name, inSync(r), time.Since(began).Round(time.Millisecond))
					if pair.agg == "v0.1.0" {
						reportFormats(ctx, t, c, frozen.Name, "default/probe")
					}
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("aggregator %s with collectors %s: no report finding only the frozen kube-proxy on %s within 2 minutes; last: leader %q (%s): %v\n%s",
					pair.agg, pair.col, frozen.Name, leader, leaderImage, err, raw)
			}
		}
	}
	// Healed as the page says: its kube-proxy pod deleted.
	if err := thaw(ctx); err != nil {
		t.Fatal(err)
	}
	if p := kubeProxyPod(ctx, t, c, frozen.Name); p != nil {
		if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitInSync(ctx, t, c, 2*time.Minute, time.Now(), "after the frozen kube-proxy was restarted")

	// helm upgrade to the next release with changed values rolls every
	// pod, collectors and aggregators of both versions talking to each
	// other on the way: no false finding.
	before := map[string]bool{}
	for _, sel := range []string{"collector", "aggregator"} {
		for _, p := range waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component="+sel, map[string]int{"collector": len(fleet), "aggregator": 2}[sel], time.Minute) {
			before[string(p.UID)] = true
		}
	}
	// What the upgrade must leave alone: every node's kube-proxy pod (no
	// repair while both versions run), the stream's CA and certificate and
	// the incident record the aggregator made.
	kept := func() map[string]string {
		m := map[string]string{}
		pods, err := c.Client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil {
				m["kube-proxy pod on "+p.Spec.NodeName] = string(p.UID)
			}
		}
		if s, err := c.Client.CoreV1().Secrets("proxyaudit").Get(ctx, "proxyaudit-aggregator-tls", metav1.GetOptions{}); err == nil {
			m["Secret proxyaudit-aggregator-tls"] = string(s.UID)
		}
		for _, name := range []string{"proxyaudit-aggregator-incidents", "proxyaudit-aggregator-pause"} {
			if cm, err := c.Client.CoreV1().ConfigMaps("proxyaudit").Get(ctx, name, metav1.GetOptions{}); err == nil {
				m["ConfigMap "+name] = string(cm.UID)
			}
		}
		return m
	}
	// An operator pauses repairs for the upgrade: the pause must outlive it.
	if out, err := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "pause", "-n", "proxyaudit", "--reason", "upgrading to 0.1.1", "--for", "30m").CombinedOutput(); err != nil {
		t.Fatalf("kubectl proxyaudit pause: %v\n%s", err, out)
	}
	keptBefore := kept()
	// During the roll: reports in which every node was in sync while the
	// collectors ran both versions (audited by an aggregator of either).
	mixed := 0
	watch := watchFindings(ctx, t, c, func(r *fleetReport) {
		versions := map[string]bool{}
		for _, n := range r.Nodes {
			if n.Collector != nil {
				v, _, _ := strings.Cut(n.Collector.Version, " ")
				versions[v] = true
			}
		}
		if len(versions) > 1 && inSync(r) == len(fleet) && len(r.Findings) == 0 {
			mixed++
		}
	})
	upgraded := time.Now()
	// --reset-then-reuse-values, as the chart README says: --reuse-values
	// keeps the old chart's defaults, its pinned image among them (seen
	// here: every pod rolled for the new values and still ran 0.1.0).
	helm(ctx, t, c, "upgrade", "proxyaudit", rel.chart, "--version", "0.1.1", "--ca-file", rel.reg.CAFile, "--namespace", "proxyaudit", "--reset-then-reuse-values",
		"--set", "remediation.mode=restart", "--set", "remediation.maxUnhealthy=50%", "--set", "collector.interval=5s")
	rolled := func(sel string, want int) {
		deadline := time.Now().Add(3 * time.Minute)
		for {
			pods := waitPods(ctx, t, c, "proxyaudit", "app.kubernetes.io/component="+sel, want, 3*time.Minute)
			fresh := 0
			for _, p := range pods {
				if !before[string(p.UID)] {
					fresh++
					if img := p.Spec.Containers[0].Image; img != rel.images["v0.1.1"] {
						t.Fatalf("helm upgrade to 0.1.1: pod %s runs %s, want %s", p.Name, img, rel.images["v0.1.1"])
					}
				}
			}
			if fresh == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("helm upgrade: %d of %d %s pods rolled", fresh, want, sel)
			}
			time.Sleep(time.Second)
		}
	}
	rolled("collector", len(fleet))
	rolled("aggregator", 2)
	r = waitInSync(ctx, t, c, 2*time.Minute, time.Now(), "after helm upgrade")
	if fs := watch(); len(fs) > 0 {
		t.Errorf("false findings while helm upgrade rolled every pod:\n  %s", strings.Join(fs, "\n  "))
	}
	checkCollectorVersions(t, r, "v0.1.1")
	// Not required: in a clean-clone run no sampled report caught the two
	// versions with every node in sync (a node whose collector restarts is
	// not in sync until its first report); the count is logged below.
	keptAfter := kept()
	for what, uid := range keptBefore {
		if keptAfter[what] != uid {
			t.Errorf("helm upgrade to 0.1.1 replaced or removed %s", what)
		}
	}
	if out, err := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "pause", "-n", "proxyaudit", "--status").CombinedOutput(); err != nil ||
		!strings.HasPrefix(string(out), "paused ") || !strings.Contains(string(out), "upgrading to 0.1.1") {
		t.Errorf("after helm upgrade to 0.1.1, the pause is not kept: %v\n%s", err, out)
	}
	if out, err := kubectlProxyaudit(ctx, t, c, c.AdminKubeconfig, "resume", "-n", "proxyaudit").CombinedOutput(); err != nil {
		t.Fatalf("kubectl proxyaudit resume: %v\n%s", err, out)
	}
	t.Logf("helm upgrade to 0.1.1: every pod rolled and in sync %s after it, no finding on the way (%d reports with both collector versions, every node in sync); kept: %s",
		time.Since(upgraded).Round(time.Millisecond), mixed, strings.Join(slices.Sorted(maps.Keys(keptBefore)), ", "))

	// A kube-proxy pod whose API connection died (the watch hangs, its
	// health check stays green): found past grace, its pod deleted by
	// remediation, recreated by the DaemonSet controller, healed.
	stuck := c.Node("real-ipt-b")
	oldPod := kubeProxyPod(ctx, t, c, stuck.Name)
	undo, err := stuck.DropAPIConnection(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer undo(context.Background())
	watch = watchFindings(ctx, t, c)
	reports := watchReports(ctx, t, c)
	defer reports.stop()
	if err := c.ApplySlice(ctx, localcluster.Slice(svc, "probe-1", "http", 8080, corev1.ProtocolTCP, "198.18.250.1")); err != nil {
		t.Fatal(err)
	}
	changed := time.Now()
	var newPod *corev1.Pod
	for {
		if p := kubeProxyPod(ctx, t, c, stuck.Name); p != nil && p.UID != oldPod.UID {
			newPod = p
			break
		}
		if time.Since(changed) > 3*time.Minute {
			t.Fatalf("the stuck kube-proxy pod %s on %s was not replaced within 3 minutes; findings seen: %v", oldPod.Name, stuck.Name, watch())
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("stuck kube-proxy: pod %s deleted and %s made by the DaemonSet controller %s after the change (grace 10s)",
		oldPod.Name, newPod.Name, time.Since(changed).Round(time.Millisecond))
	if err := stuck.WaitRules(ctx, 2*time.Minute, "the probe service programmed by the new kube-proxy", func(rules string) bool {
		return stuck.RoutesTo(rules, "198.18.250.1:8080")
	}); err != nil {
		t.Fatal(err)
	}
	waitInSync(ctx, t, c, 2*time.Minute, time.Now(), "after the stuck node was healed")
	seen := watch()
	var stuckSeen bool
	for _, f := range seen {
		if strings.Contains(f, string(audit.StuckProxy)) && strings.Contains(f, stuck.Name) {
			stuckSeen = true
		} else if !strings.Contains(f, stuck.Name) {
			t.Errorf("a finding on a healthy node: %s", f)
		}
	}
	if !stuckSeen {
		t.Errorf("no StuckProxy finding on %s before it was healed; seen: %v", stuck.Name, seen)
	}
	t.Logf("healed: %s in sync %s after the change", stuck.Name, time.Since(changed).Round(time.Millisecond))
	// Its ClusterReport (OpenReports) came with the finding and went with
	// it; no other node had one.
	reports.waitSaw(t, 30*time.Second, "DELETED", openreports.Name(stuck.Name), "")
	if !reports.saw("ADDED", openreports.Name(stuck.Name), "proxyaudit/StuckProxy") {
		t.Errorf("no ClusterReport of %s with a proxyaudit/StuckProxy result; seen: %v", stuck.Name, reports.seen())
	}
	for _, e := range reports.seen() {
		if !strings.Contains(e, openreports.Name(stuck.Name)) {
			t.Errorf("a ClusterReport of a healthy node: %s", e)
		}
	}
	t.Logf("OpenReports: %s", strings.Join(reports.seen(), "; "))
	reports.stop()

	// A static kube-proxy that gets stuck: paged with what to do, its
	// mirror pod never deleted; healed as the page says.
	static := c.Node("real-static")
	mirror := kubeProxyPod(ctx, t, c, static.Name)
	if mirror == nil || mirror.Annotations["kubernetes.io/config.mirror"] == "" {
		t.Fatalf("no mirror pod of the static kube-proxy on %s: %v", static.Name, mirror)
	}
	undoStatic, err := static.DropAPIConnection(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer undoStatic(context.Background())
	watch = watchFindings(ctx, t, c)
	if err := c.ApplySlice(ctx, localcluster.Slice(svc, "probe-1", "http", 8080, corev1.ProtocolTCP, "198.18.250.2")); err != nil {
		t.Fatal(err)
	}
	changed = time.Now()
	var paged string
	for paged == "" {
		evs, err := c.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=" + static.Name})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range evs.Items {
			if strings.Contains(e.Message, "static pod") {
				paged = e.Reason + ": " + e.Message
			}
		}
		if time.Since(changed) > 2*time.Minute {
			var seen []string
			for _, e := range evs.Items {
				seen = append(seen, e.Reason+": "+e.Message)
			}
			t.Fatalf("no page about the static kube-proxy on %s within 2 minutes; findings: %v\nits events:\n  %s\naggregators:\n%s",
				static.Name, watch(), strings.Join(seen, "\n  "), aggregatorLogs(ctx, c, static.Name))
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("static kube-proxy stuck: paged %s after the change: %s", time.Since(changed).Round(time.Millisecond), clip(paged))
	time.Sleep(30 * time.Second) // three grace periods: a loop would have deleted it by now
	if now := kubeProxyPod(ctx, t, c, static.Name); now == nil || now.UID != mirror.UID {
		t.Errorf("the static kube-proxy's mirror pod was replaced: %v -> %v", mirror.UID, now)
	}
	if fs := watch(); !slices.ContainsFunc(fs, func(f string) bool { return strings.HasPrefix(f, string(audit.StuckProxy)+" "+static.Name) }) {
		t.Errorf("no StuckProxy on %s: %v", static.Name, fs)
	}
	// What the page says to do: move the manifest out and back.
	// Out of the directory: the kubelet reads every file in it, whatever
	// its name.
	manifest := filepath.Join(static.StaticPodDir(), "kube-proxy.yaml")
	aside := filepath.Join(filepath.Dir(static.StaticPodDir()), "kube-proxy.yaml.aside")
	if err := os.Rename(manifest, aside); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Minute); kubeProxyPod(ctx, t, c, static.Name) != nil; time.Sleep(500 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the static kube-proxy's mirror pod is still there 2 minutes after its manifest left the directory")
		}
	}
	if err := os.Rename(aside, manifest); err != nil {
		t.Fatal(err)
	}
	waitInSync(ctx, t, c, 2*time.Minute, time.Now(), "after the static kube-proxy's manifest went out and back")
	t.Logf("static kube-proxy healed by its manifest moved out and back, %s after the change", time.Since(changed).Round(time.Millisecond))

	// The collector's container as the chart runs it reads the rules; the
	// same without CAP_NET_ADMIN says which capability it lacks.
	ds, err := c.Client.AppsV1().DaemonSets("proxyaudit").Get(ctx, "proxyaudit-collector", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	once := func(name string, drop corev1.Capability) (corev1.PodPhase, string) {
		spec := ds.Spec.Template.Spec.DeepCopy()
		spec.NodeName, spec.RestartPolicy = "real-ipt-a", corev1.RestartPolicyNever
		ctr := &spec.Containers[0]
		ctr.Args = []string{"--once"}
		var caps []corev1.Capability
		for _, cp := range ctr.SecurityContext.Capabilities.Add {
			if cp != drop {
				caps = append(caps, cp)
			}
		}
		ctr.SecurityContext.Capabilities.Add = caps
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "proxyaudit"}, Spec: *spec}
		if _, err := c.Client.CoreV1().Pods("proxyaudit").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
			p, err := c.Client.CoreV1().Pods("proxyaudit").Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
				logs, err := c.Client.CoreV1().Pods("proxyaudit").GetLogs(name, &corev1.PodLogOptions{}).DoRaw(ctx)
				if err != nil {
					t.Fatalf("logs of %s: %v", name, err)
				}
				if err := c.Client.CoreV1().Pods("proxyaudit").Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
					t.Fatal(err)
				}
				return p.Status.Phase, string(logs)
			}
			if time.Now().After(deadline) {
				t.Fatalf("pod %s did not finish: %s", name, p.Status.Phase)
			}
		}
	}
	if phase, logs := once("collector-once", ""); phase != corev1.PodSucceeded || !strings.Contains(logs, `"mode": "iptables (nf_tables backend, netlink)"`) {
		t.Errorf("the collector's container as the chart runs it, --once: %s\n%s", phase, clip(logs))
	}
	if phase, logs := once("collector-once-no-net-admin", "NET_ADMIN"); phase != corev1.PodFailed || !strings.Contains(logs, "CAP_NET_ADMIN") {
		t.Errorf("without NET_ADMIN the collector must fail naming it: %s\n%s", phase, clip(logs))
	} else {
		t.Logf("without NET_ADMIN: %s", clip(logs))
	}

	// helm uninstall leaves nothing but what the chart's README says.
	helm(ctx, t, c, "uninstall", "proxyaudit", "--namespace", "proxyaudit", "--wait")
	// The reports go with the chart's ClusterRole, their owner (the CRD
	// stays: other tools' reports live in it).
	waitNoReports(ctx, t, c, 2*time.Minute)
	// Pods end after their controllers are gone, with their grace period.
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(time.Second) {
		pods, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d pods still in namespace proxyaudit 2 minutes after helm uninstall", len(pods.Items))
		}
	}
	left := leftInNamespace(ctx, t, c, "proxyaudit")
	documented := map[string]bool{
		// What the aggregator made, named in the chart's README: kept for a
		// reinstall (the CA collectors trust, open incidents), or harmless
		// (the leader election's Lease).
		"Secret proxyaudit-aggregator-tls":          true,
		"ConfigMap proxyaudit-aggregator-incidents": true,
		"Lease proxyaudit-aggregator":               true,
		"ConfigMap kube-root-ca.crt":                true, // every namespace's, made by the controller manager
		"ServiceAccount default":                    true, // every namespace's
	}
	for _, o := range left {
		if !documented[o] {
			t.Errorf("helm uninstall left %s in namespace proxyaudit", o)
		}
	}
	for _, o := range clusterScopedOf(ctx, t, c, "proxyaudit") {
		if o != "Namespace proxyaudit" { // --create-namespace's; Helm never deletes namespaces
			t.Errorf("helm uninstall left cluster-scoped %s", o)
		}
	}
	t.Logf("helm uninstall left only: %s", strings.Join(left, ", "))
}

// leftInNamespace lists every object of every listable namespaced kind in
// ns ("Kind name"), Events aside.
func leftInNamespace(ctx context.Context, t *testing.T, c *localcluster.Cluster, ns string) []string {
	t.Helper()
	return listAll(ctx, t, c, true, func(u *unstructured.Unstructured) bool { return u.GetNamespace() == ns })
}

// clusterScopedOf lists cluster-scoped objects whose name or instance
// label says they belong to release.
func clusterScopedOf(ctx context.Context, t *testing.T, c *localcluster.Cluster, release string) []string {
	t.Helper()
	return listAll(ctx, t, c, false, func(u *unstructured.Unstructured) bool {
		return strings.Contains(u.GetName(), release) || u.GetLabels()["app.kubernetes.io/instance"] == release
	})
}

func listAll(ctx context.Context, t *testing.T, c *localcluster.Cluster, namespaced bool, keep func(*unstructured.Unstructured) bool) []string {
	t.Helper()
	dc, err := discovery.NewDiscoveryClientForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	lists, err := dc.ServerPreferredResources()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range lists {
		gv, err := schema.ParseGroupVersion(l.GroupVersion)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range l.APIResources {
			if r.Namespaced != namespaced || !slices.Contains(r.Verbs, "list") || r.Kind == "Event" {
				continue
			}
			items, err := dyn.Resource(gv.WithResource(r.Name)).List(ctx, metav1.ListOptions{})
			if err != nil {
				t.Fatalf("list %s: %v", r.Name, err)
			}
			for i := range items.Items {
				if keep(&items.Items[i]) {
					out = append(out, r.Kind+" "+items.Items[i].GetName())
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

// kubeProxyPod is the DaemonSet's kube-proxy pod on node (not being
// deleted), or nil.
func kubeProxyPod(ctx context.Context, t *testing.T, c *localcluster.Cluster, node string) *corev1.Pod {
	t.Helper()
	return systemPod(ctx, t, c, "k8s-app=kube-proxy", node)
}

// systemPod is the pod in kube-system matching selector on node that is
// not being deleted, or nil.
func systemPod(ctx context.Context, t *testing.T, c *localcluster.Cluster, selector, node string) *corev1.Pod {
	t.Helper()
	return systemPodIn(ctx, t, c, "kube-system", selector, node)
}

// systemPodIn is systemPod in namespace ns.
func systemPodIn(ctx context.Context, t *testing.T, c *localcluster.Cluster, ns, selector, node string) *corev1.Pod {
	t.Helper()
	p, err := system(c).Pod(ctx, ns, selector, node)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// watchFindings polls the report every second until the returned function
// is called, and returns every distinct finding seen ("Kind node
// service").
func watchFindings(ctx context.Context, t *testing.T, c *localcluster.Cluster, also ...func(*fleetReport)) func() []string {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	var mu sync.Mutex
	seen := map[string]bool{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			if r, _, err := report(ctx, t, c); err == nil {
				mu.Lock()
				for _, f := range r.Findings {
					seen[fmt.Sprintf("%s %s %s", f.Kind, f.Node, f.Service)] = true
				}
				for _, f := range also {
					f(r)
				}
				mu.Unlock()
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}()
	return func() []string {
		cancel()
		<-done
		mu.Lock()
		defer mu.Unlock()
		out := make([]string, 0, len(seen))
		for f := range seen {
			out = append(out, f)
		}
		return out
	}
}

// inSync counts the nodes judged in sync.
func inSync(r *fleetReport) int { return r.InSync() }

// heardSince counts the nodes whose last report came after since.
func heardSince(r *fleetReport, since time.Time) int {
	n := 0
	for _, s := range r.Nodes {
		if s.LastReport.After(since) {
			n++
		}
	}
	return n
}

func clip(s string) string {
	if len(s) > 600 {
		return s[:600] + "…"
	}
	return s
}

// collectorLog returns the last n lines of the log of the collector pod
// on node, for a failure's message.
func collectorLog(ctx context.Context, c *localcluster.Cluster, node string, n int) string {
	pods, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=collector",
		FieldSelector: "spec.nodeName=" + node})
	if err != nil || len(pods.Items) == 0 {
		return fmt.Sprintf("no collector pod on %s (%v)", node, err)
	}
	b, err := c.Client.CoreV1().Pods("proxyaudit").GetLogs(pods.Items[0].Name, &corev1.PodLogOptions{TailLines: ptr.To(int64(n))}).DoRaw(ctx)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		out = append(out, clip(l))
	}
	return strings.Join(out, "\n")
}

// aggregatorLogs returns the aggregator pods' log lines that mention
// what, for a failure's message.
func aggregatorLogs(ctx context.Context, c *localcluster.Cluster, what string) string {
	pods, err := c.Client.CoreV1().Pods("proxyaudit").List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=aggregator"})
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, p := range pods.Items {
		b, err := c.Client.CoreV1().Pods("proxyaudit").GetLogs(p.Name, &corev1.PodLogOptions{}).DoRaw(ctx)
		if err != nil {
			out = append(out, p.Name+": "+err.Error())
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.Contains(l, what) || strings.Contains(l, "remediation") || strings.Contains(strings.ToLower(l), "slack") ||
				strings.Contains(l, "replicas") || strings.Contains(l, "leading") ||
				strings.Contains(l, `"level":"error"`) {
				out = append(out, p.Name+": "+clip(l))
			}
		}
	}
	if len(out) > 40 {
		out = out[len(out)-40:]
	}
	return strings.Join(out, "\n")
}
