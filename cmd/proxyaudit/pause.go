package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os/user"
	"strings"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/remediate"
)

const pauseUsage = `proxyaudit pause: hold every repair, fleet-wide; proxyaudit resume: let them go on.

Usage:
  proxyaudit pause --reason "..." [--for 2h] [--kubeconfig FILE --context NAME -n NAMESPACE]
  proxyaudit resume [--kubeconfig FILE --context NAME -n NAMESPACE]
  proxyaudit pause --status

While paused, proxyaudit restarts and cordons nothing; detection, findings
and pages go on, and every page, the report and the API say who paused, when
and why. A pause with --for ends by itself. It is kept in the ConfigMap
--pause-configmap (the chart's, in the aggregator's namespace); the chart's
Role of the same name (<release>-aggregator-pause) lets a group write it
(remediation.pausers).

Exit status: 0 done, 2 usage error or the API refused.
`

func runPause(args []string, resume bool, stdout, stderr io.Writer) int {
	name := "pause"
	if resume {
		name = "resume"
	}
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, pauseUsage); fs.PrintDefaults() }
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
	kctx := fs.String("context", "", "kubeconfig context (default: the current one)")
	namespace := fs.String("namespace", "proxyaudit", "the aggregator's namespace")
	fs.StringVar(namespace, "n", "proxyaudit", "short for --namespace")
	cm := fs.String("pause-configmap", "proxyaudit-aggregator-pause", "the pause ConfigMap (the chart's <release>-aggregator-pause)")
	reason := fs.String("reason", "", "why (shown in every page while paused); required to pause")
	forDur := fs.Duration("for", 0, "end the pause by itself after this long (0: until proxyaudit resume)")
	status := fs.Bool("status", false, "say whether remediation is paused, and change nothing")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "proxyaudit %s: "+format+"\n", append([]any{name}, a...)...)
		return exitUsage
	}
	if fs.NArg() > 0 {
		return fail("unexpected argument %q", fs.Arg(0))
	}
	if !resume && !*status && strings.TrimSpace(*reason) == "" {
		return fail("--reason is required: say why, for the people paged while it lasts")
	}
	if *forDur < 0 {
		return fail("--for %s: want a positive duration", *forDur)
	}
	client, user, err := kubeClient(*kubeconfig, *kctx)
	if err != nil {
		return fail("%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	current, err := client.CoreV1().ConfigMaps(*namespace).Get(ctx, *cm, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return fail("no ConfigMap %s/%s: is proxyaudit installed there (chart 0.1.0 or later)? Pass -n or --pause-configmap", *namespace, *cm)
		}
		if apierrors.IsForbidden(err) {
			return fail("%v: the chart's %s Role allows it; ask for it to be bound to you (remediation.pausers)", err, *cm)
		}
		return fail("read %s/%s: %v", *namespace, *cm, err)
	}
	now := time.Now()
	old, paused, derr := remediate.DecodePause(current.Data)
	if *status {
		switch {
		case derr != nil:
			fmt.Fprintf(stdout, "held: %v\n", derr)
		case paused && old.Active(now):
			fmt.Fprintf(stdout, "paused %s\n", old)
		case paused:
			fmt.Fprintf(stdout, "not paused (the pause %s has ended)\n", old)
		default:
			fmt.Fprintln(stdout, "not paused")
		}
		return exitClean
	}
	// Replace the data whole (a JSON merge patch with nulls clears keys
	// the new request lacks), only if nobody changed it since it was read.
	data := map[string]any{}
	for k := range current.Data {
		data[k] = nil
	}
	var req remediate.PauseRequest
	if !resume {
		req = remediate.PauseRequest{By: whoAmI(ctx, client, user), Reason: strings.TrimSpace(*reason), Since: now.UTC().Truncate(time.Second)}
		if *forDur > 0 {
			req.Until = req.Since.Add(*forDur)
		}
		for k, v := range req.Data() {
			data[k] = v
		}
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"resourceVersion": current.ResourceVersion}, "data": data})
	if _, err := client.CoreV1().ConfigMaps(*namespace).Patch(ctx, *cm, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		if apierrors.IsConflict(err) {
			return fail("%s/%s changed while this ran (someone else paused or resumed): run it again", *namespace, *cm)
		}
		if apierrors.IsForbidden(err) {
			return fail("%v: the chart's %s Role allows it; ask for it to be bound to you (remediation.pausers)", err, *cm)
		}
		return fail("write %s/%s: %v", *namespace, *cm, err)
	}
	if resume {
		if paused {
			fmt.Fprintf(stdout, "resumed: repairs go on (the pause was %s)\n", old)
		} else {
			fmt.Fprintln(stdout, "resumed: repairs go on (it was not paused)")
		}
		return exitClean
	}
	ends := ""
	if !req.Until.IsZero() {
		ends = " or the pause ends"
	}
	fmt.Fprintf(stdout, "paused %s\nproxyaudit restarts and cordons nothing until `proxyaudit resume`%s; detection and pages go on.\n", req, ends)
	return exitClean
}

// whoAmI is the caller as the API server knows them (SelfSubjectReview),
// else the kubeconfig's user name, else the local login.
func whoAmI(ctx context.Context, client kubernetes.Interface, fallback string) string {
	if r, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{}); err == nil && r.Status.UserInfo.Username != "" {
		return r.Status.UserInfo.Username
	}
	if fallback != "" {
		return fallback
	}
	if u, err := user.Current(); err == nil {
		return u.Username + " (local login)"
	}
	return ""
}
