package chart_test

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

var update = flag.Bool("update", false, "rewrite deploy/manifests/proxyaudit.yaml and the chart README's values table")

func root(t *testing.T) string {
	t.Helper()
	r, err := localcluster.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// valuesFiles are the default values (nil) and every file under ci/.
func valuesFiles(t *testing.T) map[string][]string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root(t), chart.Dir, "ci", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no values files under %s/ci: %v", chart.Dir, err)
	}
	out := map[string][]string{"default": nil}
	for _, f := range files {
		out[strings.TrimSuffix(filepath.Base(f), "-values.yaml")] = []string{f}
	}
	return out
}

func skipShort(t *testing.T) {
	if testing.Short() {
		t.Skip("builds helm (~2 min cold)")
	}
}

func TestLintStrict(t *testing.T) {
	skipShort(t)
	helm, err := chart.Helm(root(t))
	if err != nil {
		t.Fatal(err)
	}
	for name, files := range valuesFiles(t) {
		args := []string{"lint", "--strict", filepath.Join(root(t), chart.Dir)}
		for _, f := range files {
			args = append(args, "--values", f)
		}
		out, err := exec.Command(helm, args...).CombinedOutput()
		if err != nil {
			t.Errorf("%s: helm lint --strict: %v\n%s", name, err, out)
		}
	}
}

// Every value carries a `# --` comment (on itself or on each of its leaves),
// the convention helm-docs and readers of values.yaml rely on.
func TestEveryValueDocumented(t *testing.T) {
	if _, undocumented := values(t); len(undocumented) > 0 {
		t.Errorf("values without a `# --` comment: %v", undocumented)
	}
}

type valueDoc struct{ path, typ, def, desc string }

// values walks values.yaml in order: every documented value (a `# --`
// comment on its key), and the path of every leaf that has none.
func values(t *testing.T) (docs []valueDoc, undocumented []string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root(t), chart.Dir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	var walk func(n *yaml.Node, path string)
	walk = func(n *yaml.Node, path string) {
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			p := strings.TrimPrefix(path+"."+k.Value, ".")
			_, desc, ok := strings.Cut(k.HeadComment, "# -- ")
			switch {
			case ok:
				var def any
				if err := v.Decode(&def); err != nil {
					t.Fatal(err)
				}
				js, _ := json.Marshal(def)
				typ := map[string]string{"!!str": "string", "!!int": "int", "!!float": "float", "!!bool": "bool", "!!map": "object", "!!seq": "list"}[v.Tag]
				docs = append(docs, valueDoc{p, typ, string(js), strings.Join(strings.Fields(strings.ReplaceAll(desc, "\n#", " ")), " ")})
			case v.Kind == yaml.MappingNode && len(v.Content) > 0:
				walk(v, p)
			default:
				undocumented = append(undocumented, p)
			}
		}
	}
	walk(doc.Content[0], "")
	return docs, undocumented
}

