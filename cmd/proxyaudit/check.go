package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	kptr "k8s.io/utils/ptr"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/buildinfo"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

const checkUsage = `Audits one node now, installing nothing: a short-lived pod on that node
(host network, the release's image, the capabilities the collector needs)
runs the collector once there, with the node's own backend detection; its
read is compared with the cluster's Services and EndpointSlices as diff
compares a dump, and the pod is deleted (on Ctrl-C too).

The pod runs in the namespace -n (else the context's, else proxyaudit), which
must allow privileged pods (PodSecurity "privileged": the chart's namespace
does); you need to create and delete pods and read their logs there, and to
list Services, EndpointSlices and Nodes.

check judges at once, without the aggregator's grace: the cluster is read
before and after the node, and only what is wrong against both is reported
(a change made while the node was read is not a finding); a service changed
a second before may still show until kube-proxy applies it: run it again.

Exit status: 0 the node's rules match, 1 findings, 2 usage error or the check
could not run (the error says why), 3 nothing found but a family not audited.`

// chartAppVersion is the image tag a development build checks with (a
// release checks with its own version): the chart's appVersion
// (TestCheckImageIsTheChartsAppVersion).
const chartAppVersion = "0.1.0"

// defaultCheckImage is the release's image for this CLI's version.
func defaultCheckImage() string {
	v := strings.TrimPrefix(buildinfo.Get().Version, "v")
	if v == "" || v == buildinfo.Devel {
		v = chartAppVersion
	}
	return "ghcr.io/proxyaudit/proxyaudit:" + v
}

var checkFormats = []string{"table", "markdown"}

// checkModes are the collector's --mode values.
var checkModes = []string{"auto", "iptables", "iptables-legacy", "nftables", "ipvs", "cilium"}

type checkOpts struct {
	k                 *kube
	image, pullSecret string
	mode, bpfRoot     string
	timeout           time.Duration
	format            *string
}

func (c *cli) checkCmd() *cobra.Command {
	o := &checkOpts{}
	cmd := &cobra.Command{
		Use:   "check node/NAME",
		Short: "Audit one node now, installing nothing (a short-lived pod on it)",
		Long:  checkUsage,
		Example: `  kubectl proxyaudit check node/worker-1
  kubectl proxyaudit check node worker-1 -n kube-system -o json`,
		Args: func(_ *cobra.Command, args []string) error {
			if _, err := explainNode(args); err != nil {
				return usageError{errors.New(strings.NewReplacer("explain", "check").Replace(err.Error()))}
			}
			return nil
		},
		ValidArgsFunction: func(_ *cobra.Command, args []string, prefix string) ([]string, cobra.ShellCompDirective) {
			if len(args) == 0 && strings.HasPrefix(prefix, "node/") {
				var out []string
				for _, n := range o.k.names(strings.TrimPrefix(prefix, "node/"), nodeList) {
					out = append(out, "node/"+n)
				}
				return out, cobra.ShellCompDirectiveNoFileComp
			}
			if len(args) == 0 {
				return prefixed([]string{"node/"}, prefix), cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
			}
			return nil, cobra.ShellCompDirectiveNoFileComp
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkOutput(*o.format, checkFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns); err != nil {
				return usageError{err}
			}
			node, _ := explainNode(args)
			c.code = c.check(cmd, o, node)
			return nil
		},
	}
	o.k = addKubeFlags(cmd.Flags(), false)
	cmd.Flags().StringVar(&o.image, "image", defaultCheckImage(), "the image the check pod runs (the release's; it holds proxyaudit-collector)")
	cmd.Flags().StringVar(&o.pullSecret, "image-pull-secret", "", "a Secret in the namespace to pull --image with")
	cmd.Flags().StringVar(&o.mode, "mode", "auto", "rules to read: auto (as the node's kube-proxy programs them, or Cilium's maps), iptables, iptables-legacy, nftables, ipvs or cilium")
	cmd.Flags().StringVar(&o.bpfRoot, "bpf-root", defaultBPFRoot, "where Cilium pins its maps on the node (cilium-agent --bpf-root; the chart's cilium.bpfRoot): the check pod reads them there")
	cmd.Flags().DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long the pod may take, image pull included")
	o.format = addOutput(cmd.Flags(), checkFormats, formatJSON, formatYAML, formatName, formatJSONPath, formatCustomColumns)
	o.k.complete(cmd)
	return cmd
}

