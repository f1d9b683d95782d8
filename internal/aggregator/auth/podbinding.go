package auth

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// TokenReview extras the API server fills from a pod-bound token.
const (
	PodNameExtra = "authentication.kubernetes.io/pod-name"
	PodUIDExtra  = "authentication.kubernetes.io/pod-uid"
)

// DaemonSetBinding admits a collector only from a pod of the collector
// DaemonSet running that DaemonSet's own program. A token bound to "a pod
// on node X using the collector ServiceAccount" is not enough: whoever may
// create pods in the namespace can give one any spec.nodeName and have it
// speak for node X — report empty rules from a pod network namespace, and
// have X's kube-proxy restarted or the node cordoned. Checked: the token's
// pod (name and UID) is on the node claimed, its controller is the
// DaemonSet (by UID), and its containers run what the ControllerRevision
// its controller-revision-hash names (one only the DaemonSet controller
// writes) says, with the same host network. Owner references can be
// written by whoever creates a pod; a pod that passes runs the genuine
// collector on that node, which reports the truth.
type DaemonSetBinding struct {
	Client          kubernetes.Interface
	Namespace, Name string

	mu   sync.Mutex
	uid  types.UID
	revs map[string]*corev1.PodTemplateSpec // by revision name; revisions do not change
}

// maxRevisions bounds the revisions kept (a DaemonSet keeps 10 by default).
const maxRevisions = 64

// Check says why the pod named in a token's extras may not speak for
// node, or nil.
func (b *DaemonSetBinding) Check(ctx context.Context, extra map[string]authnv1.ExtraValue, node string) error {
	name, uid := one(extra[PodNameExtra]), one(extra[PodUIDExtra])
	if name == "" || uid == "" {
		return fmt.Errorf("the token names no pod (use the projected ServiceAccount token of a %s/%s pod)", b.Namespace, b.Name)
	}
	pod, err := b.Client.CoreV1().Pods(b.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("cannot read the token's pod %s/%s (the aggregator needs get on pods in %s): %w", b.Namespace, name, b.Namespace, err)
	}
	if string(pod.UID) != uid {
		return fmt.Errorf("pod %s/%s is not the one the token was issued for", b.Namespace, name)
	}
	if pod.Spec.NodeName != node {
		return fmt.Errorf("pod %s/%s runs on node %q, not %q", b.Namespace, name, pod.Spec.NodeName, node)
	}
	ref := metav1.GetControllerOf(pod)
	if ref == nil || ref.Kind != "DaemonSet" || ref.Name != b.Name {
		return fmt.Errorf("pod %s/%s is not a pod of DaemonSet %s/%s (if the collectors run from another DaemonSet, name it in --collector-daemonset)", b.Namespace, name, b.Namespace, b.Name)
	}
	dsUID, err := b.daemonSet(ctx, ref.UID)
	if err != nil {
		return err
	}
	if ref.UID != dsUID {
		return fmt.Errorf("pod %s/%s names a DaemonSet %s/%s that is not the current one", b.Namespace, name, b.Namespace, b.Name)
	}
	hash := pod.Labels[appsv1.DefaultDaemonSetUniqueLabelKey]
	tmpl, err := b.revision(ctx, b.Name+"-"+hash, dsUID)
	if err != nil {
		return fmt.Errorf("pod %s/%s: %w", b.Namespace, name, err)
	}
	if why := sameProgram(tmpl.Spec, pod.Spec); why != "" {
		return fmt.Errorf("pod %s/%s does not run its DaemonSet's collector: %s", b.Namespace, name, why)
	}
	return nil
}

func one(v []string) string {
	if len(v) != 1 {
		return ""
	}
	return v[0]
}

// daemonSet returns the DaemonSet's UID, read again when a pod names
// another (the DaemonSet was recreated).
func (b *DaemonSetBinding) daemonSet(ctx context.Context, want types.UID) (types.UID, error) {
	b.mu.Lock()
	uid := b.uid
	b.mu.Unlock()
	if uid != "" && uid == want {
		return uid, nil
	}
	ds, err := b.Client.AppsV1().DaemonSets(b.Namespace).Get(ctx, b.Name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("cannot read DaemonSet %s/%s (--collector-daemonset; the aggregator needs get on it): %w", b.Namespace, b.Name, err)
	}
	b.mu.Lock()
	b.uid = ds.UID
	b.mu.Unlock()
	return ds.UID, nil
}

// revision returns the pod template a ControllerRevision of the DaemonSet
// holds.
func (b *DaemonSetBinding) revision(ctx context.Context, name string, owner types.UID) (*corev1.PodTemplateSpec, error) {
	b.mu.Lock()
	t := b.revs[name]
	b.mu.Unlock()
	if t != nil {
		return t, nil
	}
	rev, err := b.Client.AppsV1().ControllerRevisions(b.Namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("cannot read its ControllerRevision %s (the aggregator needs get on controllerrevisions): %w", name, err)
	}
	if ref := metav1.GetControllerOf(rev); ref == nil || ref.UID != owner {
		return nil, fmt.Errorf("ControllerRevision %s is not the DaemonSet's", name)
	}
	// The DaemonSet controller stores {"spec":{"template":{...}}}.
	var data struct {
		Spec struct {
			Template corev1.PodTemplateSpec `json:"template"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(rev.Data.Raw, &data); err != nil {
		return nil, fmt.Errorf("ControllerRevision %s holds no pod template: %v", name, err)
	}
	t = &data.Spec.Template
	b.mu.Lock()
	if b.revs == nil || len(b.revs) >= maxRevisions {
		b.revs = map[string]*corev1.PodTemplateSpec{}
	}
	b.revs[name] = t
	b.mu.Unlock()
	return t, nil
}

// sameProgram says how a pod's spec runs something other than its
// template: other containers, images, commands or arguments, or another
// network namespace ("" when the same). Admission may add volumes and
// mounts (the ServiceAccount token's) and defaults; those are not compared.
func sameProgram(want, got corev1.PodSpec) string {
	if want.HostNetwork != got.HostNetwork {
		return fmt.Sprintf("hostNetwork %v, the DaemonSet's is %v", got.HostNetwork, want.HostNetwork)
	}
	for _, pair := range [][2][]corev1.Container{{want.InitContainers, got.InitContainers}, {want.Containers, got.Containers}} {
		w, g := pair[0], pair[1]
		if len(w) != len(g) {
			return fmt.Sprintf("%d containers, the DaemonSet's template has %d", len(g), len(w))
		}
		for i := range w {
			if w[i].Name != g[i].Name || w[i].Image != g[i].Image || !slices.Equal(w[i].Command, g[i].Command) || !slices.Equal(w[i].Args, g[i].Args) {
				return fmt.Sprintf("container %q runs %s %v %v, the DaemonSet's %q runs %s %v %v",
					g[i].Name, g[i].Image, g[i].Command, g[i].Args, w[i].Name, w[i].Image, w[i].Command, w[i].Args)
			}
		}
	}
	return ""
}