func render(t *testing.T, files []string, sets ...string) *chart.Release {
	t.Helper()
	r, err := chart.Render(root(t), "proxyaudit", "proxyaudit", files, sets...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func rules(t *testing.T, r *chart.Release, kind, name string) []rbacv1.PolicyRule {
	t.Helper()
	o := r.Find(kind, name)
	if o == nil {
		t.Fatalf("no %s %s in %v", kind, name, r.Kinds())
	}
	var role rbacv1.ClusterRole // a Role has the same rules field
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role); err != nil {
		t.Fatal(err)
	}
	return role.Rules
}

func allows(rs []rbacv1.PolicyRule, verb, resource string) bool {
	for _, r := range rs {
		if slices.Contains(r.Verbs, verb) && slices.Contains(r.Resources, resource) {
			return true
		}
	}
	return false
}

// The shapes the issue asks for, on the default values.
func TestDefaultShape(t *testing.T) {
	skipShort(t)
	r := render(t, nil)
	col, err := r.PodSpec("DaemonSet", "proxyaudit-collector")
	if err != nil {
		t.Fatal(err)
	}
	c := col.Containers[0]
	if !col.HostNetwork || col.AutomountServiceAccountToken == nil || *col.AutomountServiceAccountToken {
		t.Errorf("collector: hostNetwork %v, automount %v", col.HostNetwork, col.AutomountServiceAccountToken)
	}
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.Privileged == nil || *sc.Privileged ||
		!slices.Equal(sc.Capabilities.Add, []corev1.Capability{"NET_ADMIN", "NET_RAW"}) || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("collector security context: %+v", sc)
	}
	if len(col.Tolerations) != 1 || col.Tolerations[0].Operator != corev1.TolerationOpExists || col.Tolerations[0].Key != "" {
		t.Errorf("collector must tolerate every taint: %+v", col.Tolerations)
	}
	if col.PriorityClassName != "system-node-critical" || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("collector priority %q resources %+v", col.PriorityClassName, c.Resources)
	}
	var audience string
	for _, v := range col.Volumes {
		if v.Projected != nil {
			audience = v.Projected.Sources[0].ServiceAccountToken.Audience
		}
	}
	if audience != "proxyaudit" {
		t.Errorf("projected token audience %q", audience)
	}

	agg, err := r.PodSpec("Deployment", "proxyaudit-aggregator")
	if err != nil {
		t.Fatal(err)
	}
	a := agg.Containers[0]
	if a.LivenessProbe.HTTPGet.Path != "/healthz" || a.ReadinessProbe.HTTPGet.Path != "/readyz" || agg.Affinity.PodAntiAffinity == nil {
		t.Errorf("aggregator probes/affinity: %+v %+v %+v", a.LivenessProbe, a.ReadinessProbe, agg.Affinity)
	}
	if tsc := agg.TopologySpreadConstraints; len(tsc) != 1 || tsc[0].TopologyKey != "topology.kubernetes.io/zone" || tsc[0].WhenUnsatisfiable != "ScheduleAnyway" ||
		tsc[0].LabelSelector == nil || tsc[0].LabelSelector.MatchLabels["app.kubernetes.io/component"] != "aggregator" {
		t.Errorf("aggregator replicas not spread over zones: %+v", tsc)
	}
	for _, want := range []string{"--tls-secret=proxyaudit-aggregator-tls", "--tls-validity=87600h", "--remediation=dry-run", "--leader-elect=true",
		"--collector-service-accounts=proxyaudit/proxyaudit-collector", "--token-audience=proxyaudit"} {
		if !slices.Contains(a.Args, want) {
			t.Errorf("aggregator args lack %s: %v", want, a.Args)
		}
	}
	for _, k := range []string{"PodDisruptionBudget/proxyaudit-aggregator", "Service/proxyaudit-aggregator", "Service/proxyaudit-aggregator-headless",
		"Role/proxyaudit-report-reader"} {
		if !slices.Contains(r.Kinds(), k) {
			t.Errorf("no %s in %v", k, r.Kinds())
		}
	}
	// No key in the manifest (or a Helm release): the aggregator makes the
	// pair in the cluster.
	if r.Find("Secret", "proxyaudit-aggregator-tls") != nil || strings.Contains(string(r.Manifest), "PRIVATE KEY") {
		t.Error("the chart renders the TLS pair")
	}
	for _, k := range r.Kinds() {
		if strings.HasPrefix(k, "ServiceMonitor/") || strings.HasPrefix(k, "PrometheusRule/") || strings.HasPrefix(k, "NetworkPolicy/") ||
			strings.Contains(k, "restart-kube-proxy") {
			t.Errorf("rendered by default: %s", k)
		}
	}
	// Dry-run: read, review tokens, nothing that changes a node or a pod.
	cr := rules(t, r, "ClusterRole", "proxyaudit-aggregator")
	if !allows(cr, "list", "endpointslices") || !allows(cr, "create", "tokenreviews") || allows(cr, "patch", "nodes") || allows(cr, "patch", "nodes/status") {
		t.Errorf("dry-run ClusterRole: %+v", cr)
	}
	// Remediation on: exactly the verbs it needs.
	r = render(t, nil, "remediation.mode=restart")
	cr = rules(t, r, "ClusterRole", "proxyaudit-aggregator")
	if !allows(cr, "patch", "nodes") || !allows(cr, "patch", "nodes/status") || allows(cr, "delete", "nodes") || allows(cr, "update", "nodes") {
		t.Errorf("restart ClusterRole: %+v", cr)
	}
	if r.Find("ValidatingAdmissionPolicy", "proxyaudit-aggregator-limits") == nil || r.Find("ValidatingAdmissionPolicyBinding", "proxyaudit-aggregator-limits") == nil {
		t.Errorf("remediation without its admission policy: %v", r.Kinds())
	}
	if rs := rules(t, r, "Role", "proxyaudit-aggregator-restart-kube-proxy"); !allows(rs, "delete", "pods") || r.Find("Role", "proxyaudit-aggregator-restart-kube-proxy").GetNamespace() != "kube-system" {
		t.Errorf("restart Role: %+v", rs)
	}
}