// CheckReport is check's JSON output: diff's report of the one node, and
// how it was read.
type CheckReport struct {
	Report
	Read CheckRead `json:"read"`
}

// CheckRead is how check read the node.
type CheckRead struct {
	Node  string `json:"node"`
	Pod   string `json:"pod"`
	Image string `json:"image"`
	// Mode, Frontends, Endpoints and ReadSeconds are the collector's
	// account of its read.
	Mode        string  `json:"mode"`
	Frontends   int     `json:"frontends"`
	Endpoints   int     `json:"endpoints"`
	ReadSeconds float64 `json:"readSeconds"`
	// PodSeconds is from creating the pod to its end.
	PodSeconds float64 `json:"podSeconds"`
	// Raced counts findings left out: wrong against the cluster as read
	// before the node or after it, not both (it changed meanwhile).
	Raced int `json:"raced,omitempty"`
}

func (c *cli) check(cmd *cobra.Command, o *checkOpts, node string) int {
	fail := func(format string, a ...any) int { return c.fail(cmd, format, a...) }
	if err := o.k.single("check"); err != nil {
		return fail("%v", err)
	}
	if !slices.Contains(checkModes, o.mode) {
		return fail("--mode %q: choose %s", o.mode, strings.Join(checkModes, ", "))
	}
	client, _, ns, err := o.k.client(o.k.context())
	if err != nil {
		return fail("%v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, o.timeout+30*time.Second)
	defer cancel()

	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return fail("node %s: %v", node, apiError(err, "get nodes"))
	}
	if why := notReady(n); why != "" {
		return fail("node %s is not Ready (%s): its kubelet cannot run the check pod", node, why)
	}
	before, err := clusterState(ctx, client)
	if err != nil {
		return fail("%v", err)
	}
	start := time.Now()
	line, pod, err := runCheckPod(ctx, client, ns, node, o, c.stderr)
	if err != nil {
		return fail("%v", err)
	}
	took := time.Since(start)
	after, err := clusterState(ctx, client)
	if err != nil {
		return fail("%v", err)
	}
	obs, err := readRules(bytes.NewReader(line.Snapshot))
	if err != nil {
		return fail("the collector's read on %s: %v", node, err)
	}

	// What is wrong against the cluster both before and after the read.
	judge := func(st *audit.State) ([]audit.Finding, []audit.Finding, []int) {
		exp := audit.ExpectedFor(st, node)
		return audit.Diff(exp, obs), audit.Draining(exp, obs), audit.Unaudited(exp, obs)
	}
	was, _, _ := judge(before)
	findings, draining, unaudited := judge(after)
	wrongBefore := map[string]bool{}
	for _, f := range was {
		wrongBefore[findingKey(f)] = true
	}
	kept := findings[:0]
	raced := 0
	for _, f := range findings {
		if wrongBefore[findingKey(f)] {
			kept = append(kept, f)
		} else {
			raced++
		}
	}
	findings = kept
	audit.SortFindings(findings)
	audit.SortFindings(draining)
	if findings == nil {
		findings = []audit.Finding{}
	}
	rep := CheckReport{
		Report: Report{Findings: findings, Summary: audit.Summarize([]string{node}, findings), Draining: draining,
			Coverage: []Coverage{{Node: node, Dumps: []DumpCoverage{{File: "pod " + ns + "/" + pod, Families: obs.Families}}, NotAudited: unaudited}},
			dual:     dualStack(after)},
		Read: CheckRead{Node: node, Pod: ns + "/" + pod, Image: o.image, Mode: line.Footprint.Mode, Frontends: line.Footprint.Frontends,
			Endpoints: line.Footprint.Endpoints, ReadSeconds: line.Footprint.ReadSeconds, PodSeconds: took.Seconds(), Raced: raced},
	}
	nodes := []string{node}
	if err := render(c.stdout, *o.format, rep, func() []any { return rowsOf(rep.Findings) }, func() []string { return nodeNames(rep.Findings, func(f audit.Finding) string { return f.Node }) },
		func(w io.Writer) { fmt.Fprintln(w, rep.Read.line()); writeTable(w, rep.Report, nodes) },
		func(w io.Writer) { fmt.Fprintf(w, "%s\n\n", rep.Read.line()); writeMarkdown(w, rep.Report, nodes) }); err != nil {
		return fail("%v", err)
	}
	switch {
	case len(findings) > 0:
		return exitFindings
	case rep.unaudited() != "":
		return exitUnaudited
	}
	return exitClean
}

// line says how the node was read, for the table.
func (r CheckRead) line() string {
	s := fmt.Sprintf("node %s: read by proxyaudit-collector in pod %s (%s): %s, %d frontends, %d endpoints, read in %.2fs; the pod took %.1fs",
		r.Node, r.Pod, r.Image, r.Mode, r.Frontends, r.Endpoints, r.ReadSeconds, r.PodSeconds)
	if r.Raced > 0 {
		s += fmt.Sprintf("\n%d finding(s) left out: wrong only against the cluster as it was before or after the read (it changed meanwhile): run it again", r.Raced)
	}
	return s
}

func findingKey(f audit.Finding) string {
	return strings.Join([]string{string(f.Kind), f.Service, f.Port, f.Protocol, fmt.Sprint(f.Family), f.Endpoint}, "|")
}

// notReady says why a node is not Ready, or "".
func notReady(n *corev1.Node) string {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			if c.Status == corev1.ConditionTrue {
				return ""
			}
			return strings.TrimSpace(c.Reason + " " + c.Message)
		}
	}
	return "no Ready condition"
}

