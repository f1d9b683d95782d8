package localcluster

import (
	"context"
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// EnsureNamespace creates the namespace if it does not exist.
func (c *Cluster) EnsureNamespace(ctx context.Context, name string) error {
	_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// CreateService creates svc (and its namespace) and returns it with the
// cluster IP and node ports the API server allocated.
func (c *Cluster) CreateService(ctx context.Context, svc *corev1.Service) (*corev1.Service, error) {
	if err := c.EnsureNamespace(ctx, svc.Namespace); err != nil {
		return nil, err
	}
	out, err := c.Client.CoreV1().Services(svc.Namespace).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create service %s/%s: %w", svc.Namespace, svc.Name, err)
	}
	if len(svc.Status.LoadBalancer.Ingress) > 0 {
		out.Status.LoadBalancer = svc.Status.LoadBalancer
		if out, err = c.Client.CoreV1().Services(svc.Namespace).UpdateStatus(ctx, out, metav1.UpdateOptions{}); err != nil {
			return nil, fmt.Errorf("set load-balancer status of %s/%s: %w", svc.Namespace, svc.Name, err)
		}
	}
	return out, nil
}

// ApplySlice creates the EndpointSlice or replaces its endpoints and ports.
// The slice must carry the kubernetes.io/service-name label; no controller
// runs here, so tests own every slice and its churn.
func (c *Cluster) ApplySlice(ctx context.Context, s *discoveryv1.EndpointSlice) error {
	api := c.Client.DiscoveryV1().EndpointSlices(s.Namespace)
	cur, err := api.Get(ctx, s.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = api.Create(ctx, s, metav1.CreateOptions{})
	} else if err == nil {
		cur.Endpoints, cur.Ports, cur.Labels = s.Endpoints, s.Ports, s.Labels
		_, err = api.Update(ctx, cur, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("apply EndpointSlice %s/%s: %w", s.Namespace, s.Name, err)
	}
	return nil
}

// Slice builds an EndpointSlice for service svc with one named port and
// the given ready endpoints (IPv6 when they are IPv6 addresses).
func Slice(svc *corev1.Service, name, portName string, port int32, proto corev1.Protocol, ips ...string) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: svc.Namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: svc.Name, discoveryv1.LabelManagedBy: "proxyaudit-tests"},
		},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports:       []discoveryv1.EndpointPort{{Name: &portName, Port: &port, Protocol: &proto}},
	}
	if len(ips) > 0 && strings.Contains(ips[0], ":") {
		s.AddressType = discoveryv1.AddressTypeIPv6
	}
	for _, ip := range ips {
		s.Endpoints = append(s.Endpoints, ReadyEndpoint(ip, ""))
	}
	return s
}

// ReadyEndpoint is a ready, serving endpoint on the given node (may be empty).
func ReadyEndpoint(ip, node string) discoveryv1.Endpoint {
	t := true
	e := discoveryv1.Endpoint{
		Addresses:  []string{ip},
		Conditions: discoveryv1.EndpointConditions{Ready: &t, Serving: &t, Terminating: new(bool)},
	}
	if node != "" {
		e.NodeName = &node
	}
	return e
}

// DumpClusterJSON returns Services, EndpointSlices and Nodes as one v1 List,
// the shape of `kubectl get services,endpointslices,nodes -A -o json`.
func (c *Cluster) DumpClusterJSON(ctx context.Context) ([]byte, error) {
	var items []any
	svcs, err := c.Client.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list services: %w", err)
	}
	for i := range svcs.Items {
		s := svcs.Items[i]
		s.APIVersion, s.Kind = "v1", "Service"
		s.ManagedFields = nil
		items = append(items, s)
	}
	slices, err := c.Client.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list endpointslices: %w", err)
	}
	for i := range slices.Items {
		s := slices.Items[i]
		s.APIVersion, s.Kind = "discovery.k8s.io/v1", "EndpointSlice"
		s.ManagedFields = nil
		items = append(items, s)
	}
	nodes, err := c.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", err)
	}
	for i := range nodes.Items {
		n := nodes.Items[i]
		n.APIVersion, n.Kind = "v1", "Node"
		n.ManagedFields = nil
		items = append(items, n)
	}
	return json.MarshalIndent(map[string]any{"apiVersion": "v1", "kind": "List", "metadata": map[string]any{"resourceVersion": ""}, "items": items}, "", "    ")
}