// Wrong values fail the render and say which value and why.
// Rendered twice, the chart is the same: Argo CD and Flux render with
// `helm template` on every sync, and a chart that generated its CA there
// rolled a new one (and every pod with it) each time.
func TestRenderIsStable(t *testing.T) {
	a, b := render(t, nil), render(t, nil)
	if !bytes.Equal(a.Manifest, b.Manifest) {
		t.Error("two renders of the default chart differ")
	}
}

func TestBadValuesAreRefused(t *testing.T) {
	skipShort(t)
	for set, says := range map[string]string{
		"remediation.mode=restarts":                      "/remediation/mode",
		"grace=30":                                       "/grace",
		"aggregator.replica=3":                           "'replica' not allowed",
		"collector.interval=often":                       "/collector/interval",
		"slack.channel=C0123":                            "no bot token",
		"slack.botToken=xoxb-1":                          "needs slack.channel",
		"remediation.maxShare=0.1":                       "'maxShare' not allowed", // it is maxUnhealthy: 10%
		"remediation.maxUnhealthy=0.1":                   "/remediation/maxUnhealthy",
		"remediation.maxUnhealthy=101%":                  "/remediation/maxUnhealthy",
		"remediation.maxUnhealthy=-1%":                   "/remediation/maxUnhealthy",
		"remediation.maxUnhealthy=5%":                    "",
		"remediation.maxUnhealthy=-1":                    "",
		"remediation.maxUnhealthy=3":                     "",
		"alertmanager.urls[0]=alertmanager:9093":         "/alertmanager/urls/0",
		"alertmanager.urls[0]=http://am.monitoring:9093": "",
		"aggregator.streamPort=0":                        "/aggregator/streamPort",
		"collector.mode=ebpf":                            "/collector/mode",
		"collector.mode=ipvs":                            "",
		"collector.mode=cilium":                          "",
		"cilium.bpfRoot=sys/fs/bpf":                      "/cilium/bpfRoot",
		"cilium.selector=":                               "/cilium/selector",
		"kubeProxy.selector=":                            "/kubeProxy/selector",
		"remediation.mode=restart,cilium.enabled=true,cilium.selector=k8s-app!=cilium": "cilium.selector",
		"networkPolicy.enable=true":                                           "'enable' not allowed",
		"tls.existingSecret=":                                                 "", // empty is fine
		"remediation.restartBudget=":                                          "/remediation/restartBudget",
		"kubeProxy.selector=k8s-app in (kube-proxy)":                          "", // fine in dry-run: no admission policy
		"remediation.mode=restart,kubeProxy.selector=k8s-app in (kube-proxy)": "only key=value terms",
		"remediation.conntrack.tcpServices[0]=api":                            "/remediation/conntrack/tcpServices/0",
		"remediation.conntrack.enable=true":                                   "'enable' not allowed",
		"remediation.conntrack.enabled=true,collector.conntrackInterval=0":    "needs collector.conntrackInterval above 0",
		"aggregator.replicas=5,aggregator.shards=4":                           "aggregator.shards (4) is less than aggregator.replicas (5)",
		"aggregator.shards=-1":                                                "/aggregator/shards",
	} {
		_, err := chart.Render(root(t), "proxyaudit", "proxyaudit", nil, set)
		switch {
		case says == "" && err != nil:
			t.Errorf("--set %s: %v", set, err)
		case says != "" && (err == nil || !strings.Contains(err.Error(), says)):
			t.Errorf("--set %s: error %v, want it to mention %q", set, err, says)
		}
	}
}