// clusterState reads the Services, EndpointSlices and Nodes as the
// aggregator watches them.
func clusterState(ctx context.Context, c kubernetes.Interface) (*audit.State, error) {
	svcs, err := c.CoreV1().Services("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list services: %v", apiError(err, "list services"))
	}
	slices, err := c.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list endpointslices: %v", apiError(err, "list endpointslices.discovery.k8s.io"))
	}
	nodes, err := c.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %v", apiError(err, "list nodes"))
	}
	return audit.FromAPI(svcs.Items, slices.Items, nodes.Items), nil
}

// apiError says what a refusal means for the user.
func apiError(err error, verb string) error {
	switch {
	case apierrors.IsForbidden(err):
		return fmt.Errorf("%v (you need to %s)", err, verb)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("the API server refused your credentials (401): log in to this cluster again")
	}
	return err
}

// onceLine is what proxyaudit-collector --once --snapshot - prints.
type onceLine struct {
	Footprint struct {
		Mode        string  `json:"mode"`
		Frontends   int     `json:"frontends"`
		Endpoints   int     `json:"endpoints"`
		ReadSeconds float64 `json:"readSeconds"`
	} `json:"footprint"`
	Snapshot json.RawMessage `json:"snapshot"`
}

// defaultBPFRoot is where Cilium pins its maps unless told otherwise.
const defaultBPFRoot = "/sys/fs/bpf"

