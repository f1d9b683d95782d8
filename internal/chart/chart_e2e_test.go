package chart_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	authzv1 "k8s.io/api/authorization/v1"
	coordv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	flowcontrolv1 "k8s.io/api/flowcontrol/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/tlssecret"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// The chart's tests need only the API server: no nodes.
func TestMain(m *testing.M) { localcluster.Main(m) }

// prometheusOperator pins the CRDs the optional ServiceMonitor and
// PrometheusRule are applied against, so their schemas check the chart.
const prometheusOperator = "github.com/prometheus-operator/prometheus-operator@v0.85.0"

func installMonitoringCRDs(ctx context.Context, t *testing.T, c *localcluster.Cluster) {
	t.Helper()
	dir := moduleDir(ctx, t, prometheusOperator)
	for _, kind := range []string{"servicemonitors", "prometheusrules"} {
		path := filepath.Join(dir, "example/prometheus-operator-crd", "monitoring.coreos.com_"+kind+".yaml")
		crd, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := chart.ApplyCRD(ctx, c.RESTConfig, crd, "monitoring.coreos.com/v1"); err != nil {
			t.Fatal(err)
		}
	}
}

// moduleDir downloads a pinned module through the module proxy (the
// only source CI has) and returns where it is.
func moduleDir(ctx context.Context, t *testing.T, module string) string {
	t.Helper()
	out, err := exec.CommandContext(ctx, "go", "mod", "download", "-json", module).Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v", module, err)
	}
	var mod struct{ Dir string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s: %v %s", module, err, out)
	}
	return mod.Dir
}

// Every values set under ci/ and the defaults apply server-side to the real
// API server: its schema validation, not only Helm's, checks every object.
func TestE2EChartAppliesServerSide(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	installMonitoringCRDs(ctx, t, c)
	for name, files := range valuesFiles(t) {
		t.Run(name, func(t *testing.T) {
			ns := "pa-" + name
			r, err := chart.Render(root(t), ns, ns, files)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.Apply(ctx, c.RESTConfig); err != nil {
				t.Fatal(err)
			}
			// Applying twice changes nothing and conflicts with nothing.
			if err := r.Apply(ctx, c.RESTConfig); err != nil {
				t.Fatalf("second apply: %v", err)
			}
			t.Logf("applied %d objects: %v", len(r.Objects), r.Kinds())
		})
	}
}

func helmCmd(ctx context.Context, t *testing.T, c *localcluster.Cluster, args ...string) (string, error) {
	t.Helper()
	out, err := (&localcluster.System{C: c}).Helm(ctx, args...)
	return string(out), err
}