// The chart installs on the Kubernetes minors it supports and refuses the
// ones before, by kubeVersion, instead of rendering APIs they do not serve
// (ValidatingAdmissionPolicy v1 is served from 1.30).
func TestKubeVersions(t *testing.T) {
	skipShort(t)
	helm, err := chart.Helm(root(t))
	if err != nil {
		t.Fatal(err)
	}
	for v, refused := range map[string]bool{"1.29.0": true, "1.32.9": true, "1.33.0": false, "1.37.2": false} {
		out, err := exec.Command(helm, "template", "proxyaudit", filepath.Join(root(t), chart.Dir), "--kube-version", v).CombinedOutput()
		switch {
		case refused && (err == nil || !strings.Contains(string(out), "incompatible with Kubernetes v"+v)):
			t.Errorf("Kubernetes %s: %v, want the chart's kubeVersion to refuse it:\n%.300s", v, err, out)
		case !refused && err != nil:
			t.Errorf("Kubernetes %s: %v\n%s", v, err, out)
		case !refused && !strings.Contains(string(out), "kind: ValidatingAdmissionPolicy\n"):
			t.Errorf("Kubernetes %s: no ValidatingAdmissionPolicy rendered", v)
		}
	}
}

// deploy/manifests/proxyaudit.yaml is the chart rendered with
// deploy/manifests/values.yaml; `make manifests` (or -update) rewrites it.
func TestManifestsInSync(t *testing.T) {
	skipShort(t)
	dir := filepath.Join(root(t), "deploy", "manifests")
	r := render(t, []string{filepath.Join(dir, "values.yaml")})
	want := append([]byte("# Generated by `make manifests` from charts/proxyaudit with deploy/manifests/values.yaml. Do not edit.\n"), r.Manifest...)
	path := filepath.Join(dir, "proxyaudit.yaml")
	if *update {
		if err := os.WriteFile(path, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s is out of date with the chart: run `make manifests`", path)
	}
}

// valuesTable is the Markdown table of every documented value: key, type,
// default, description, in values.yaml's order.
func valuesTable(t *testing.T) string {
	t.Helper()
	docs, _ := values(t)
	var rows strings.Builder
	rows.WriteString("| Key | Type | Default | Description |\n|---|---|---|---|\n")
	esc := strings.NewReplacer("|", `\|`)
	for _, d := range docs {
		fmt.Fprintf(&rows, "| `%s` | %s | `%s` | %s |\n", d.path, d.typ, esc.Replace(d.def), esc.Replace(d.desc))
	}
	return rows.String()
}

// The chart README's values table is generated from values.yaml's `# --`
// comments; -update rewrites it.
func TestChartReadmeValuesInSync(t *testing.T) {
	path := filepath.Join(root(t), chart.Dir, "README.md")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	const begin, end = "<!-- values:begin -->\n", "<!-- values:end -->"
	i, j := bytes.Index(b, []byte(begin)), bytes.Index(b, []byte(end))
	if i < 0 || j < i {
		t.Fatalf("%s has no %q … %q section", path, begin, end)
	}
	want := string(b[:i+len(begin)]) + valuesTable(t) + string(b[j:])
	if *update {
		if err := os.WriteFile(path, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	if string(b) != want {
		t.Errorf("%s's values table is out of date with values.yaml: run `make manifests`", path)
	}
}

// Alertmanager's URLs, and its credentials from a Secret made elsewhere:
// the files the flags name are the Secret's keys, mounted read-only.
func TestAlertmanagerValues(t *testing.T) {
	skipShort(t)
	args := func(r *chart.Release) (*corev1.PodSpec, []string) {
		spec, err := r.PodSpec("Deployment", "proxyaudit-aggregator")
		if err != nil {
			t.Fatal(err)
		}
		return spec, spec.Containers[0].Args
	}
	_, a := args(render(t, nil))
	for _, f := range a {
		if strings.HasPrefix(f, "--alertmanager") {
			t.Errorf("default install talks to Alertmanager: %s", f)
		}
	}
	spec, a := args(render(t, nil, "alertmanager.urls={https://am-0:9093,https://am-1:9093}", "alertmanager.existingSecret=am-creds",
		"alertmanager.tokenKey=bearer", "alertmanager.caKey=ca.pem"))
	for _, want := range []string{"--alertmanager-url=https://am-0:9093,https://am-1:9093", "--alertmanager-token-file=/etc/proxyaudit/alertmanager/token",
		"--alertmanager-ca-file=/etc/proxyaudit/alertmanager/ca.crt"} {
		if !slices.Contains(a, want) {
			t.Errorf("args lack %s: %v", want, a)
		}
	}
	var vol *corev1.Volume
	for i := range spec.Volumes {
		if spec.Volumes[i].Name == "alertmanager" {
			vol = &spec.Volumes[i]
		}
	}
	if vol == nil || vol.Secret == nil || vol.Secret.SecretName != "am-creds" || len(vol.Secret.Items) != 2 ||
		vol.Secret.Items[0] != (corev1.KeyToPath{Key: "bearer", Path: "token"}) || vol.Secret.Items[1] != (corev1.KeyToPath{Key: "ca.pem", Path: "ca.crt"}) {
		t.Errorf("alertmanager volume: %+v", vol)
	}
	mounted := false
	for _, m := range spec.Containers[0].VolumeMounts {
		mounted = mounted || (m.Name == "alertmanager" && m.MountPath == "/etc/proxyaudit/alertmanager" && m.ReadOnly)
	}
	if !mounted {
		t.Errorf("alertmanager Secret not mounted: %+v", spec.Containers[0].VolumeMounts)
	}
}

// Conntrack remediation is off unless asked for; asked for, the
// aggregator plans flushes and the collectors may delete.
func TestConntrackRemediationValues(t *testing.T) {
	skipShort(t)
	args := func(r *chart.Release) (agg, col []string) {
		a, c := podSpecs(t, r)
		return a.Containers[0].Args, c.Containers[0].Args
	}
	agg, col := args(render(t, nil))
	for _, f := range append(agg, col...) {
		if strings.Contains(f, "conntrack-delete") || strings.HasPrefix(f, "--remediation-conntrack") {
			t.Errorf("default install deletes conntrack entries: %s", f)
		}
	}
	agg, col = args(render(t, nil, "remediation.conntrack.enabled=true", "remediation.conntrack.tcpServices={shop/api,kube-system/kube-dns}"))
	if !slices.Contains(col, "--conntrack-delete") || !slices.Contains(agg, "--remediation-conntrack") ||
		!slices.Contains(agg, "--remediation-conntrack-tcp-services=shop/api,kube-system/kube-dns") {
		t.Errorf("enabled: aggregator %v, collector %v", agg, col)
	}
}

// The Grafana dashboard is a ConfigMap the sidecar finds, and only when
// asked for.
func TestGrafanaDashboardOnlyWhenEnabled(t *testing.T) {
	skipShort(t)
	if cm := render(t, nil).Find("ConfigMap", "proxyaudit-aggregator-dashboard"); cm != nil {
		t.Fatal("the default install renders the dashboard")
	}
	r := render(t, nil, "metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=monitoring",
		"metrics.grafanaDashboard.annotations.grafana_folder=Networking")
	cm := r.Find("ConfigMap", "proxyaudit-aggregator-dashboard")
	if cm == nil {
		t.Fatalf("no dashboard in %v", r.Kinds())
	}
	data, _ := cm.Object["data"].(map[string]any)
	var dash map[string]any
	if err := json.Unmarshal([]byte(fmt.Sprint(data["proxyaudit.json"])), &dash); err != nil || dash["uid"] != "proxyaudit" {
		t.Errorf("dashboard JSON: %v", err)
	}
	if cm.GetLabels()["grafana_dashboard"] != "1" || cm.GetNamespace() != "monitoring" || cm.GetAnnotations()["grafana_folder"] != "Networking" {
		t.Errorf("labels %v, namespace %q, annotations %v", cm.GetLabels(), cm.GetNamespace(), cm.GetAnnotations())
	}
}

// Two replicas are a leader and a standby, as before; more share the
// nodes by shard (16 unless set), with the Lease verbs the shards need,
// which two replicas are not given.
func TestShardsOnlyBeyondTwoReplicas(t *testing.T) {
	skipShort(t)
	argsOf := func(r *chart.Release) []string {
		a, err := r.PodSpec("Deployment", "proxyaudit-aggregator")
		if err != nil {
			t.Fatal(err)
		}
		return a.Containers[0].Args
	}
	listsLeases := func(r *chart.Release) bool {
		for _, rule := range rules(t, r, "Role", "proxyaudit-aggregator") {
			if slices.Contains(rule.Resources, "leases") && slices.Contains(rule.Verbs, "list") && len(rule.ResourceNames) == 0 {
				return true
			}
		}
		return false
	}
	two := render(t, nil)
	if slices.ContainsFunc(argsOf(two), func(a string) bool { return strings.HasPrefix(a, "--shards") }) || listsLeases(two) {
		t.Errorf("two replicas are sharded, or may list every Lease: %v", argsOf(two))
	}
	for sets, want := range map[string]string{"aggregator.replicas=3": "--shards=16", "aggregator.replicas=20,aggregator.shards=64": "--shards=64"} {
		r := render(t, nil, strings.Split(sets, ",")...)
		if !slices.Contains(argsOf(r), want) || !listsLeases(r) {
			t.Errorf("%s: want %s and the shards' Lease verbs; args %v", sets, want, argsOf(r))
		}
		// The replicas' internal API: its own port, and a token for the
		// peers' audience projected into the pod (trust review 4, item 2).
		spec, err := r.PodSpec("Deployment", "proxyaudit-aggregator")
		if err != nil {
			t.Fatal(err)
		}
		var projected bool
		for _, v := range spec.Volumes {
			if v.Projected != nil && len(v.Projected.Sources) == 1 && v.Projected.Sources[0].ServiceAccountToken != nil &&
				v.Projected.Sources[0].ServiceAccountToken.Audience == "proxyaudit-peers" {
				projected = true
			}
		}
		if !projected || !slices.Contains(argsOf(r), "--internal-listen=:8444") || !slices.Contains(argsOf(r), "--peer-token-file=/var/run/secrets/proxyaudit/peers/token") {
			t.Errorf("%s: the internal API's port or the peers token is missing: args %v", sets, argsOf(r))
		}
	}
	if projected := render(t, nil); slices.ContainsFunc(argsOf(projected), func(a string) bool { return strings.HasPrefix(a, "--internal-listen") }) {
		t.Error("two replicas listen for an internal API")
	}
	if _, err := chart.Render(root(t), "proxyaudit", "proxyaudit", nil, "aggregator.replicas=3", "tls.enabled=false"); err == nil || !strings.Contains(err.Error(), "tls.enabled") {
		t.Errorf("sharded replicas without TLS were rendered: %v", err)
	}
	withFiles := render(t, nil, "aggregator.replicas=3", "tls.existingSecret=mine")
	if !slices.Contains(argsOf(withFiles), "--tls-ca-file=/etc/proxyaudit/tls/ca.crt") {
		t.Errorf("with a TLS Secret of the user's, the replicas are not told its CA: %v", argsOf(withFiles))
	}
}

// Reading Cilium's maps takes the node's BPF filesystem (read-only) and
// CAP_BPF: only with cilium.enabled, never by default.
func TestCiliumValues(t *testing.T) {
	skipShort(t)
	bpf := func(col *corev1.PodSpec) (mounted, readOnly, capBPF bool) {
		for _, m := range col.Containers[0].VolumeMounts {
			if m.MountPath == "/sys/fs/bpf" {
				mounted, readOnly = true, m.ReadOnly
			}
		}
		return mounted, readOnly, slices.Contains(col.Containers[0].SecurityContext.Capabilities.Add, "BPF")
	}
	agg, col := podSpecs(t, render(t, nil))
	if m, _, c := bpf(col); m || c || slices.Contains(col.Containers[0].Args, "--bpf-root=/sys/fs/bpf") {
		t.Errorf("default install: BPF filesystem mounted %v, CAP_BPF %v", m, c)
	}
	if !slices.Contains(agg.Containers[0].Args, "--cilium-selector=k8s-app=cilium") {
		t.Errorf("aggregator args %v", agg.Containers[0].Args)
	}
	_, col = podSpecs(t, render(t, nil, "cilium.enabled=true", "cilium.bpfRoot=/run/cilium/bpffs"))
	if m, ro, c := bpf(col); !m || !ro || !c || !slices.Contains(col.Containers[0].Args, "--bpf-root=/sys/fs/bpf") {
		t.Errorf("cilium.enabled: BPF filesystem mounted %v read-only %v, CAP_BPF %v, args %v", m, ro, c, col.Containers[0].Args)
	}
	for _, v := range col.Volumes {
		if v.Name == "bpffs" && (v.HostPath == nil || v.HostPath.Path != "/run/cilium/bpffs") {
			t.Errorf("bpffs volume %+v", v)
		}
	}
}

// podSpecs are the aggregator's and the collector's pod specs as r renders
// them.
func podSpecs(t *testing.T, r *chart.Release) (agg, col *corev1.PodSpec) {
	t.Helper()
	a, err := r.PodSpec("Deployment", "proxyaudit-aggregator")
	if err != nil {
		t.Fatal(err)
	}
	c, err := r.PodSpec("DaemonSet", "proxyaudit-collector")
	if err != nil {
		t.Fatal(err)
	}
	return a, c
}
