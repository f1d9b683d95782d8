package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// CiliumImage is the image reference of the Cilium agent image a real
// Cilium node imports (Cilium's own tag for the version built here).
const CiliumImage = image.CiliumRef

// CiliumTaint keeps ordinary pods off a real Cilium node: its pods are
// on the node's bridge, not Cilium endpoints, so only host-network pods
// (the DaemonSets', which tolerate every taint) reach services through
// Cilium's socket load balancing.
const CiliumTaint = "proxyaudit.io/dataplane=cilium:NoSchedule"

// CiliumBPFRoot is where the real Cilium node's agent pins its maps: the
// host path its DaemonSet mounts as /sys/fs/bpf, and the chart's
// cilium.bpfRoot. One per cluster: a DaemonSet's host paths are the same
// on all its nodes, and on this machine the nodes share one host.
func (c *Cluster) CiliumBPFRoot() string { return filepath.Join(c.Dir, "cilium", "bpffs") }

// prepareCiliumKubelet readies a real node for Cilium's DaemonSet (before
// its kubelet starts): the agent image imported into the node's
// containerd, Cilium's CRDs, a BPF filesystem at CiliumBPFRoot and the
// agent's state directory.
func (c *Cluster) prepareCiliumKubelet(ctx context.Context, n *Node) error {
	c.mu.Lock()
	for _, o := range c.nodes {
		if o != n && o.Real() && o.Mode == ModeCilium {
			c.mu.Unlock()
			return fmt.Errorf("node %s: %s already runs Cilium's DaemonSet (one real Cilium node per cluster: the DaemonSet's host paths are one for all its nodes, and here they share a host)", n.Name, o.Name)
		}
	}
	c.mu.Unlock()
	dir, err := EnsureCilium(ctx)
	if err != nil {
		return err
	}
	if err := c.applyCiliumCRDs(ctx, dir); err != nil {
		return err
	}
	work := filepath.Join(c.Dir, "cilium")
	for _, d := range []string{"bpffs", "state"} {
		if err := os.MkdirAll(filepath.Join(work, d), 0o755); err != nil {
			return err
		}
	}
	if err := unix.Mount("bpf", c.CiliumBPFRoot(), "bpf", 0, ""); err != nil {
		return fmt.Errorf("node %s: mount a BPF filesystem: %w", n.Name, err)
	}
	// Shared, as /sys/fs/bpf is on a systemd host: the collector mounts it
	// HostToContainer, which containerd refuses on a private mount.
	if err := unix.Mount("", c.CiliumBPFRoot(), "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("node %s: make the BPF filesystem shared: %w", n.Name, err)
	}
	hier, err := cgroup2Hierarchy()
	if err != nil {
		return err
	}
	// The node's own cgroup in the v2 hierarchy, where its pods are: the
	// agent's socket load balancing serves this node's processes only.
	n.cilium = &ciliumNode{dir: dir, work: work, cgroup: filepath.Join(hier, namePrefix+n.Name)}
	spec, err := image.Cilium(dir)
	if err != nil {
		return err
	}
	tar := filepath.Join(c.Dir, "images", "cilium-image.tar")
	start := time.Now()
	if _, err := image.Build(ctx, spec, filepath.Join(cacheDir(), "debs"), tar); err != nil {
		return fmt.Errorf("image %s: %w", spec.Ref, err)
	}
	if out, err := run(ctx, "ctr", "-a", n.real.socket, "-n", "k8s.io", "images", "import", "--no-unpack", tar); err != nil {
		return fmt.Errorf("import %s on %s: %w\n%s", tar, n.Name, err, out)
	}
	c.logf("Cilium's agent image built and imported on %s in %s", n.Name, time.Since(start).Round(time.Millisecond))
	return nil
}

// ciliumPodCIDR gives a Cilium node's Node its pod range: the agent's
// Kubernetes IPAM reads it there (the controller manager's node IPAM is
// off here).
func (c *Cluster) ciliumPodCIDR(ctx context.Context, n *Node, cidr string) error {
	patch := fmt.Sprintf(`{"spec":{"podCIDR":%q,"podCIDRs":[%q]}}`, cidr, cidr)
	if _, err := c.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("node %s pod CIDR: %w", n.Name, err)
	}
	return nil
}

