package localcluster

import (
	"context"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/proxyaudit/proxyaudit/internal/image"
)

// corefile serves the cluster's names only: nothing upstream is reachable.
const corefile = `.:53 {
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }
    cache 30
    loop
}
`

// DeployDNS runs CoreDNS as kubeadm does (Deployment coredns, Service
// kube-dns on ClusterDNSIP, the system:coredns role) on the real nodes,
// so pods find Services by name.
func (c *Cluster) DeployDNS(ctx context.Context) error {
	ns := "kube-system"
	labels := map[string]string{"k8s-app": "kube-dns"}
	create := func(err error) error {
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	}
	if err := create2(c.Client.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: ns}}, metav1.CreateOptions{})); create(err) != nil {
		return err
	}
	cr := &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"endpoints", "services", "pods", "namespaces"}, Verbs: []string{"list", "watch"}},
			{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"list", "watch"}},
		},
	}
	if err := create2(c.Client.RbacV1().ClusterRoles().Create(ctx, cr, metav1.CreateOptions{})); create(err) != nil {
		return err
	}
	crb := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "system:coredns"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "system:coredns"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "coredns", Namespace: ns}},
	}
	if err := create2(c.Client.RbacV1().ClusterRoleBindings().Create(ctx, crb, metav1.CreateOptions{})); create(err) != nil {
		return err
	}
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: ns}, Data: map[string]string{"Corefile": corefile}}
	if err := create2(c.Client.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{})); create(err) != nil {
		return err
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "kube-dns", Namespace: ns, Labels: labels},
		Spec: corev1.ServiceSpec{
			ClusterIP: ClusterDNSIP,
			Selector:  labels,
			Ports: []corev1.ServicePort{
				{Name: "dns", Port: 53, Protocol: corev1.ProtocolUDP, TargetPort: intstr.FromInt32(53)},
				{Name: "dns-tcp", Port: 53, Protocol: corev1.ProtocolTCP, TargetPort: intstr.FromInt32(53)},
			},
		},
	}
	if err := create2(c.Client.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})); create(err) != nil {
		return err
	}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "coredns", Namespace: ns, Labels: labels},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptrTo(int32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{
					ServiceAccountName: "coredns",
					PriorityClassName:  "system-cluster-critical",
					DNSPolicy:          corev1.DNSDefault,
					// The image runs as 65532 and has no file capabilities:
					// port 53 is opened to it in the pod's own namespace.
					SecurityContext: &corev1.PodSecurityContext{Sysctls: []corev1.Sysctl{{Name: "net.ipv4.ip_unprivileged_port_start", Value: "53"}}},
					Tolerations:     []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{
						Name:            "coredns",
						Image:           image.CoreDNSRef,
						ImagePullPolicy: corev1.PullIfNotPresent,
						Args:            []string{"-conf", "/etc/coredns/Corefile"},
						Ports: []corev1.ContainerPort{
							{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP},
							{Name: "dns-tcp", ContainerPort: 53, Protocol: corev1.ProtocolTCP},
						},
						ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8181)}},
							PeriodSeconds: 2},
						SecurityContext: &corev1.SecurityContext{
							AllowPrivilegeEscalation: ptrTo(false),
							ReadOnlyRootFilesystem:   ptrTo(true),
							Capabilities:             &corev1.Capabilities{Add: []corev1.Capability{"NET_BIND_SERVICE"}, Drop: []corev1.Capability{"ALL"}},
						},
						VolumeMounts: []corev1.VolumeMount{{Name: "config", MountPath: "/etc/coredns", ReadOnly: true}},
					}},
					Volumes: []corev1.Volume{{Name: "config", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
						LocalObjectReference: corev1.LocalObjectReference{Name: "coredns"}}}}},
				},
			},
		},
	}
	return create(create2(c.Client.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{})))
}

// create2 drops a Create's object, keeping its error.
func create2[T any](_ T, err error) error { return err }