// PodToken returns a ServiceAccount token for namespace/serviceAccount,
// bound to a pod on node and issued for audience, as the kubelet mounts a
// projected token into a DaemonSet pod: the API server's TokenReview then
// names the node in the user's extra. No kubelet runs here, so the pod
// (named NAME-NODE) stays Pending; it exists only to bind the token. The
// account and pod are created when missing.
func (c *Cluster) PodToken(ctx context.Context, namespace, serviceAccount, node, audience string) (string, error) {
	if err := c.EnsureNamespace(ctx, namespace); err != nil {
		return "", err
	}
	_, err := c.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: serviceAccount}}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("create service account %s/%s: %w", namespace, serviceAccount, err)
	}
	name := serviceAccount + "-" + node
	pods := c.Client.CoreV1().Pods(namespace)
	pod, err := pods.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		pod, err = pods.Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: corev1.PodSpec{
				NodeName:                     node,
				ServiceAccountName:           serviceAccount,
				AutomountServiceAccountToken: ptrTo(false),
				Containers:                   []corev1.Container{{Name: "collector", Image: "proxyaudit-collector:test-stand-in"}},
			},
		}, metav1.CreateOptions{})
	}
	if err != nil {
		return "", fmt.Errorf("pod %s/%s to bind the token to: %w", namespace, name, err)
	}
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, serviceAccount, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences:         []string{audience},
		ExpirationSeconds: ptrTo(int64(3600)),
		BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request a token for %s/%s bound to pod %s: %w", namespace, serviceAccount, pod.Name, err)
	}
	return tr.Status.Token, nil
}

// DaemonSetPodToken is PodToken for a pod of the DaemonSet namespace/name
// (as applied to the API server), made as the DaemonSet controller makes
// one, since no controller manager runs here: a ControllerRevision holding
// the DaemonSet's template, and a pod from that template on node, owned by
// the DaemonSet and labelled with the revision's hash. A pod made from an
// older template is replaced.
func (c *Cluster) DaemonSetPodToken(ctx context.Context, namespace, name, node, audience string) (string, error) {
	ds, err := c.Client.AppsV1().DaemonSets(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("DaemonSet %s/%s: %w", namespace, name, err)
	}
	data, err := json.Marshal(map[string]any{"spec": map[string]any{"template": ds.Spec.Template}})
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(data)
	hash := fmt.Sprintf("%x", sum[:5])
	owner := *metav1.NewControllerRef(ds, appsv1.SchemeGroupVersion.WithKind("DaemonSet"))
	rev := &appsv1.ControllerRevision{ObjectMeta: metav1.ObjectMeta{Name: name + "-" + hash, Namespace: namespace, OwnerReferences: []metav1.OwnerReference{owner}},
		Data: runtime.RawExtension{Raw: data}, Revision: 1}
	if _, err := c.Client.AppsV1().ControllerRevisions(namespace).Create(ctx, rev, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return "", fmt.Errorf("ControllerRevision %s: %w", rev.Name, err)
	}
	pods := c.Client.CoreV1().Pods(namespace)
	podName := name + "-" + node
	pod, err := pods.Get(ctx, podName, metav1.GetOptions{})
	if err == nil && (pod.Labels[appsv1.DefaultDaemonSetUniqueLabelKey] != hash || metav1.GetControllerOf(pod) == nil || metav1.GetControllerOf(pod).UID != ds.UID) {
		zero := int64(0)
		if err := pods.Delete(ctx, podName, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil && !apierrors.IsNotFound(err) {
			return "", err
		}
		for err == nil {
			if ctx.Err() != nil {
				return "", ctx.Err()
			}
			time.Sleep(100 * time.Millisecond)
			_, err = pods.Get(ctx, podName, metav1.GetOptions{})
		}
	}
	if apierrors.IsNotFound(err) {
		labels := map[string]string{appsv1.DefaultDaemonSetUniqueLabelKey: hash}
		for k, v := range ds.Spec.Template.Labels {
			labels[k] = v
		}
		spec := *ds.Spec.Template.Spec.DeepCopy()
		spec.NodeName = node
		pod, err = pods.Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: podName, Labels: labels, Annotations: ds.Spec.Template.Annotations,
			OwnerReferences: []metav1.OwnerReference{owner}}, Spec: spec}, metav1.CreateOptions{})
	}
	if err != nil {
		return "", fmt.Errorf("pod %s/%s of DaemonSet %s: %w", namespace, podName, name, err)
	}
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, pod.Spec.ServiceAccountName, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		Audiences:         []string{audience},
		ExpirationSeconds: ptrTo(int64(3600)),
		BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request a token bound to pod %s/%s: %w", namespace, pod.Name, err)
	}
	return tr.Status.Token, nil
}

