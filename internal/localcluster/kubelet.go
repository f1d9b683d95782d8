package localcluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// Real nodes: a network namespace with its own containerd and the genuine
// kubelet, so that the chart's pods, kube-proxy's DaemonSet and the
// controllers behind them run as they do in a cluster (the facts this
// rests on are in ../shared/TESTBED.md, "Real kubelet nodes"). The first
// real node starts kube-controller-manager and kube-scheduler and builds
// the images (make image -all) the nodes import: nothing can be pulled.

// KubeletNodeSpec describes a real node.
type KubeletNodeSpec struct {
	Name string
	// Mode labels the node for the kube-proxy DaemonSet of that mode
	// (DeployKubeProxy), or is the static pod's mode.
	Mode Mode
	// StaticProxy runs kube-proxy as a static pod instead
	// (StaticKubeProxy); no DaemonSet's pod runs here.
	StaticProxy bool
	// Zone is the topology.kubernetes.io/zone label; empty means none.
	Zone string
	// Labels are more node labels (the kubelet sets them at registration).
	Labels map[string]string
}

// realNode is what a real node runs beside the namespace.
type realNode struct {
	dir        string
	podCIDR    string
	containerd *process
	kubelet    *process
	socket     string
}

// PodCIDR is the pod range of a real node (its bridge's subnet).
func (n *Node) PodCIDR() string {
	if n.real == nil {
		return ""
	}
	return n.real.podCIDR
}

// Real reports whether the node runs a kubelet.
func (n *Node) Real() bool { return n.real != nil }

