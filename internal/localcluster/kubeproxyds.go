package localcluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// ProxyModeLabel on a real node says which kube-proxy DaemonSet runs on
// it (KubeletNodeSpec.Mode sets it).
const ProxyModeLabel = "proxyaudit.io/proxy-mode"

// KubeProxyDaemonSet names the DaemonSet DeployKubeProxy makes for mode:
// kubeadm's own name for iptables, a suffixed one for the others.
func KubeProxyDaemonSet(mode Mode) string {
	if mode == ModeIPTables {
		return "kube-proxy"
	}
	return "kube-proxy-" + string(mode)
}

// DeployKubeProxy runs the genuine kube-proxy as kubeadm does: a DaemonSet
// in kube-system labelled k8s-app=kube-proxy, its configuration and
// kubeconfig (the API server's own address: the Service address needs
// kube-proxy first) in a ConfigMap, its ServiceAccount bound to
// system:node-proxier. It runs on the real nodes labelled with mode.
func (c *Cluster) DeployKubeProxy(ctx context.Context, mode Mode) error {
	name := KubeProxyDaemonSet(mode)
	ns := "kube-system"
	if err := c.serviceAccountBound(ctx, ns, "kube-proxy", "kubeadm:node-proxier", "system:node-proxier"); err != nil {
		return err
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"app": "kube-proxy"}},
		Data: map[string]string{
			"config.conf": fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
mode: %s
clusterCIDR: %s
conntrack:
  maxPerCore: 0
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
`, mode, PodCIDR),
			"kubeconfig.conf": fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    server: https://%s:%d
  name: default
contexts:
- context: {cluster: default, namespace: default, user: default}
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
`, APIServerIP, APIServerPort),
		},
	}
	if _, err := c.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	labels := map[string]string{"k8s-app": "kube-proxy"}
	if mode != ModeIPTables {
		labels["proxyaudit.io/mode"] = string(mode)
	}
	hostPath := func(n, p string, t corev1.HostPathType) corev1.Volume {
		return corev1.Volume{Name: n, VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: p, Type: &t}}}
	}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"k8s-app": "kube-proxy"}},
		Spec: appsv1.DaemonSetSpec{
			Selector:       &metav1.LabelSelector{MatchLabels: labels},
			UpdateStrategy: appsv1.DaemonSetUpdateStrategy{Type: appsv1.RollingUpdateDaemonSetStrategyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					ServiceAccountName: "kube-proxy",
					HostNetwork:        true,
					PriorityClassName:  "system-node-critical",
					NodeSelector:       map[string]string{"kubernetes.io/os": "linux", ProxyModeLabel: string(mode)},
					Tolerations:        []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{
						Name:            "kube-proxy",
						Image:           KubeProxyImage,
						ImagePullPolicy: corev1.PullIfNotPresent,
						Command:         []string{"/usr/local/bin/kube-proxy", "--config=/var/lib/kube-proxy/config.conf", "--hostname-override=$(NODE_NAME)", "--v=2"},
						Env: []corev1.EnvVar{{Name: "NODE_NAME", ValueFrom: &corev1.EnvVarSource{
							FieldRef: &corev1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}}},
						SecurityContext: &corev1.SecurityContext{Privileged: ptrTo(true)},
						VolumeMounts: []corev1.VolumeMount{
							{Name: "kube-proxy", MountPath: "/var/lib/kube-proxy"},
							{Name: "xtables-lock", MountPath: "/run/xtables.lock"},
							{Name: "lib-modules", MountPath: "/lib/modules", ReadOnly: true},
						},
					}},
					Volumes: []corev1.Volume{
						{Name: "kube-proxy", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
							LocalObjectReference: corev1.LocalObjectReference{Name: name}}}},
						hostPath("xtables-lock", "/run/xtables.lock", corev1.HostPathFileOrCreate),
						// No type check, as kubeadm: a node without modules
						// (a built-in netfilter) still runs kube-proxy.
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

