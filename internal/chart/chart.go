// Package chart renders the Helm chart under charts/proxyaudit with the
// pinned Helm CLI and turns what it renders into things tests can use: the
// objects to apply to a real API server, and the command line and
// environment of each container, so the end-to-end tests run the binaries
// exactly as the chart would and the two cannot drift apart.
package chart

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/restmapper"
)

// Dir is the chart's directory relative to the repository root.
const Dir = "charts/proxyaudit"

// Helm returns the pinned Helm binary, building it on first use
// (deploy/k8s-tools/helm.sh caches it).
func Helm(root string) (string, error) {
	var stderr bytes.Buffer
	cmd := exec.Command(filepath.Join(root, "deploy/k8s-tools/helm.sh"))
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("build helm: %v\n%s", err, stderr.String())
	}
	return strings.TrimSpace(string(out)), nil
}

// Release is one rendering of the chart.
type Release struct {
	Name, Namespace string
	Manifest        []byte
	Objects         []*unstructured.Unstructured
	// Cluster, when set, supplies the Secrets the chart does not render
	// (the TLS pair the aggregator makes), as the kubelet would.
	Cluster kubernetes.Interface
}

// Render runs `helm template` with the values files and --set values.
func Render(root, release, namespace string, valuesFiles []string, sets ...string) (*Release, error) {
	helm, err := Helm(root)
	if err != nil {
		return nil, err
	}
	args := []string{"template", release, filepath.Join(root, Dir), "--namespace", namespace}
	for _, f := range valuesFiles {
		args = append(args, "--values", f)
	}
	for _, s := range sets {
		args = append(args, "--set", s)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(helm, args...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	r := &Release{Name: release, Namespace: namespace, Manifest: out}
	if err := r.Decode(out); err != nil {
		return nil, fmt.Errorf("rendered chart: %w", err)
	}
	return r, nil
}

// Decode adds the objects of a multi-document YAML stream.
func (r *Release) Decode(doc []byte) error {
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(doc), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			return nil
		} else if err != nil {
			return err
		}
		if m != nil {
			r.Objects = append(r.Objects, &unstructured.Unstructured{Object: m})
		}
	}
}

// Find returns the rendered object of that kind and name, or nil.
func (r *Release) Find(kind, name string) *unstructured.Unstructured {
	for _, o := range r.Objects {
		if o.GetKind() == kind && o.GetName() == name {
			return o
		}
	}
	return nil
}

// Kinds lists kind/name of every rendered object, sorted.
func (r *Release) Kinds() []string {
	var out []string
	for _, o := range r.Objects {
		out = append(out, o.GetKind()+"/"+o.GetName())
	}
	sort.Strings(out)
	return out
}

// PodSpec returns the pod template of the Deployment or DaemonSet.
func (r *Release) PodSpec(kind, name string) (*corev1.PodSpec, error) {
	o := r.Find(kind, name)
	if o == nil {
		return nil, fmt.Errorf("the chart renders no %s %s (it renders %v)", kind, name, r.Kinds())
	}
	switch kind {
	case "Deployment":
		var d appsv1.Deployment
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, &d, true); err != nil {
			return nil, fmt.Errorf("%s %s: %w", kind, name, err)
		}
		return &d.Spec.Template.Spec, nil
	case "DaemonSet":
		var d appsv1.DaemonSet
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, &d, true); err != nil {
			return nil, fmt.Errorf("%s %s: %w", kind, name, err)
		}
		return &d.Spec.Template.Spec, nil
	}
	return nil, fmt.Errorf("no pod template in a %s", kind)
}

// Apply applies every rendered object server-side, as one field manager,
// creating the release namespace first. Kinds the API server does not
// serve fail with their name.
func (r *Release) Apply(ctx context.Context, cfg *rest.Config) error {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ns := &unstructured.Unstructured{Object: map[string]any{"apiVersion": "v1", "kind": "Namespace", "metadata": map[string]any{"name": r.Namespace}}}
	var errs []error
	for _, o := range append([]*unstructured.Unstructured{ns}, r.Objects...) {
		gvk := o.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s %s: %w", gvk.Kind, o.GetName(), err))
			continue
		}
		var ri dynamic.ResourceInterface = dyn.Resource(m.Resource)
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			nsName := o.GetNamespace()
			if nsName == "" {
				nsName = r.Namespace
			}
			ri = dyn.Resource(m.Resource).Namespace(nsName)
		}
		body, err := o.MarshalJSON()
		if err != nil {
			return err
		}
		force := true
		if _, err := ri.Patch(ctx, o.GetName(), types.ApplyPatchType, body, metav1.PatchOptions{FieldManager: "proxyaudit-chart-test", Force: &force}); err != nil {
			errs = append(errs, fmt.Errorf("apply %s %s: %w", gvk.Kind, o.GetName(), err))
		}
	}
	return errors.Join(errs...)
}