// checkPod is the pod that reads node's rules once: the collector's
// privileges, nothing more (no ServiceAccount token, no API access).
func checkPod(ns, node string, o *checkOpts) *corev1.Pod {
	deadline := int64(o.timeout / time.Second)
	// The default BPF filesystem is made where it is missing (a node
	// without Cilium reads none); a root named by hand must exist.
	bpfType := corev1.HostPathDirectoryOrCreate
	if o.bpfRoot != defaultBPFRoot {
		bpfType = corev1.HostPathDirectory
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "proxyaudit-check-", Namespace: ns,
			Labels: map[string]string{"app.kubernetes.io/name": "proxyaudit", "app.kubernetes.io/component": "check"}},
		Spec: corev1.PodSpec{
			NodeName: node, HostNetwork: true, RestartPolicy: corev1.RestartPolicyNever,
			AutomountServiceAccountToken: kptr.To(false), EnableServiceLinks: kptr.To(false),
			ActiveDeadlineSeconds: &deadline, TerminationGracePeriodSeconds: kptr.To(int64(0)),
			Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
			Containers: []corev1.Container{{
				Name: "check", Image: o.image, ImagePullPolicy: corev1.PullIfNotPresent,
				Command: []string{"/usr/local/bin/proxyaudit-collector", "--once", "--snapshot", "-", "--mode", o.mode},
				SecurityContext: &corev1.SecurityContext{
					RunAsUser: kptr.To(int64(0)), Privileged: kptr.To(false), AllowPrivilegeEscalation: kptr.To(false), ReadOnlyRootFilesystem: kptr.To(true),
					Capabilities:   &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: []corev1.Capability{"NET_ADMIN", "NET_RAW", "BPF"}},
					SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
				},
				VolumeMounts: []corev1.VolumeMount{
					{Name: "xtables-lock", MountPath: "/run/xtables.lock"},
					// Cilium's pinned maps as they are when the pod starts (no
					// propagation: it reads once, and HostToContainer fails
					// where /sys/fs/bpf is not a shared mount).
					{Name: "bpffs", MountPath: "/sys/fs/bpf", ReadOnly: true},
				},
			}},
			Volumes: []corev1.Volume{
				{Name: "xtables-lock", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/run/xtables.lock", Type: kptr.To(corev1.HostPathFileOrCreate)}}},
				{Name: "bpffs", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: o.bpfRoot, Type: kptr.To(bpfType)}}},
			},
		},
	}
	if o.pullSecret != "" {
		p.Spec.ImagePullSecrets = []corev1.LocalObjectReference{{Name: o.pullSecret}}
	}
	return p
}