// serviceAccountBound makes the ServiceAccount ns/name and binds it to
// clusterRole by the ClusterRoleBinding binding (either kept if it exists).
func (c *Cluster) serviceAccountBound(ctx context.Context, ns, name, binding, clusterRole string) error {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}}
	if _, err := c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: binding},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: clusterRole},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: name, Namespace: ns}},
	}
	if _, err := c.Client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// KubeProxyImage is the image reference of the kube-proxy image the real
// nodes import (kubeadm's tag for this version).
const KubeProxyImage = image.KubeProxyRef

// WaitPodsReady waits until exactly want pods match selector in ns, none
// being deleted and all Ready, and returns them; the error lists what it
// saw.
func (c *Cluster) WaitPodsReady(ctx context.Context, ns, selector string, want int, timeout time.Duration) ([]corev1.Pod, error) {
	deadline := time.Now().Add(timeout)
	var last string
	for {
		pods, err := c.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err == nil {
			ready := 0
			var states []string
			for _, p := range pods.Items {
				isReady := false
				for _, cond := range p.Status.Conditions {
					if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
						isReady = true
					}
				}
				if p.DeletionTimestamp == nil && isReady {
					ready++
				}
				states = append(states, fmt.Sprintf("%s@%s:%s ready=%v", p.Name, p.Spec.NodeName, p.Status.Phase, isReady))
			}
			last = strings.Join(states, " ")
			if ready == want && len(pods.Items) == want {
				return pods.Items, nil
			}
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("pods %s in %s: want %d Ready within %s; have: %s", selector, ns, want, timeout, last)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// StaticKubeProxy runs kube-proxy on a real node as a static pod (a
// manifest in the kubelet's manifest directory; the API shows its mirror
// pod), as GKE and older kubeadm setups do. It authenticates with a
// kubeconfig on the node (static pods cannot use ServiceAccounts), labelled
// like the DaemonSet's pods so that the same selector finds it.
func (c *Cluster) StaticKubeProxy(n *Node, mode Mode) error {
	if n.real == nil {
		return fmt.Errorf("node %s is not a real node", n.Name)
	}
	// What the pod mounts: its kubeconfig, the cluster's CA, its config.
	dir := filepath.Join(n.real.dir, "static-kube-proxy")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	ca, err := os.ReadFile(c.pki.CACert)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "ca.crt"), ca, 0o644); err != nil {
		return err
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := writeKubeconfig(kubeconfig, fmt.Sprintf("https://%s:%d", APIServerIP, APIServerPort), filepath.Join(dir, "ca.crt"), c.proxyToken, ""); err != nil {
		return err
	}
	config := fmt.Sprintf(`apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: %s
mode: %s
clusterCIDR: %s
hostnameOverride: %s
conntrack:
  maxPerCore: 0
healthzBindAddress: 0.0.0.0:10256
metricsBindAddress: 127.0.0.1:10249
`, kubeconfig, mode, PodCIDR, n.Name)
	cfgPath := filepath.Join(dir, "config.conf")
	if err := os.WriteFile(cfgPath, []byte(config), 0o644); err != nil {
		return err
	}
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: kube-proxy
  namespace: kube-system
  labels: {k8s-app: kube-proxy, tier: node, component: kube-proxy}
spec:
  hostNetwork: true
  priorityClassName: system-node-critical
  containers:
  - name: kube-proxy
    image: %s
    imagePullPolicy: IfNotPresent
    command: [/usr/local/bin/kube-proxy, --config=%s, --v=2]
    securityContext: {privileged: true}
    volumeMounts:
    - {name: cluster, mountPath: %s, readOnly: true}
    - {name: xtables-lock, mountPath: /run/xtables.lock}
  volumes:
  - name: cluster
    hostPath: {path: %s}
  - name: xtables-lock
    hostPath: {path: /run/xtables.lock, type: FileOrCreate}
`, KubeProxyImage, cfgPath, dir, dir)
	return os.WriteFile(filepath.Join(n.StaticPodDir(), "kube-proxy.yaml"), []byte(manifest), 0o644)
}