// AddKubeletNode creates a real node and returns once the kubelet has
// registered it and it is Ready. kube-proxy comes as a pod: the
// DaemonSet's (DeployKubeProxy) or, with StaticProxy, a static pod.
func (c *Cluster) AddKubeletNode(ctx context.Context, spec KubeletNodeSpec) (*Node, error) {
	if c.cfg.Instance != 0 {
		return nil, fmt.Errorf("node %s: real nodes run only in the first local cluster instance", spec.Name)
	}
	if !machineLane() {
		return nil, fmt.Errorf("node %s: real nodes run only in lane 0 (%s=%s): their cgroups and the host's forwarding are the machine's", spec.Name, laneEnv, lane())
	}
	if err := c.ensureControlPlane(ctx); err != nil {
		return nil, err
	}
	n, err := c.newNodeNet(ctx, spec.Name, spec.Mode, spec.Zone)
	if err != nil {
		return nil, err
	}
	r := &realNode{dir: filepath.Join(c.Dir, "nodes", n.Name), podCIDR: fmt.Sprintf("198.18.%d.0/24", 128+n.Index)}
	n.real = r
	r.socket = filepath.Join(r.dir, "containerd.sock")
	for _, d := range []string{"cni", "manifests", "kubelet", "containerd", "ipam"} {
		if err := os.MkdirAll(filepath.Join(r.dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	// Pods of this node are reached through it (no overlay): one route on
	// the host, forwarding in the node.
	for _, argv := range [][]string{
		{"ip", "route", "replace", r.podCIDR, "via", n.IP},
		{"ip", "netns", "exec", n.NetNS, "sysctl", "-qw", "net.ipv4.ip_forward=1"},
	} {
		if _, err := run(ctx, argv...); err != nil {
			return nil, fmt.Errorf("node %s pod network: %w", n.Name, err)
		}
	}
	if err := makeCgroupRoot(namePrefix + n.Name); err != nil {
		return nil, err
	}
	if err := c.startContainerd(ctx, n); err != nil {
		return nil, err
	}
	if spec.Mode == ModeCilium {
		if spec.StaticProxy {
			return nil, fmt.Errorf("node %s: Cilium runs as its DaemonSet (DeployCilium), not a static pod", n.Name)
		}
		if err := c.prepareCiliumKubelet(ctx, n); err != nil {
			return nil, err
		}
	}
	if spec.StaticProxy {
		if err := c.StaticKubeProxy(n, spec.Mode); err != nil {
			return nil, err
		}
	}
	if err := c.startKubelet(ctx, n, spec); err != nil {
		return nil, err
	}
	if spec.Mode == ModeCilium {
		if err := c.ciliumPodCIDR(ctx, n, n.real.podCIDR); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// StaticPodDir is where the node's kubelet reads static pod manifests.
func (n *Node) StaticPodDir() string { return filepath.Join(n.real.dir, "manifests") }

// inNode runs argv in the node's network namespace without remounting
// /sys (ip netns exec would hide /sys/fs/cgroup from kubelet and runc).
func (n *Node) inNode(argv ...string) []string {
	return append([]string{"nsenter", "--net=/run/netns/" + n.NetNS, "--"}, argv...)
}

func (c *Cluster) startContainerd(ctx context.Context, n *Node) error {
	r := n.real
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[ttrpc]
  address = %q
[debug]
  level = "warn"
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # Root here lacks CAP_SYS_RESOURCE: without this every sandbox fails
  # ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  # Pods' network namespaces under the state dir, not /run/netns: a
  # node's containerd killed before its pods were torn down left one
  # there per run; under the cluster's directory cleanupRealNodes
  # unmounts them.
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
  # Registries as an operator trusts a private one (TrustRegistry).
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = %q
`, filepath.Join(r.dir, "containerd/root"), filepath.Join(r.dir, "containerd/state"), r.socket, r.socket+".ttrpc",
		filepath.Join(r.dir, "containerd/opt"), imagePause, filepath.Join(r.dir, "cni"), filepath.Join(r.dir, "certs.d"))
	if err := os.WriteFile(filepath.Join(r.dir, "containerd.toml"), []byte(cfg), 0o644); err != nil {
		return err
	}
	c.mu.Lock()
	regs := slices.Clone(c.registries)
	c.mu.Unlock()
	for _, reg := range regs {
		if err := writeHostsTOML(r.dir, reg); err != nil {
			return err
		}
	}
	cni := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "pa-pods",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, filepath.Join(r.dir, "ipam"), r.podCIDR)
	if err := os.WriteFile(filepath.Join(r.dir, "cni", "10-pods.conflist"), []byte(cni), 0o644); err != nil {
		return err
	}
	var err error
	r.containerd, err = startProcess("containerd["+n.Name+"]", filepath.Join(r.dir, "containerd.log"),
		n.inNode("containerd", "--config", filepath.Join(r.dir, "containerd.toml")))
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.extra = append(c.extra, r.containerd)
	c.mu.Unlock()
	if err := c.waitProcess(ctx, r.containerd, 30*time.Second, "containerd on "+n.Name, func() bool {
		_, err := os.Stat(r.socket)
		return err == nil
	}); err != nil {
		return err
	}
	for _, img := range c.images {
		if out, err := run(ctx, "ctr", "-a", r.socket, "-n", "k8s.io", "images", "import", "--no-unpack", img); err != nil {
			return fmt.Errorf("import %s on %s: %w\n%s", img, n.Name, err, out)
		}
	}
	return nil
}

const imagePause = image.PauseRef

func (c *Cluster) startKubelet(ctx context.Context, n *Node, spec KubeletNodeSpec) error {
	r := n.real
	cert, key, err := c.pki.clientCert(filepath.Join(r.dir, "kubelet-client"), "system:node:"+n.Name, "system:nodes")
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(r.dir, "kubelet.kubeconfig")
	if err := writeCertKubeconfig(kubeconfig, fmt.Sprintf("https://%s:%d", APIServerIP, APIServerPort), c.pki.CACert, cert, key); err != nil {
		return err
	}
	resolv := filepath.Join(r.dir, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+ClusterDNSIP+"\n"), 0o644); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: %s
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
# Only holders of a certificate from the cluster's CA (the API server's
# kubelet client, for logs and exec) may call the kubelet's API.
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
# This machine has cgroup v1; containerd 1.6 does not report a cgroup
# driver, so the kubelet keeps its own (cgroupfs). Several kubelets on one
# machine need their own cgroup roots or each deletes the other's pods.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
cgroupsPerQOS: true
containerRuntimeEndpoint: unix://%s
staticPodPath: %q
podLogsDir: %q
clusterDomain: cluster.local
clusterDNS: [%s]
resolvConf: %q
podCIDR: %s
maxPods: 50
serializeImagePulls: false
evictionHard: {memory.available: "1Mi", nodefs.available: "1%%", imagefs.available: "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
failSwapOn: false
syncFrequency: 10s
fileCheckFrequency: 5s
nodeStatusReportFrequency: 10s
`, n.IP, c.pki.CACert, namePrefix+n.Name, r.socket, n.StaticPodDir(), filepath.Join(r.dir, "pod-logs"), ClusterDNSIP, resolv, r.podCIDR)
	cfgPath := filepath.Join(r.dir, "kubelet.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	labels := []string{}
	if spec.Zone != "" {
		labels = append(labels, "topology.kubernetes.io/zone="+spec.Zone)
	}
	if spec.Mode != "" && !spec.StaticProxy {
		labels = append(labels, ProxyModeLabel+"="+string(spec.Mode))
	}
	for k, v := range spec.Labels {
		labels = append(labels, k+"="+v)
	}
	slices.Sort(labels)
	argv := n.inNode(filepath.Join(c.bin, "kubelet"),
		"--config="+cfgPath,
		"--kubeconfig="+kubeconfig,
		"--root-dir="+filepath.Join(r.dir, "kubelet"),
		"--cert-dir="+filepath.Join(r.dir, "kubelet", "pki"),
		"--hostname-override="+n.Name,
		"--node-ip="+n.IP,
		"--v=1")
	if len(labels) > 0 {
		argv = append(argv, "--node-labels="+strings.Join(labels, ","))
	}
	if spec.Mode == ModeCilium {
		argv = append(argv, "--register-with-taints="+CiliumTaint)
	}
	if r.kubelet, err = startProcess("kubelet["+n.Name+"]", filepath.Join(r.dir, "kubelet.log"), argv); err != nil {
		return err
	}
	c.mu.Lock()
	c.extra = append(c.extra, r.kubelet)
	c.mu.Unlock()
	return c.waitProcess(ctx, r.kubelet, 90*time.Second, "node "+n.Name+" Ready", func() bool {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == corev1.NodeReady {
				return cond.Status == corev1.ConditionTrue
			}
		}
		return false
	})
}

// KubeletLog returns the last lines of a real node's kubelet log.
func (n *Node) KubeletLog(lines int) string {
	if n.real == nil {
		return ""
	}
	return tailFile(filepath.Join(n.real.dir, "kubelet.log"), lines)
}

// ClusterDNSIP is the cluster DNS service's address the kubelets hand to
// pods.
const ClusterDNSIP = "198.19.0.10"

// ensureControlPlane builds the images and starts the controller manager
// and scheduler, once.
func (c *Cluster) ensureControlPlane(ctx context.Context) error {
	c.cpOnce.Lock()
	defer c.cpOnce.Unlock()
	if c.controllers != nil {
		return nil
	}
	// Pods on one node reach pods on another through the host.
	if b, err := os.ReadFile(ipForward); err == nil && strings.TrimSpace(string(b)) == "0" {
		// A mark a crashed run leaves for the next one's cleanup.
		if err := os.WriteFile(forwardMark, []byte("0"), 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(ipForward, []byte("1"), 0o644); err != nil {
			return fmt.Errorf("enable IPv4 forwarding on the host for pod traffic between nodes: %w", err)
		}
		c.mu.Lock()
		c.undo = append(c.undo, restoreForwarding)
		c.mu.Unlock()
		c.logf("IPv4 forwarding on the host enabled (restored at Stop)")
	}
	start := time.Now()
	imgs, err := BuildImages(ctx, filepath.Join(c.Dir, "images"), true, nil)
	if err != nil {
		return fmt.Errorf("images for real nodes: %w", err)
	}
	c.images = imgs
	c.logf("images for real nodes built in %s", time.Since(start).Round(time.Millisecond))
	server := fmt.Sprintf("https://%s:%d", APIServerIP, APIServerPort)
	kc := func(user string) (string, error) {
		base := filepath.Join(c.Dir, strings.TrimPrefix(user, "system:"))
		cert, key, err := c.pki.clientCert(base, user)
		if err != nil {
			return "", err
		}
		return base + ".kubeconfig", writeCertKubeconfig(base+".kubeconfig", server, c.pki.CACert, cert, key)
	}
	kcm, err := kc("system:kube-controller-manager")
	if err != nil {
		return err
	}
	sched, err := kc("system:kube-scheduler")
	if err != nil {
		return err
	}
	cm, err := startProcess("kube-controller-manager", filepath.Join(c.Dir, "kube-controller-manager.log"), []string{
		filepath.Join(c.bin, "kube-controller-manager"),
		"--kubeconfig=" + kcm,
		"--authentication-kubeconfig=" + kcm,
		"--authorization-kubeconfig=" + kcm,
		"--use-service-account-credentials",
		"--service-account-private-key-file=" + c.pki.SAKey,
		"--root-ca-file=" + c.pki.CACert,
		"--service-cluster-ip-range=" + ServiceCIDR,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=10257",
		// No pod CIDRs to allocate (the nodes' are set by hand). 1.37
		// dropped the cloud controllers from the list: naming one is an error.
		"--controllers=*,-node-ipam-controller",
		"--concurrent-deployment-syncs=2",
		"--node-monitor-grace-period=40s",
		"--profiling=false",
	})
	if err != nil {
		return err
	}
	sc, err := startProcess("kube-scheduler", filepath.Join(c.Dir, "kube-scheduler.log"), []string{
		filepath.Join(c.bin, "kube-scheduler"),
		"--kubeconfig=" + sched,
		"--authentication-kubeconfig=" + sched,
		"--authorization-kubeconfig=" + sched,
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=10259",
		"--profiling=false",
	})
	if err != nil {
		cm.stop(5 * time.Second)
		return err
	}
	c.controllers = []*process{cm, sc}
	c.mu.Lock()
	c.extra = append(c.extra, cm, sc)
	c.mu.Unlock()
	// The controller manager at work, not only started (one that refuses
	// its flags exits at once, and nodes still turn Ready without it): its
	// service account controller makes every namespace's default account.
	return c.waitProcess(ctx, cm, 60*time.Second, "kube-controller-manager (default/default ServiceAccount)", func() bool {
		_, err := c.Client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err == nil
	})
}

func writeCertKubeconfig(path, server, caFile, cert, key string) error {
	return kubeconfigFile(path, server, caFile, "client-certificate: "+cert+"\n    client-key: "+key)
}

// cleanupRealNodes ends what real nodes leave beyond marked processes:
// containers (their processes live in the nodes' cgroups), the kubelet's
// and containerd's mounts under dir, and the cgroups themselves.
func cleanupRealNodes(dir string) error {
	if !machineLane() {
		// Every pa-* cgroup here is lane 0's (AddKubeletNode); the mounts
		// under dir are this lane's own (a Cilium node's BPF filesystem,
		// in the lane's mount namespace and temporary directory).
		if dir == "" {
			return nil
		}
		return unmountUnder(dir)
	}
	var errs []error
	roots, _ := filepath.Glob("/sys/fs/cgroup/*/" + namePrefix + "*")
	if sys, _ := filepath.Glob("/sys/fs/cgroup/" + namePrefix + "*"); len(sys) > 0 {
		roots = append(roots, sys...)
	}
	for _, root := range roots {
		// A cgroup hierarchy mounted over one of ours (Cilium's agent
		// mounts cgroup2 at a --cgroup-root that is not a mount point)
		// shows every process of the machine: unmounted, never walked.
		over := func() (ms []string) {
			for _, m := range mountsUnder(root) {
				if m == root || strings.HasPrefix(m, root+"/") {
					ms = append(ms, m)
				}
			}
			return ms
		}
		for _, m := range over() {
			if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil {
				errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
			}
		}
		if len(over()) > 0 {
			continue // still mounted: never walked
		}
		killCgroup(root)
	}
	if dir != "" {
		if err := unmountUnder(dir); err != nil { // dir: a path prefix
			errs = append(errs, err)
		}
	}
	for _, root := range roots {
		if err := removeCgroup(root); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// makeCgroupRoot makes the node's cgroup root in every hierarchy (the
// kubelet wants it to exist); a new cpuset gets its parent's CPUs and
// memory nodes, or nothing can run in it.
func makeCgroupRoot(name string) error {
	hier, err := filepath.Glob("/sys/fs/cgroup/*")
	if err != nil {
		return err
	}
	for _, h := range hier {
		if st, err := os.Stat(h); err != nil || !st.IsDir() {
			continue
		}
		d := filepath.Join(h, name)
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("make cgroup %s: %w", d, err)
		}
		if filepath.Base(h) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				b, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", d, err)
				}
			}
		}
	}
	return nil
}

func killCgroup(root string) {
	for range 50 {
		alive := false
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
				return nil
			}
			b, _ := os.ReadFile(p)
			for _, f := range strings.Fields(string(b)) {
				var pid int
				if _, err := fmt.Sscan(f, &pid); err == nil && pid > 0 {
					alive = true
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			return nil
		})
		if !alive {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func removeCgroup(root string) error {
	var dirs []string
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.Reverse(dirs)
	var last error
	for _, d := range dirs {
		if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
			last = fmt.Errorf("remove cgroup %s: %w", d, err)
		}
	}
	return last
}

// unmountUnder lazily unmounts every mount point whose path begins with
// prefix, deepest first.
func unmountUnder(prefix string) error {
	points := mountsUnder(prefix)
	slices.SortFunc(points, func(a, b string) int { return len(b) - len(a) })
	var errs []error
	for _, p := range points {
		if err := syscall.Unmount(p, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// mountsUnder lists the mount points whose path begins with prefix.
func mountsUnder(prefix string) []string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) > 4 && strings.HasPrefix(fs[4], prefix) {
			points = append(points, fs[4])
		}
	}
	return points
}

const (
	ipForward   = "/proc/sys/net/ipv4/ip_forward"
	forwardMark = "/run/proxyaudit-localcluster-ip-forward"
)

// restoreForwarding turns the host's IPv4 forwarding off again if a real
// node turned it on (its mark says so), after Stop or a crashed run.
func restoreForwarding() {
	if !machineLane() {
		return // the mark is lane 0's real nodes'; this lane's forwarding is its own namespace's
	}
	if b, err := os.ReadFile(forwardMark); err == nil && strings.TrimSpace(string(b)) == "0" {
		_ = os.WriteFile(ipForward, []byte("0"), 0o644)
	}
	_ = os.Remove(forwardMark)
}