func ptrTo[T any](v T) *T { return &v }

// ServiceAccountKubeconfig writes a kubeconfig that authenticates as the
// ServiceAccount, with a token the API server accepts (its own audience),
// as a pod running under that account would have. The account must exist.
func (c *Cluster) ServiceAccountKubeconfig(ctx context.Context, namespace, serviceAccount, path string) error {
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, serviceAccount, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		ExpirationSeconds: ptrTo(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("request a token for %s/%s: %w", namespace, serviceAccount, err)
	}
	return writeKubeconfig(path, c.RESTConfig.Host, c.RESTConfig.CAFile, tr.Status.Token, "")
}

// ImpersonatingKubeconfig writes a kubeconfig that acts as user (kubectl's
// --as), authenticated by the admin: what it may do is what RBAC grants
// that user, nothing more.
func (c *Cluster) ImpersonatingKubeconfig(user, path string) error {
	return writeKubeconfig(path, c.RESTConfig.Host, c.RESTConfig.CAFile, c.RESTConfig.BearerToken, user)
}

// Kubectl returns the genuine kubectl built with the cluster's binaries.
func (c *Cluster) Kubectl() string { return filepath.Join(c.bin, "kubectl") }

// Redate gives a token this cluster's API server issued new issue and
// expiry times and signs it again with the API server's own
// service-account key: the token the API server would have issued at
// issued, valid until expires. With both in the past it is a genuinely
// expired token, which TokenRequest cannot make (its shortest lifetime is
// ten minutes); with expires ahead it must still be accepted (the check
// that the signing is the API server's).
func (c *Cluster) Redate(token string, issued, expires time.Time) (string, error) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return "", fmt.Errorf("not a JWT: %d parts", len(parts))
	}
	raw, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		return "", fmt.Errorf("JWT claims: %w", err)
	}
	var claims map[string]any
	if err := json.Unmarshal(raw, &claims); err != nil {
		return "", fmt.Errorf("JWT claims: %w", err)
	}
	claims["iat"], claims["nbf"], claims["exp"] = issued.Unix(), issued.Unix(), expires.Unix()
	if k8s, ok := claims["kubernetes.io"].(map[string]any); ok {
		delete(k8s, "warnafter")
	}
	body, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	pemKey, err := os.ReadFile(c.pki.SAKey)
	if err != nil {
		return "", err
	}
	block, _ := pem.Decode(pemKey)
	if block == nil {
		return "", fmt.Errorf("%s: no PEM block", c.pki.SAKey)
	}
	key, err := x509.ParsePKCS1PrivateKey(block.Bytes)
	if err != nil {
		return "", err
	}
	signed := parts[0] + "." + base64.RawURLEncoding.EncodeToString(body)
	sum := sha256.Sum256([]byte(signed))
	sig, err := rsa.SignPKCS1v15(rand.Reader, key, crypto.SHA256, sum[:])
	if err != nil {
		return "", err
	}
	return signed + "." + base64.RawURLEncoding.EncodeToString(sig), nil
}
