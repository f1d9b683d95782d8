package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os/user"
	"strings"
	"time"

	"github.com/spf13/cobra"
	authnv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/remediate"
)

const pauseUsage = `pause holds every repair, fleet-wide; resume lets them go on.

While paused, proxyaudit restarts and cordons nothing; detection, findings
and pages go on, and every page, the report and the API say who paused, when
and why. A pause with --for ends by itself. It is kept in the ConfigMap
--pause-configmap (the chart's, in the aggregator's namespace: -n, else the
context's, else proxyaudit); the chart's Role of the same name
(<release>-aggregator-pause) lets a group write it (remediation.pausers).

Exit status: 0 done, 2 usage error or the API refused.`

func (c *cli) pauseCmd(resume bool) *cobra.Command {
	var k *kube
	var cm, reason string
	var forDur time.Duration
	var status bool
	cmd := &cobra.Command{
		Use:     "pause --reason TEXT [--for DURATION]",
		Short:   "Hold every repair, fleet-wide (detection and pages go on)",
		Long:    pauseUsage,
		Example: "  kubectl proxyaudit pause --reason \"node pool upgrade, CHG-1234\" --for 2h\n  kubectl proxyaudit pause --status\n  kubectl proxyaudit resume",
		Args:    noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c.code = c.pause(cmd, k, resume, cm, reason, forDur, status)
			return nil
		},
	}
	if resume {
		cmd.Use, cmd.Short = "resume", "Let repairs go on after a pause"
	}
	k = addKubeFlags(cmd.Flags(), false)
	cmd.Flags().StringVar(&cm, "pause-configmap", "proxyaudit-aggregator-pause", "the pause ConfigMap (the chart's <release>-aggregator-pause)")
	if !resume {
		cmd.Flags().StringVar(&reason, "reason", "", "why (shown in every page while paused); required to pause")
		cmd.Flags().DurationVar(&forDur, "for", 0, "end the pause by itself after this long (0: until resume)")
		cmd.Flags().BoolVar(&status, "status", false, "say whether remediation is paused, and change nothing")
	}
	k.complete(cmd)
	return cmd
}

func (c *cli) pause(cmd *cobra.Command, k *kube, resume bool, cm, reason string, forDur time.Duration, status bool) int {
	stdout := c.stdout
	fail := func(format string, a ...any) int { return c.fail(cmd, format, a...) }
	if !resume && !status && strings.TrimSpace(reason) == "" {
		return fail("--reason is required: say why, for the people paged while it lasts")
	}
	if forDur < 0 {
		return fail("--for %s: want a positive duration", forDur)
	}
	if err := k.single(cmd.Name()); err != nil {
		return fail("%v", err)
	}
	client, cfg, namespace, err := k.client(k.context())
	if err != nil {
		return fail("%v", err)
	}
	user := cfg.Username
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	current, err := client.CoreV1().ConfigMaps(namespace).Get(ctx, cm, metav1.GetOptions{})
	if err != nil {
		if apierrors.IsNotFound(err) {
			return fail("no ConfigMap %s/%s: is proxyaudit installed there (chart 0.1.0 or later)? Pass -n or --pause-configmap", namespace, cm)
		}
		if apierrors.IsForbidden(err) {
			return fail("%v: the chart's %s Role allows it; ask for it to be bound to you (remediation.pausers)", err, cm)
		}
		return fail("read %s/%s: %v", namespace, cm, err)
	}
	now := time.Now()
	old, paused, derr := remediate.DecodePause(current.Data)
	if status {
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
		req = remediate.PauseRequest{By: whoAmI(ctx, client, user), Reason: strings.TrimSpace(reason), Since: now.UTC().Truncate(time.Second)}
		if forDur > 0 {
			req.Until = req.Since.Add(forDur)
		}
		for k, v := range req.Data() {
			data[k] = v
		}
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"resourceVersion": current.ResourceVersion}, "data": data})
	if _, err := client.CoreV1().ConfigMaps(namespace).Patch(ctx, cm, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		if apierrors.IsConflict(err) {
			return fail("%s/%s changed while this ran (someone else paused or resumed): run it again", namespace, cm)
		}
		if apierrors.IsForbidden(err) {
			return fail("%v: the chart's %s Role allows it; ask for it to be bound to you (remediation.pausers)", err, cm)
		}
		return fail("write %s/%s: %v", namespace, cm, err)
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