// runCheckPod runs the check pod on node and returns the collector's
// line and the pod's name; the pod is deleted whatever happens.
func runCheckPod(ctx context.Context, client kubernetes.Interface, ns, node string, o *checkOpts, stderr io.Writer) (*onceLine, string, error) {
	pods := client.CoreV1().Pods(ns)
	p, err := pods.Create(ctx, checkPod(ns, node, o), metav1.CreateOptions{})
	switch {
	case err == nil:
	case apierrors.IsForbidden(err) && strings.Contains(err.Error(), "PodSecurity"):
		return nil, "", fmt.Errorf("namespace %s refuses the check pod: %v\nIt needs host network, NET_ADMIN and host paths, as the collector does: run it in the chart's namespace (-n), or allow them in this one: kubectl label namespace %s pod-security.kubernetes.io/enforce=privileged --overwrite", ns, err, ns)
	case apierrors.IsForbidden(err):
		return nil, "", fmt.Errorf("you may not create the check pod in namespace %s: %v (check needs create, get and delete on pods and get on pods/log there; -n names another namespace)", ns, err)
	case apierrors.IsNotFound(err):
		return nil, "", fmt.Errorf("no namespace %s: -n names one where privileged pods may run (the chart's namespace)", ns)
	default:
		return nil, "", fmt.Errorf("create the check pod in %s: %v", ns, err)
	}
	defer func() {
		// Gone even when the wait was cancelled (Ctrl-C).
		del, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		pods.Delete(del, p.Name, metav1.DeleteOptions{GracePeriodSeconds: kptr.To(int64(0))})
	}()
	deadline := time.Now().Add(o.timeout)
	for {
		cur, err := pods.Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil {
			if ctx.Err() != nil {
				return nil, p.Name, fmt.Errorf("interrupted; the check pod %s/%s is deleted", ns, p.Name)
			}
			return nil, p.Name, fmt.Errorf("read the check pod %s/%s: %v", ns, p.Name, err)
		}
		for _, st := range cur.Status.ContainerStatuses {
			w := st.State.Waiting
			switch {
			case w == nil:
			case w.Reason == "ErrImagePull" || w.Reason == "ImagePullBackOff" || w.Reason == "InvalidImageName":
				return nil, p.Name, fmt.Errorf("node %s cannot pull %s: %s: %s (--image names another; a private registry needs --image-pull-secret)", node, o.image, w.Reason, w.Message)
			case w.Reason == "CreateContainerError" || w.Reason == "CreateContainerConfigError" || w.Reason == "RunContainerError":
				return nil, p.Name, fmt.Errorf("node %s cannot start the check pod: %s: %s", node, w.Reason, w.Message)
			}
		}
		switch cur.Status.Phase {
		case corev1.PodSucceeded:
			line, logs, err := checkLine(ctx, client, ns, p.Name)
			if err != nil {
				return nil, p.Name, fmt.Errorf("the check pod's output on %s: %v\n%s", node, err, logs)
			}
			if logs != "" {
				fmt.Fprintln(stderr, safeLines("check pod: ", logs))
			}
			return line, p.Name, nil
		case corev1.PodFailed:
			_, logs, _ := checkLine(ctx, client, ns, p.Name)
			why := strings.TrimSpace(cur.Status.Reason + " " + cur.Status.Message)
			for _, st := range cur.Status.ContainerStatuses {
				if t := st.State.Terminated; t != nil {
					why = strings.TrimSpace(fmt.Sprintf("%s exit %d %s", why, t.ExitCode, t.Message))
				}
			}
			return nil, p.Name, fmt.Errorf("the check pod failed on %s (%s):\n%s", node, why, safeLines("  ", strings.TrimSpace(logs)))
		}
		if time.Now().After(deadline) {
			return nil, p.Name, fmt.Errorf("the check pod on %s did not finish within --timeout %s (phase %s%s)", node, o.timeout, cur.Status.Phase, waiting(cur))
		}
		select {
		case <-ctx.Done():
			return nil, p.Name, fmt.Errorf("interrupted; the check pod %s/%s is deleted", ns, p.Name)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// safeLines prefixes each line of a pod's log, inert on a terminal.
func safeLines(prefix, logs string) string {
	var out []string
	for _, l := range strings.Split(logs, "\n") {
		out = append(out, prefix+safetext.Terminal(l))
	}
	return strings.Join(out, "\n")
}

func waiting(p *corev1.Pod) string {
	for _, st := range p.Status.ContainerStatuses {
		if w := st.State.Waiting; w != nil {
			return ", " + strings.TrimSpace(w.Reason+": "+w.Message)
		}
	}
	return ""
}

// checkLine reads the collector's line from the pod's log, and the log's
// other lines (its warnings, or why it failed).
func checkLine(ctx context.Context, client kubernetes.Interface, ns, pod string) (*onceLine, string, error) {
	b, err := client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: "check"}).DoRaw(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("read its log: %v", apiError(err, "get pods/log"))
	}
	var other []string
	var line *onceLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), maxInputBytes)
	for sc.Scan() {
		t := sc.Bytes()
		if bytes.HasPrefix(t, []byte(`{"footprint":`)) {
			var l onceLine
			if err := json.Unmarshal(t, &l); err != nil {
				return nil, "", fmt.Errorf("the collector's line: %v", err)
			}
			line = &l
			continue
		}
		other = append(other, string(t))
	}
	if err := sc.Err(); err != nil {
		return nil, "", err
	}
	if line == nil {
		return nil, strings.Join(other, "\n"), fmt.Errorf("no snapshot in the pod's log (is --image the release's image, with proxyaudit-collector --once --snapshot -?)")
	}
	return line, strings.Join(other, "\n"), nil
}