// Local is what a pod's container needs to run as a process on this
// machine: its command line and environment, with every volume it mounts
// written under a directory and the paths in the arguments moved there.
type Local struct {
	Args []string // command and args
	Env  []string // KEY=value
}

// Pod supplies what the kubelet would: downward-API fields and projected
// ServiceAccount tokens.
type Pod struct {
	Fields map[string]string // fieldPath (status.podIP, spec.nodeName, ...) to value
	Token  func(audience string) (string, error)
}

// Localize turns container c of the pod spec into a Local under dir.
func (r *Release) Localize(spec *corev1.PodSpec, container, dir string, pod Pod) (*Local, error) {
	var c *corev1.Container
	for i := range spec.Containers {
		if spec.Containers[i].Name == container {
			c = &spec.Containers[i]
		}
	}
	if c == nil {
		return nil, fmt.Errorf("no container %q", container)
	}
	vols := map[string]corev1.Volume{}
	for _, v := range spec.Volumes {
		vols[v.Name] = v
	}
	moved := map[string]string{} // mount path to local directory
	for _, m := range c.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			return nil, fmt.Errorf("volume mount %s has no volume", m.Name)
		}
		local := filepath.Join(dir, m.Name)
		files, err := r.volumeFiles(v, pod)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", v.Name, err)
		}
		if files == nil { // a host path: the process sees the real one
			continue
		}
		for name, data := range files {
			p := filepath.Join(local, name)
			if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
				return nil, err
			}
			if err := os.WriteFile(p, data, 0o600); err != nil {
				return nil, err
			}
		}
		moved[m.MountPath] = local
	}
	move := func(s string) string {
		for mount, local := range moved {
			s = strings.ReplaceAll(s, mount+"/", local+"/")
		}
		return s
	}
	l := &Local{}
	env := map[string]string{}
	for _, e := range c.Env {
		val := e.Value
		switch {
		case e.ValueFrom == nil:
		case e.ValueFrom.FieldRef != nil:
			v, ok := pod.Fields[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				return nil, fmt.Errorf("env %s: no value given for field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			val = v
		case e.ValueFrom.SecretKeyRef != nil:
			data, err := r.SecretData(e.ValueFrom.SecretKeyRef.Name)
			if err != nil {
				return nil, fmt.Errorf("env %s: %w", e.Name, err)
			}
			val = string(data[e.ValueFrom.SecretKeyRef.Key])
		case e.ValueFrom.ResourceFieldRef != nil:
			v, err := resourceField(c, e.ValueFrom.ResourceFieldRef)
			if err != nil {
				return nil, fmt.Errorf("env %s: %w", e.Name, err)
			}
			val = v
		default:
			return nil, fmt.Errorf("env %s: a source Localize does not know", e.Name)
		}
		l.Env = append(l.Env, e.Name+"="+move(val))
		env[e.Name] = val
	}
	// Command and arguments after the environment: the kubelet expands
	// $(VAR) in them from the container's variables.
	for _, a := range append(append([]string{}, c.Command...), c.Args...) {
		x, err := expand(a, env)
		if err != nil {
			return nil, err
		}
		l.Args = append(l.Args, move(x))
	}
	return l, nil
}

// expand replaces $(VAR) in a command or argument with the container's
// variable, as the kubelet does; $$ is a literal $. A reference to a
// variable the container does not define is refused (the kubelet would
// leave it as written, which no test of the chart means).
func expand(a string, env map[string]string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(a); i++ {
		switch {
		case strings.HasPrefix(a[i:], "$$"):
			b.WriteByte('$')
			i++
		case strings.HasPrefix(a[i:], "$("):
			end := strings.IndexByte(a[i:], ')')
			if end < 0 {
				return "", fmt.Errorf("argument %q: an unclosed $(", a)
			}
			name := a[i+2 : i+end]
			v, ok := env[name]
			if !ok {
				return "", fmt.Errorf("argument %q uses $(%s), which the container does not define", a, name)
			}
			b.WriteString(v)
			i += end
		default:
			b.WriteByte(a[i])
		}
	}
	return b.String(), nil
}

// resourceField is what the kubelet puts in an env var from the
// container's own memory request or limit: bytes over the divisor, rounded
// up. (Without the limit set the kubelet gives the node's allocatable
// memory, which a local process has no equivalent of.)
func resourceField(c *corev1.Container, ref *corev1.ResourceFieldSelector) (string, error) {
	if ref.ContainerName != "" && ref.ContainerName != c.Name {
		return "", fmt.Errorf("resource of container %s: only the container's own", ref.ContainerName)
	}
	var q resource.Quantity
	var ok bool
	switch ref.Resource {
	case "limits.memory":
		q, ok = c.Resources.Limits[corev1.ResourceMemory]
	case "requests.memory":
		q, ok = c.Resources.Requests[corev1.ResourceMemory]
	default:
		return "", fmt.Errorf("resource %s: only limits.memory and requests.memory", ref.Resource)
	}
	if !ok {
		return "", fmt.Errorf("resource %s is not set on container %s", ref.Resource, c.Name)
	}
	div := int64(1)
	if !ref.Divisor.IsZero() {
		div = ref.Divisor.Value()
	}
	return strconv.FormatInt((q.Value()+div-1)/div, 10), nil
}

// volumeFiles returns the files a volume holds, nil for a host path.
func (r *Release) volumeFiles(v corev1.Volume, pod Pod) (map[string][]byte, error) {
	switch {
	case v.HostPath != nil:
		return nil, nil
	case v.Secret != nil:
		data, err := r.SecretData(v.Secret.SecretName)
		if err != nil {
			return nil, err
		}
		return items(data, v.Secret.Items)
	case v.Projected != nil:
		files := map[string][]byte{}
		for _, src := range v.Projected.Sources {
			if src.ServiceAccountToken == nil {
				return nil, errors.New("projected source other than a ServiceAccount token")
			}
			if pod.Token == nil {
				return nil, fmt.Errorf("volume %s projects a ServiceAccount token for %q: give the Pod a Token", v.Name, src.ServiceAccountToken.Audience)
			}
			tok, err := pod.Token(src.ServiceAccountToken.Audience)
			if err != nil {
				return nil, err
			}
			files[src.ServiceAccountToken.Path] = []byte(tok)
		}
		return files, nil
	}
	return nil, errors.New("a volume type Localize does not know")
}

func items(data map[string][]byte, keys []corev1.KeyToPath) (map[string][]byte, error) {
	if len(keys) == 0 {
		return data, nil
	}
	out := map[string][]byte{}
	for _, k := range keys {
		d, ok := data[k.Key]
		if !ok {
			return nil, fmt.Errorf("key %s missing", k.Key)
		}
		out[k.Path] = d
	}
	return out, nil
}

// SecretData reads a rendered Secret's data and stringData.
func (r *Release) SecretData(name string) (map[string][]byte, error) {
	o := r.Find("Secret", name)
	if o == nil && r.Cluster != nil {
		s, err := r.Cluster.CoreV1().Secrets(r.Namespace).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			return nil, fmt.Errorf("read the Secret %s/%s: %w", r.Namespace, name, err)
		}
		return s.Data, nil
	}
	if o == nil {
		return nil, fmt.Errorf("the chart renders no Secret %s (an existing Secret is not available to a local run)", name)
	}
	out := map[string][]byte{}
	data, _, _ := unstructured.NestedStringMap(o.Object, "data")
	for k, v := range data {
		b, err := base64.StdEncoding.DecodeString(v)
		if err != nil {
			return nil, fmt.Errorf("secret %s key %s: %w", name, k, err)
		}
		out[k] = b
	}
	str, _, _ := unstructured.NestedStringMap(o.Object, "stringData")
	for k, v := range str {
		out[k] = []byte(v)
	}
	return out, nil
}

// ApplyCRD applies a document of CustomResourceDefinitions (as Apply does)
// and waits, up to 30 s, until the API serves groupVersion.
func ApplyCRD(ctx context.Context, cfg *rest.Config, doc []byte, groupVersion string) error {
	rel := Release{Namespace: "default"}
	if err := rel.Decode(doc); err != nil {
		return err
	}
	if err := rel.Apply(ctx, cfg); err != nil {
		return err
	}
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		_, err := dc.ServerResourcesForGroupVersion(groupVersion)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not served 30 s after its CRD was applied: %w", groupVersion, err)
		}
	}
}