// DeployCilium runs Cilium's agent as its release installs it: the
// DaemonSet kube-system/cilium of pods labelled k8s-app=cilium, with host
// network, privileged, the node's BPF filesystem, cgroup and state
// directory mounted, on the real node added with ModeCilium (at most
// one). Kube-proxy replacement is on and its socket load balancing
// attaches to the node's own cgroup. Its ServiceAccount is bound to
// cluster-admin: Cilium's own ClusterRole is long and not what is tested.
func (c *Cluster) DeployCilium(ctx context.Context) error {
	var n *Node
	for _, o := range c.Nodes() {
		if o.Real() && o.Mode == ModeCilium {
			n = o
		}
	}
	if n == nil {
		return fmt.Errorf("no real node runs in mode cilium (AddKubeletNode with Mode: ModeCilium)")
	}
	ns := "kube-system"
	if err := c.serviceAccountBound(ctx, ns, "cilium", "proxyaudit-test:cilium", "cluster-admin"); err != nil {
		return err
	}
	hostPath := func(name, p string, t corev1.HostPathType) corev1.Volume {
		return corev1.Volume{Name: name, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: p, Type: &t}}}
	}
	labels := map[string]string{"k8s-app": "cilium"}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: "cilium", Namespace: ns, Labels: labels},
		Spec: appsv1.DaemonSetSpec{
			Selector:       &metav1.LabelSelector{MatchLabels: labels},
			UpdateStrategy: appsv1.DaemonSetUpdateStrategy{Type: appsv1.RollingUpdateDaemonSetStrategyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					ServiceAccountName: "cilium",
					HostNetwork:        true,
					// Cilium's chart's: its maps outlive the agent, so a
					// deleted pod's (a hung one's too) goes at once.
					TerminationGracePeriodSeconds: ptrTo(int64(1)),
					PriorityClassName:             "system-node-critical",
					NodeSelector:                  map[string]string{"kubernetes.io/os": "linux", ProxyModeLabel: string(ModeCilium)},
					Tolerations:                   []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{
						Name:            "cilium-agent",
						Image:           CiliumImage,
						ImagePullPolicy: corev1.PullIfNotPresent,
						Command:         append([]string{"cilium-agent"}, ciliumAgentFlags("/sys/fs/bpf", "/run/cilium/cgroupv2", true)...),
						Env: []corev1.EnvVar{
							{Name: "K8S_NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
							// The API server itself: the kubernetes Service's
							// address needs this very agent first (as Cilium's
							// Helm values k8sServiceHost/Port say).
							{Name: "KUBERNETES_SERVICE_HOST", Value: APIServerIP},
							{Name: "KUBERNETES_SERVICE_PORT", Value: strconv.Itoa(APIServerPort)},
						},
						SecurityContext: &corev1.SecurityContext{Privileged: ptrTo(true)},
						VolumeMounts: []corev1.VolumeMount{
							{Name: "bpf-maps", MountPath: "/sys/fs/bpf"},
							{Name: "cilium-cgroup", MountPath: "/run/cilium/cgroupv2"},
							{Name: "cilium-run", MountPath: "/var/run/cilium"},
							{Name: "xtables-lock", MountPath: "/run/xtables.lock"},
							{Name: "lib-modules", MountPath: "/lib/modules", ReadOnly: true},
						},
					}},
					Volumes: []corev1.Volume{
						hostPath("bpf-maps", c.CiliumBPFRoot(), corev1.HostPathDirectory),
						hostPath("cilium-cgroup", n.cilium.cgroup, corev1.HostPathDirectory),
						hostPath("cilium-run", filepath.Join(n.cilium.work, "state"), corev1.HostPathDirectory),
						hostPath("xtables-lock", "/run/xtables.lock", corev1.HostPathFileOrCreate),
						hostPath("lib-modules", "/lib/modules", corev1.HostPathUnset),
					},
				},
			},
		},
	}
	if _, err := c.Client.AppsV1().DaemonSets(ns).Create(ctx, ds, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// CheckCiliumCgroup fails when the agent on the real Cilium node mounted
// a cgroup hierarchy's root as its cgroup root (its socket programs would
// translate every connection of the machine, every other node's
// included): the mount it uses must be the node's own cgroup.
func (n *Node) CheckCiliumCgroup() error {
	pid := n.podProxyPID()
	if pid == 0 {
		return fmt.Errorf("no Cilium agent runs on %s", n.Name)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 || f[4] != "/run/cilium/cgroupv2" {
			continue
		}
		if want := "/" + namePrefix + n.Name; f[3] != want {
			return fmt.Errorf("node %s: Cilium's agent has cgroup %q of its hierarchy at its cgroup root, not the node's own %q", n.Name, f[3], want)
		}
		return nil
	}
	return fmt.Errorf("node %s: Cilium's agent has nothing mounted at /run/cilium/cgroupv2", n.Name)
}
