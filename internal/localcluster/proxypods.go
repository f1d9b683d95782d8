package localcluster

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// Labels and namespace of the stand-in kube-proxy pods, as kubeadm's
// DaemonSet has them.
const (
	ProxyPodNamespace = "kube-system"
	ProxyPodSelector  = "k8s-app=kube-proxy"
)

// ManageProxyPods gives every node a kube-proxy Pod object and keeps it in
// step with the node's kube-proxy process, as the kubelet and the
// DaemonSet controller do in a real cluster: deleting the Pod restarts
// the process (without waiting for it to sync: a faulty node may never
// sync) and a new Pod takes its place. Nodes named in static get a mirror
// pod (a static kube-proxy), which is only recreated, as the kubelet
// would. This is a test stand-in: no container runs; the Pod exists so
// that proxyaudit's executor finds and deletes it exactly as in a cluster.
// It runs until ctx ends.
func (c *Cluster) ManageProxyPods(ctx context.Context, static ...string) error {
	isStatic := map[string]bool{}
	for _, s := range static {
		isStatic[s] = true
	}
	if err := c.EnsureNamespace(ctx, ProxyPodNamespace); err != nil {
		return err
	}
	_, err := c.Client.CoreV1().ServiceAccounts(ProxyPodNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "kube-proxy"}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kube-proxy service account: %w", err)
	}
	for _, n := range c.Nodes() {
		if err := c.proxyPod(ctx, n, isStatic[n.Name]); err != nil {
			return err
		}
	}
	go func() {
		handled := map[string]bool{} // pod UIDs already acted on
		for ctx.Err() == nil {
			w, err := c.Client.CoreV1().Pods(ProxyPodNamespace).Watch(ctx, metav1.ListOptions{LabelSelector: ProxyPodSelector})
			if err != nil {
				time.Sleep(time.Second)
				continue
			}
			for ev := range w.ResultChan() {
				pod, ok := ev.Object.(*corev1.Pod)
				// Without a kubelet a deleted pod bound to a node stays
				// Terminating: the deletion timestamp is the signal.
				if !ok || (ev.Type != watch.Deleted && pod.DeletionTimestamp == nil) || handled[string(pod.UID)] {
					continue
				}
				handled[string(pod.UID)] = true
				n := c.Node(pod.Spec.NodeName)
				if n == nil {
					continue
				}
				if !isStatic[n.Name] {
					n.StopProxy()
					if _, err := n.startProxy(); err != nil {
						c.logf("stand-in kubelet: restart kube-proxy on %s: %v", n.Name, err)
					}
					n.restarts.Add(1)
					c.logf("stand-in kubelet: kube-proxy pod on %s deleted, process restarted", n.Name)
				}
				// Finish the deletion as the kubelet would, then let the
				// DaemonSet make a new pod.
				zero := int64(0)
				err := c.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
				if err != nil && !apierrors.IsNotFound(err) && ctx.Err() == nil {
					c.logf("stand-in kubelet: finish deleting %s: %v", pod.Name, err)
				}
				if err := c.proxyPod(ctx, n, isStatic[n.Name]); err != nil && ctx.Err() == nil {
					c.logf("stand-in DaemonSet: recreate kube-proxy pod on %s: %v", n.Name, err)
				}
			}
			w.Stop()
		}
	}()
	return nil
}

// ProxyRestarts counts restarts caused by deleting the node's kube-proxy Pod.
func (n *Node) ProxyRestarts() int64 { return n.restarts.Load() }

func (c *Cluster) proxyPod(ctx context.Context, n *Node, static bool) error {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: "kube-proxy-", Namespace: ProxyPodNamespace,
			Labels: map[string]string{"k8s-app": "kube-proxy"},
		},
		Spec: corev1.PodSpec{
			NodeName:                     n.Name,
			ServiceAccountName:           "kube-proxy",
			AutomountServiceAccountToken: ptrTo(false),
			Containers:                   []corev1.Container{{Name: "kube-proxy", Image: "registry.k8s.io/kube-proxy:v1.36.3"}},
		},
	}
	if static {
		// The kubelet's copy of a static pod: no service account.
		pod.Annotations = map[string]string{"kubernetes.io/config.mirror": "stand-in", "kubernetes.io/config.source": "file"}
		pod.Spec.ServiceAccountName = ""
	}
	_, err := c.Client.CoreV1().Pods(ProxyPodNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("kube-proxy pod for %s: %w", n.Name, err)
	}
	return nil
}