// The README's quickstart, as a user runs it: helm install, then upgrade
// (the generated CA must survive, or every collector stops trusting the
// aggregator), NOTES that warn about unsafe settings, uninstall.
func TestE2EHelmInstallUpgrade(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := filepath.Join(root(t), chart.Dir)
	out, err := helmCmd(ctx, t, c, "install", "proxyaudit", dir, "--namespace", "proxyaudit", "--create-namespace")
	if err != nil {
		t.Fatalf("helm install: %v\n%s", err, out)
	}
	for _, want := range []string{"kubectl proxyaudit report -n proxyaudit", "Remediation: dry-run", "Nobody is paged",
		"kubectl label namespace proxyaudit pod-security.kubernetes.io/enforce=privileged --overwrite",
		"kubectl proxyaudit pause -n proxyaudit --pause-configmap proxyaudit-aggregator-pause", "set remediation.pausers"} {
		if !strings.Contains(out, want) {
			t.Errorf("NOTES lack %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "WARNING") {
		t.Errorf("default install warns:\n%s", out)
	}
	// The aggregator's first start makes the TLS pair (no pod runs here):
	// as its ServiceAccount, with the flags the chart gave it.
	dep, err := c.Client.AppsV1().Deployments("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	flag := func(name string) string {
		for _, a := range dep.Spec.Template.Spec.Containers[0].Args {
			if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
				return v
			}
		}
		t.Fatalf("the aggregator has no --%s", name)
		return ""
	}
	validity, err := time.ParseDuration(flag("tls-validity"))
	if err != nil {
		t.Fatal(err)
	}
	first := &tlssecret.SecretPair{Client: serviceAccount(t, c, "proxyaudit", "proxyaudit-aggregator"), Namespace: "proxyaudit", Name: flag("tls-secret"),
		Names: strings.Split(flag("tls-server-names"), ","), Validity: validity}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		if err = first.Ensure(ctx); err == nil || !apierrors.IsForbidden(err) || time.Now().After(deadline) {
			break // a fresh RoleBinding takes a moment to count
		}
	}
	if err != nil {
		t.Fatalf("the aggregator's ServiceAccount cannot make its TLS pair: %v", err)
	}
	ca := func() []byte {
		s, err := c.Client.CoreV1().Secrets("proxyaudit").Get(ctx, "proxyaudit-aggregator-tls", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return s.Data["ca.crt"]
	}
	before := ca()
	if len(before) == 0 {
		t.Fatal("no CA in the aggregator's Secret")
	}
	// The README's commands, word for word, with the genuine kubectl.
	for _, args := range [][]string{
		{"-n", "proxyaudit", "create", "rolebinding", "sre-reports", "--role", "proxyaudit-report-reader", "--group", "sre"},
		{"-n", "proxyaudit", "create", "secret", "generic", "proxyaudit-slack", "--from-literal=token=xoxb-readme"},
	} {
		cmd := exec.CommandContext(ctx, c.Kubectl(), args...)
		cmd.Env = append(os.Environ(), "KUBECONFIG="+c.AdminKubeconfig)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("kubectl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	sre := as(t, c, "alice", "sre")
	if _, err := sre.CoreV1().Services("proxyaudit").ProxyGet("http", "proxyaudit-aggregator", "http", "/api/v1/findings", nil).DoRaw(ctx); apierrors.IsForbidden(err) {
		t.Errorf("a member of group sre cannot read reports after the README's rolebinding: %v", err)
	}
	out, err = helmCmd(ctx, t, c, "upgrade", "proxyaudit", dir, "-n", "proxyaudit", "--reuse-values",
		"--set", "slack.existingSecret=proxyaudit-slack", "--set", "slack.channel=C0123456789", "--set", "remediation.mode=restart")
	if err != nil {
		t.Fatalf("helm upgrade (README): %v\n%s", err, out)
	}
	for _, want := range []string{"Remediation: restart", "Slack: bot", "a fleet under 10 nodes gets pages"} {
		if !strings.Contains(out, want) {
			t.Errorf("NOTES lack %q:\n%s", want, out)
		}
	}
	d, err := c.Client.AppsV1().Deployments("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"--remediation=restart", "--slack-channel=C0123456789", "--slack-token-file=/etc/proxyaudit/slack/credential"} {
		if !contains(d.Spec.Template.Spec.Containers[0].Args, want) {
			t.Errorf("Deployment args lack %s: %v", want, d.Spec.Template.Spec.Containers[0].Args)
		}
	}
	// A namespace whose PodSecurity level refuses the collectors is named
	// in the NOTES (the chart looks its label up).
	if _, err := c.Client.CoreV1().Namespaces().Patch(ctx, "proxyaudit", types.MergePatchType,
		[]byte(`{"metadata":{"labels":{"pod-security.kubernetes.io/enforce":"baseline"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	out, err = helmCmd(ctx, t, c, "upgrade", "proxyaudit", dir, "--namespace", "proxyaudit", "--reuse-values",
		"--set", "aggregator.replicas=1", "--set", "remediation.maxUnhealthy=50%")
	if err != nil {
		t.Fatalf("helm upgrade: %v\n%s", err, out)
	}
	if !bytes.Equal(before, ca()) {
		t.Error("helm upgrade replaced the CA the collectors trust")
	}
	for _, want := range []string{`WARNING: namespace proxyaudit enforces PodSecurity "baseline"`, "WARNING: one aggregator replica", "WARNING: remediation may act on up to 1 node(s) at once (maxUnhealthy 50%)",
		"a fleet under 2 nodes gets pages, not repairs"} {
		if !strings.Contains(out, want) {
			t.Errorf("NOTES lack %q:\n%s", want, out)
		}
	}
	d, err = c.Client.AppsV1().Deployments("proxyaudit").Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil || *d.Spec.Replicas != 1 || !contains(d.Spec.Template.Spec.Containers[0].Args, "--leader-elect=false") {
		t.Errorf("upgraded Deployment: %v", err)
	}
	if out, err := helmCmd(ctx, t, c, "uninstall", "proxyaudit", "--namespace", "proxyaudit", "--wait"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	if _, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("ClusterRole after uninstall: %v", err)
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

// as returns a client acting as the ServiceAccount (or user), the way the
// API server sees a pod's or a person's requests.
func as(t *testing.T, c *localcluster.Cluster, user string, groups ...string) kubernetes.Interface {
	t.Helper()
	cfg := rest.CopyConfig(c.RESTConfig)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: append(groups, "system:authenticated")}
	cl, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return cl
}

func serviceAccount(t *testing.T, c *localcluster.Cluster, ns, name string) kubernetes.Interface {
	return as(t, c, "system:serviceaccount:"+ns+":"+name, "system:serviceaccounts", "system:serviceaccounts:"+ns)
}

type check struct {
	what string
	do   func(ctx context.Context) error
}

// verify runs each action; allowed ones must not be Forbidden (a NotFound
// or an invalid body still proves the authorizer let it through), the
// others must be. The API server's RBAC authorizer reads bindings from an
// informer: one created a moment ago may take a moment to count, so an
// allowed action gets 10 s.
func verify(ctx context.Context, t *testing.T, who string, allowed, forbidden []check) {
	t.Helper()
	for _, ch := range allowed {
		err := ch.do(ctx)
		for deadline := time.Now().Add(10 * time.Second); apierrors.IsForbidden(err) && time.Now().Before(deadline); err = ch.do(ctx) {
			time.Sleep(200 * time.Millisecond)
		}
		if apierrors.IsForbidden(err) {
			t.Errorf("%s cannot %s: %v", who, ch.what, err)
		}
	}
	for _, ch := range forbidden {
		if err := ch.do(ctx); !apierrors.IsForbidden(err) {
			t.Errorf("%s may %s (want Forbidden, got %v)", who, ch.what, err)
		}
	}
}

var dryRun = []string{metav1.DryRunAll}

// The chart's RBAC, proven by acting as its ServiceAccounts: each can do
// what it needs and nothing else; remediation verbs exist only when
// remediation is on.
func TestE2EChartRBAC(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const ns = "pa-rbac"
	apply := func(sets ...string) {
		r, err := chart.Render(root(t), "proxyaudit", ns, nil, sets...)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Apply(ctx, c.RESTConfig); err != nil {
			t.Fatal(err)
		}
	}
	apply()
	agg := serviceAccount(t, c, ns, "proxyaudit-aggregator")
	barrierStamp := []byte(`{"metadata":{"labels":{"proxyaudit.io/barrier-at":"1"}}}`)
	nodePatch := []byte(`{"metadata":{"annotations":{"proxyaudit.io/cordoned-at":"2026-11-23T10:00:00Z"}},"spec":{"unschedulable":true}}`)
	incidents := func(ctx context.Context, name string) error {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string]string{"n": `{"stage":"open"}`}}
		if _, err := agg.CoreV1().ConfigMaps(ns).Create(ctx, cm, metav1.CreateOptions{DryRun: dryRun}); err != nil {
			return err
		}
		if _, err := agg.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		_, err := agg.CoreV1().ConfigMaps(ns).Update(ctx, cm, metav1.UpdateOptions{DryRun: dryRun})
		if apierrors.IsNotFound(err) {
			err = nil // allowed, and not there yet
		}
		return err
	}
	reads := []check{
		{"list services", func(ctx context.Context) error {
			_, err := agg.CoreV1().Services("").List(ctx, metav1.ListOptions{Limit: 1})
			return err
		}},
		{"list endpointslices", func(ctx context.Context) error {
			_, err := agg.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{Limit: 1})
			return err
		}},
		{"watch nodes", func(ctx context.Context) error {
			w, err := agg.CoreV1().Nodes().Watch(ctx, metav1.ListOptions{})
			if err == nil {
				w.Stop()
			}
			return err
		}},
		{"review a token", func(ctx context.Context) error {
			_, err := agg.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: "x"}}, metav1.CreateOptions{})
			return err
		}},
		{"ask whether an HTTP API caller may read", func(ctx context.Context) error {
			_, err := agg.AuthorizationV1().SubjectAccessReviews().Create(ctx, &authzv1.SubjectAccessReview{Spec: authzv1.SubjectAccessReviewSpec{
				User: "u", ResourceAttributes: &authzv1.ResourceAttributes{Namespace: ns, Verb: "get", Resource: "services", Subresource: "proxy", Name: "proxyaudit-aggregator"}}}, metav1.CreateOptions{})
			return err
		}},
		{"create its Lease", func(ctx context.Context) error {
			_, err := agg.CoordinationV1().Leases(ns).Create(ctx, &coordv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "proxyaudit-aggregator"}}, metav1.CreateOptions{DryRun: dryRun})
			return err
		}},
		{"get its Lease", func(ctx context.Context) error {
			_, err := agg.CoordinationV1().Leases(ns).Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
			return err
		}},
		{"watch its Lease (the freshness canary)", func(ctx context.Context) error {
			w, err := agg.CoordinationV1().Leases(ns).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=proxyaudit-aggregator"})
			if err == nil {
				w.Stop()
			}
			return err
		}},
		{"stamp its watch barrier Service", func(ctx context.Context) error {
			_, err := agg.CoreV1().Services(ns).Patch(ctx, "proxyaudit-barrier", types.MergePatchType, barrierStamp, metav1.PatchOptions{DryRun: dryRun})
			return err
		}},
		{"stamp its watch barrier EndpointSlice", func(ctx context.Context) error {
			_, err := agg.DiscoveryV1().EndpointSlices(ns).Patch(ctx, "proxyaudit-barrier", types.MergePatchType, barrierStamp, metav1.PatchOptions{DryRun: dryRun})
			return err
		}},
		{"read a collector's pod, its DaemonSet and its ControllerRevision", func(ctx context.Context) error {
			if _, err := agg.CoreV1().Pods(ns).Get(ctx, "proxyaudit-collector-n", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				return err
			}
			if _, err := agg.AppsV1().DaemonSets(ns).Get(ctx, "proxyaudit-collector", metav1.GetOptions{}); err != nil {
				return err
			}
			_, err := agg.AppsV1().ControllerRevisions(ns).Get(ctx, "proxyaudit-collector-0", metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				err = nil
			}
			return err
		}},
		{"record a node Event", func(ctx context.Context) error {
			_, err := agg.CoreV1().Events("default").Create(ctx, &corev1.Event{ObjectMeta: metav1.ObjectMeta{GenerateName: "n."},
				InvolvedObject: corev1.ObjectReference{Kind: "Node", Name: "n"}, Reason: "Test", Message: "m", Type: "Normal"}, metav1.CreateOptions{DryRun: dryRun})
			return err
		}},
	}
	remediation := []check{
		{"keep the incident record", func(ctx context.Context) error { return incidents(ctx, "proxyaudit-aggregator-incidents") }},
		{"cordon a node with its marker", func(ctx context.Context) error {
			_, err := agg.CoreV1().Nodes().Patch(ctx, "n", types.MergePatchType, nodePatch, metav1.PatchOptions{DryRun: dryRun})
			return err
		}},
		{"set a node condition", func(ctx context.Context) error {
			_, err := agg.CoreV1().Nodes().PatchStatus(ctx, "n", []byte(`{"status":{"conditions":[]}}`))
			return err
		}},
		{"find kube-proxy pods", func(ctx context.Context) error {
			_, err := agg.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=kube-proxy"})
			return err
		}},
		{"delete a kube-proxy pod", func(ctx context.Context) error {
			return agg.CoreV1().Pods("kube-system").Delete(ctx, "kube-proxy-n", metav1.DeleteOptions{DryRun: dryRun})
		}},
	}
	never := []check{
		{"read another ConfigMap", func(ctx context.Context) error {
			_, err := agg.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
			return err
		}},
		{"write another ConfigMap", func(ctx context.Context) error {
			_, err := agg.CoreV1().ConfigMaps(ns).Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.UpdateOptions{DryRun: dryRun})
			return err
		}},
		{"list pods in its namespace", func(ctx context.Context) error {
			_, err := agg.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			return err
		}},
		{"read another DaemonSet", func(ctx context.Context) error {
			_, err := agg.AppsV1().DaemonSets(ns).Get(ctx, "other", metav1.GetOptions{})
			return err
		}},
		{"read Secrets", func(ctx context.Context) error {
			_, err := agg.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
			return err
		}},
		{"delete a node", func(ctx context.Context) error {
			return agg.CoreV1().Nodes().Delete(ctx, "n", metav1.DeleteOptions{DryRun: dryRun})
		}},
		{"update a node", func(ctx context.Context) error {
			_, err := agg.CoreV1().Nodes().Update(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n"}}, metav1.UpdateOptions{DryRun: dryRun})
			return err
		}},
		{"delete pods outside the kube-proxy namespace", func(ctx context.Context) error {
			return agg.CoreV1().Pods("default").Delete(ctx, "p", metav1.DeleteOptions{DryRun: dryRun})
		}},
		{"watch every Lease", func(ctx context.Context) error {
			w, err := agg.CoordinationV1().Leases(ns).Watch(ctx, metav1.ListOptions{})
			if err == nil {
				w.Stop()
			}
			return err
		}},
		{"take another Lease", func(ctx context.Context) error {
			_, err := agg.CoordinationV1().Leases(ns).Get(ctx, "kube-scheduler", metav1.GetOptions{})
			return err
		}},
		{"create a Service", func(ctx context.Context) error {
			_, err := agg.CoreV1().Services(ns).Create(ctx, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "s"}, Spec: corev1.ServiceSpec{ClusterIP: corev1.ClusterIPNone}}, metav1.CreateOptions{DryRun: dryRun})
			return err
		}},
		{"patch another Service", func(ctx context.Context) error {
			_, err := agg.CoreV1().Services(ns).Patch(ctx, "proxyaudit-aggregator", types.MergePatchType, barrierStamp, metav1.PatchOptions{DryRun: dryRun})
			return err
		}},
		{"create an EndpointSlice", func(ctx context.Context) error {
			_, err := agg.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Name: "s"}, AddressType: discoveryv1.AddressTypeIPv4}, metav1.CreateOptions{DryRun: dryRun})
			return err
		}},
		{"create pods", func(ctx context.Context) error {
			_, err := agg.CoreV1().Pods("kube-system").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p"}}, metav1.CreateOptions{DryRun: dryRun})
			return err
		}},
	}
	verify(ctx, t, "aggregator (dry-run)", reads, append(never, remediation...))

	col := serviceAccount(t, c, ns, "proxyaudit-collector")
	verify(ctx, t, "collector", nil, []check{
		{"list services", func(ctx context.Context) error {
			_, err := col.CoreV1().Services("").List(ctx, metav1.ListOptions{})
			return err
		}},
		{"get nodes", func(ctx context.Context) error {
			_, err := col.CoreV1().Nodes().Get(ctx, "n", metav1.GetOptions{})
			return err
		}},
		{"review a token", func(ctx context.Context) error {
			_, err := col.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: "x"}}, metav1.CreateOptions{})
			return err
		}},
		{"read Secrets in its namespace", func(ctx context.Context) error {
			_, err := col.CoreV1().Secrets(ns).Get(ctx, "proxyaudit-aggregator-tls", metav1.GetOptions{})
			return err
		}},
	})

	// Someone bound to the report-reader Role reaches the aggregator
	// through the service proxy, and nothing else.
	if _, err := c.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "sre"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "proxyaudit-report-reader"},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: rbacv1.GroupName, Name: "sre@example.com"}}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	sre := as(t, c, "sre@example.com")
	proxy := func(svc string) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			_, err := sre.CoreV1().Services(ns).ProxyGet("http", svc, "http", "/api/v1/findings", nil).DoRaw(ctx)
			return err
		}
	}
	mint := func(sa string) func(ctx context.Context) error {
		return func(ctx context.Context) error {
			_, err := sre.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
				Audiences: []string{"proxyaudit-api"}}}, metav1.CreateOptions{})
			return err
		}
	}
	verify(ctx, t, "report reader", []check{
		{"read the report", proxy("proxyaudit-aggregator")},
		{"mint a reader token", mint("proxyaudit-reader")},
	}, []check{
		{"proxy to another service", proxy("other")},
		{"mint a token for the aggregator", mint("proxyaudit-aggregator")},
		{"mint a token for the collector", mint("proxyaudit-collector")},
		{"list pods", func(ctx context.Context) error {
			_, err := sre.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
			return err
		}},
	})

	// With Cilium's agent restarted on Cilium nodes, from a namespace of
	// its own: its Role there, and the policy's second selector.
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "pa-cilium"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	apply("remediation.mode=restart-and-cordon", "cilium.enabled=true", "cilium.namespace=pa-cilium")
	verify(ctx, t, "aggregator (restart-and-cordon)", append(reads, remediation...), never)
	t.Run("admission policy holds remediation to kube-proxy and Cilium agent pods and the cordon", func(t *testing.T) { admissionLimits(ctx, t, c, agg, ns) })
	t.Run("a pause names its writer as the API server knows them", func(t *testing.T) { pauseNamesItsWriter(ctx, t, c, ns) })
}

// Anyone allowed to pause writes the pause ConfigMap; its "by" must be who
// the API server says writes it, else every page while paused would blame
// whoever the writer chose. Server-side dry runs: admission runs, nothing
// changes.
func pauseNamesItsWriter(ctx context.Context, t *testing.T, c *localcluster.Cluster, ns string) {
	if _, err := c.Client.RbacV1().RoleBindings(ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "oncall-pause"},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "proxyaudit-aggregator-pause"},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: rbacv1.GroupName, Name: "oncall@example.com"}}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	oncall := as(t, c, "oncall@example.com")
	pause := func(by string) func(context.Context) error {
		return func(ctx context.Context) error {
			body, _ := json.Marshal(map[string]any{"data": remediate.PauseRequest{By: by, Reason: "drill", Since: time.Now()}.Data()})
			_, err := oncall.CoreV1().ConfigMaps(ns).Patch(ctx, "proxyaudit-aggregator-pause", types.MergePatchType, body, metav1.PatchOptions{DryRun: dryRun})
			return err
		}
	}
	// The API server loads a new policy from an informer: give it a while.
	var err error
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(300 * time.Millisecond) {
		if err = pause("the-cto@example.com")(ctx); apierrors.IsForbidden(err) || time.Now().After(deadline) {
			break
		}
	}
	if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), `the API server knows the writer as "oncall@example.com"`) {
		t.Errorf("a pause naming someone else: %v, want Forbidden saying who writes it", err)
	}
	verify(ctx, t, "a pauser", []check{
		{"pause naming themselves", pause("oncall@example.com")},
		{"resume", func(ctx context.Context) error {
			_, err := oncall.CoreV1().ConfigMaps(ns).Patch(ctx, "proxyaudit-aggregator-pause", types.MergePatchType, []byte(`{"data":null}`), metav1.PatchOptions{DryRun: dryRun})
			return err
		}},
	}, []check{{"pause without saying who", pause("")}})
}

// RBAC lets the remediating aggregator delete any pod in kube-system and
// patch anything on a node; the chart's ValidatingAdmissionPolicy narrows
// that to kube-proxy pods, proxyaudit.io/ annotations, the cordon and the
// KubeProxyRulesStale condition. Every request is a server-side dry run
// against real objects, so admission runs and nothing changes.
func admissionLimits(ctx context.Context, t *testing.T, c *localcluster.Cluster, agg kubernetes.Interface, ns string) {
	for _, node := range []*corev1.Node{
		{ObjectMeta: metav1.ObjectMeta{Name: "pa-admission", Labels: map[string]string{"zone": "a"}, Annotations: map[string]string{"team": "net"}}},
		// Cordoned by an admin, and by proxyaudit (its record on the node).
		{ObjectMeta: metav1.ObjectMeta{Name: "pa-admission-admin"}, Spec: corev1.NodeSpec{Unschedulable: true}},
		{ObjectMeta: metav1.ObjectMeta{Name: "pa-admission-ours", Annotations: map[string]string{"proxyaudit.io/cordoned-at": "2026-11-23T10:00:00Z"}},
			Spec: corev1.NodeSpec{Unschedulable: true}},
	} {
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	// No controller manager here makes the namespace's default account.
	if _, err := c.Client.CoreV1().ServiceAccounts("kube-system").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().ServiceAccounts("pa-cilium").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for name, labels := range map[string]map[string]string{"kube-proxy-pa": {"k8s-app": "kube-proxy"}, "coredns-pa": {"k8s-app": "kube-dns"}, "unlabelled-pa": nil,
		"pa-cilium/cilium-pa": {"k8s-app": "cilium"}, "pa-cilium/cilium-operator-pa": {"io.cilium/app": "operator"}} {
		podNS, podName, found := strings.Cut(name, "/")
		if !found {
			podNS, podName = "kube-system", name
		}
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: podName, Namespace: podNS, Labels: labels},
			Spec: corev1.PodSpec{NodeName: "pa-admission", Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
		if _, err := c.Client.CoreV1().Pods(podNS).Create(ctx, pod, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	delIn := func(podNS, pod string) func(context.Context) error {
		return func(ctx context.Context) error {
			return agg.CoreV1().Pods(podNS).Delete(ctx, pod, metav1.DeleteOptions{DryRun: dryRun})
		}
	}
	patchNode := func(node, sub, body string) func(context.Context) error {
		return func(ctx context.Context) error {
			var subs []string
			if sub != "" {
				subs = []string{sub}
			}
			_, err := agg.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, []byte(body), metav1.PatchOptions{DryRun: dryRun}, subs...)
			return err
		}
	}
	patch := func(sub, body string) func(context.Context) error { return patchNode("pa-admission", sub, body) }
	barrierSvc := func(body string) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := agg.CoreV1().Services(ns).Patch(ctx, "proxyaudit-barrier", types.MergePatchType, []byte(body), metav1.PatchOptions{DryRun: dryRun})
			return err
		}
	}
	barrierSlice := func(body string) func(context.Context) error {
		return func(ctx context.Context) error {
			_, err := agg.DiscoveryV1().EndpointSlices(ns).Patch(ctx, "proxyaudit-barrier", types.MergePatchType, []byte(body), metav1.PatchOptions{DryRun: dryRun})
			return err
		}
	}
	del := func(pod string) func(context.Context) error {
		return func(ctx context.Context) error {
			return agg.CoreV1().Pods("kube-system").Delete(ctx, pod, metav1.DeleteOptions{DryRun: dryRun})
		}
	}
	denied := []check{
		{"delete a CoreDNS pod", del("coredns-pa")},
		{"delete an unlabelled pod", del("unlabelled-pa")},
		{"delete a Cilium operator pod", delIn("pa-cilium", "cilium-operator-pa")},
		{"label a node", patch("", `{"metadata":{"labels":{"zone":"b"}}}`)},
		{"taint a node", patch("", `{"spec":{"taints":[{"key":"x","effect":"NoSchedule"}]}}`)},
		{"write another annotation", patch("", `{"metadata":{"annotations":{"team":"other"}}}`)},
		{"remove another annotation", patch("", `{"metadata":{"annotations":{"team":null}}}`)},
		{"set the Ready condition", patch("status", `{"status":{"conditions":[{"type":"Ready","status":"False","reason":"x"}]}}`)},
		// The garbage collector would delete the Node (and so its pods).
		{"give a node an owner", patch("", `{"metadata":{"ownerReferences":[{"apiVersion":"v1","kind":"Namespace","name":"kube-system","uid":"6f1a5c1e-0000-4000-8000-000000000001"}]}}`)},
		{"add a finalizer to a node", patch("", `{"metadata":{"finalizers":["example.com/hold"]}}`)},
		{"label a node through its status", patch("status", `{"metadata":{"labels":{"zone":"b"}}}`)},
		{"annotate a node through its status", patch("status", `{"metadata":{"annotations":{"proxyaudit.io/cordoned-at":"2026-11-23T10:00:00Z"}}}`)},
		// Incidents live in proxyaudit's ConfigMap, not on the Node.
		{"write an incident annotation on a node", patch("", `{"metadata":{"annotations":{"proxyaudit.io/incident-stage":"restarted"}}}`)},
		{"rewrite a node's addresses", patch("status", `{"status":{"addresses":[{"type":"InternalIP","address":"198.18.9.9"}]}}`)},
		{"rewrite a node's capacity", patch("status", `{"status":{"capacity":{"pods":"1"}}}`)},
		{"uncordon a node an admin cordoned", patchNode("pa-admission-admin", "", `{"spec":{"unschedulable":null}}`)},
		// CVE-2020-8554: a Service that intercepts traffic to addresses it names.
		{"give the barrier Service external IPs", barrierSvc(`{"spec":{"externalIPs":["198.18.0.9"]}}`)},
		{"make the barrier Service an ExternalName", barrierSvc(`{"spec":{"type":"ExternalName","externalName":"evil.example","clusterIP":null}}`)},
		{"relabel the barrier Service", barrierSvc(`{"metadata":{"labels":{"service.kubernetes.io/service-proxy-name":null}}}`)},
		{"add an endpoint to the barrier slice", barrierSlice(`{"endpoints":[{"addresses":["198.18.0.9"]}]}`)},
	}
	// The policy takes effect once the API server has loaded it.
	deadline := time.Now().Add(30 * time.Second)
	for denied[0].do(ctx) == nil && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	allowed := []check{
		{"delete a kube-proxy pod", del("kube-proxy-pa")},
		{"delete a Cilium agent pod", delIn("pa-cilium", "cilium-pa")},
		{"cordon with its marker", patch("", `{"metadata":{"annotations":{"proxyaudit.io/cordoned-at":"2026-11-23T10:00:00Z"}},"spec":{"unschedulable":true}}`)},
		{"remove an older version's incident annotations", patch("", `{"metadata":{"annotations":{"proxyaudit.io/incident-stage":null,"proxyaudit.io/kube-proxy-restarts":null}}}`)},
		{"set KubeProxyRulesStale", patch("status", `{"status":{"conditions":[{"type":"KubeProxyRulesStale","status":"True","reason":"Drifted"}]}}`)},
		{"uncordon a node it cordoned", patchNode("pa-admission-ours", "", `{"metadata":{"annotations":{"proxyaudit.io/cordoned-at":null}},"spec":{"unschedulable":null}}`)},
		{"stamp the barrier Service", barrierSvc(`{"metadata":{"labels":{"proxyaudit.io/barrier-at":"2","proxyaudit.io/barrier-by":"x","proxyaudit.io/barrier-sig":"y"}}}`)},
		{"stamp the barrier slice", barrierSlice(`{"metadata":{"labels":{"proxyaudit.io/barrier-at":"2"}}}`)},
	}
	for _, ch := range allowed {
		if err := ch.do(ctx); err != nil {
			t.Errorf("the aggregator cannot %s: %v", ch.what, err)
		}
	}
	for _, ch := range denied {
		err := ch.do(ctx)
		if err == nil || !strings.Contains(err.Error(), "proxyaudit may") {
			t.Errorf("the aggregator may %s (err %v)", ch.what, err)
		} else {
			t.Logf("denied %s: %v", ch.what, err)
		}
	}
	// Someone else is not held by the policy.
	if err := c.Client.CoreV1().Pods("kube-system").Delete(ctx, "coredns-pa", metav1.DeleteOptions{DryRun: dryRun}); err != nil {
		t.Errorf("the policy holds the admin too: %v", err)
	}
}

// The chart's FlowSchema is accepted by the API server and classifies the
// aggregator's requests (its reviews above all: a fleet reconnect) into
// the priority level it names, proven by the header the API server's
// Priority and Fairness filter puts on every response.
func TestE2EChartAPIPriority(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const ns = "pa-apf"
	r, err := chart.Render(root(t), "proxyaudit", ns, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Apply(ctx, c.RESTConfig); err != nil {
		t.Fatal(err)
	}
	fs, err := c.Client.FlowcontrolV1().FlowSchemas().Get(ctx, "proxyaudit-aggregator", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	classified := func(user string, do func(kubernetes.Interface) error) (string, string) {
		cfg := rest.CopyConfig(c.RESTConfig)
		cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}
		var schema, level string
		cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
			return roundTripFunc(func(req *http.Request) (*http.Response, error) {
				resp, err := rt.RoundTrip(req)
				if err == nil {
					schema, level = resp.Header.Get(flowcontrolv1.ResponseHeaderMatchedFlowSchemaUID), resp.Header.Get(flowcontrolv1.ResponseHeaderMatchedPriorityLevelConfigurationUID)
				}
				return resp, err
			})
		}
		cl, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		do(cl)
		return schema, level
	}
	review := func(cl kubernetes.Interface) error {
		_, err := cl.AuthenticationV1().TokenReviews().Create(ctx, &authnv1.TokenReview{Spec: authnv1.TokenReviewSpec{Token: "x"}}, metav1.CreateOptions{})
		return err
	}
	watchSlices := func(cl kubernetes.Interface) error {
		_, err := cl.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{Limit: 1})
		return err
	}
	pl, err := c.Client.FlowcontrolV1().PriorityLevelConfigurations().Get(ctx, "workload-high", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The API server takes a new FlowSchema up within seconds.
	deadline := time.Now().Add(time.Minute)
	for _, do := range []func(kubernetes.Interface) error{review, watchSlices} {
		for {
			schema, level := classified("system:serviceaccount:"+ns+":proxyaudit-aggregator", do)
			if schema == string(fs.UID) && level == string(pl.UID) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the aggregator's requests are classified by FlowSchema %q into level %q, want %q (%s) into %q (workload-high)", schema, level, fs.UID, fs.Name, pl.UID)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	// Nobody else rides on it: the collector's ServiceAccount does not.
	if schema, _ := classified("system:serviceaccount:"+ns+":proxyaudit-collector", review); schema == string(fs.UID) {
		t.Errorf("the collector's requests are classified by the aggregator's FlowSchema")
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
