package auth

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
)

// A collector is admitted only from a pod of its DaemonSet running the
// DaemonSet's program; each way a pod made by hand differs is refused.
func TestDaemonSetBinding(t *testing.T) {
	tmpl := corev1.PodTemplateSpec{Spec: corev1.PodSpec{HostNetwork: true, ServiceAccountName: "proxyaudit-collector",
		Containers: []corev1.Container{{Name: "collector", Image: "proxyaudit-collector:1", Args: []string{"--node-name=$(NODE_NAME)"}}}}}
	ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Namespace: "pa", Name: "proxyaudit-collector", UID: "ds-uid"}, Spec: appsv1.DaemonSetSpec{Template: tmpl}}
	owner := *metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))
	data, _ := json.Marshal(map[string]any{"spec": map[string]any{"template": tmpl}})
	rev := &appsv1.ControllerRevision{ObjectMeta: metav1.ObjectMeta{Namespace: "pa", Name: "proxyaudit-collector-abc", OwnerReferences: []metav1.OwnerReference{owner}},
		Data: runtime.RawExtension{Raw: data}}
	foreign := owner
	foreign.UID = "other-uid"
	forged := &appsv1.ControllerRevision{ObjectMeta: metav1.ObjectMeta{Namespace: "pa", Name: "proxyaudit-collector-forged", OwnerReferences: []metav1.OwnerReference{foreign}},
		Data: runtime.RawExtension{Raw: data}}
	pod := func(name string, change func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "pa", Name: name, UID: types.UID("uid-" + name), OwnerReferences: []metav1.OwnerReference{owner},
			Labels: map[string]string{appsv1.DefaultDaemonSetUniqueLabelKey: "abc"}}, Spec: *tmpl.Spec.DeepCopy()}
		p.Spec.NodeName = "n1"
		// What admission adds is not the program.
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "kube-api-access-x"})
		if change != nil {
			change(p)
		}
		return p
	}
	cases := []struct {
		pod  *corev1.Pod
		says string
	}{
		{pod("genuine", nil), ""},
		{pod("no-owner", func(p *corev1.Pod) { p.OwnerReferences = nil }), "is not a pod of DaemonSet"},
		{pod("old-owner", func(p *corev1.Pod) { p.OwnerReferences[0].UID = "old-ds" }), "not the current one"},
		{pod("other-node", func(p *corev1.Pod) { p.Spec.NodeName = "n2" }), `runs on node "n2"`},
		{pod("other-image", func(p *corev1.Pod) { p.Spec.Containers[0].Image = "evil:1" }), "does not run its DaemonSet's collector"},
		{pod("other-args", func(p *corev1.Pod) { p.Spec.Containers[0].Args = []string{"--node-name=n1", "--interval=1h"} }), "does not run"},
		{pod("pod-network", func(p *corev1.Pod) { p.Spec.HostNetwork = false }), "hostNetwork false"},
		{pod("sidecar", func(p *corev1.Pod) {
			p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "tamper", Image: "evil:1"})
		}), "2 containers"},
		{pod("forged-revision", func(p *corev1.Pod) { p.Labels[appsv1.DefaultDaemonSetUniqueLabelKey] = "forged" }), "is not the DaemonSet's"},
		{pod("no-revision", func(p *corev1.Pod) { p.Labels = nil }), "ControllerRevision"},
	}
	objs := []runtime.Object{ds, rev, forged}
	for _, c := range cases {
		objs = append(objs, c.pod)
	}
	b := &DaemonSetBinding{Client: fake.NewClientset(objs...), Namespace: "pa", Name: "proxyaudit-collector"}
	for _, c := range cases {
		extra := map[string]authnv1.ExtraValue{PodNameExtra: {c.pod.Name}, PodUIDExtra: {string(c.pod.UID)}}
		err := b.Check(context.Background(), extra, "n1")
		switch {
		case c.says == "" && err != nil:
			t.Errorf("%s: refused: %v", c.pod.Name, err)
		case c.says != "" && (err == nil || !strings.Contains(err.Error(), c.says)):
			t.Errorf("%s: %v; want it to say %q", c.pod.Name, err, c.says)
		}
	}
	// A token for a pod of that name but another UID (deleted and made
	// again by someone else).
	extra := map[string]authnv1.ExtraValue{PodNameExtra: {"genuine"}, PodUIDExtra: {"uid-of-an-earlier-pod"}}
	if err := b.Check(context.Background(), extra, "n1"); err == nil || !strings.Contains(err.Error(), "not the one the token was issued for") {
		t.Errorf("token of an earlier pod of that name: %v", err)
	}
	if err := b.Check(context.Background(), nil, "n1"); err == nil || !strings.Contains(err.Error(), "names no pod") {
		t.Errorf("token without pod extras: %v", err)
	}
}
