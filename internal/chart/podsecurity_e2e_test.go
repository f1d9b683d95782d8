package chart_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/internal/chart"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

// The API server's own PodSecurity admission judges the chart's pods, as
// created from their rendered templates (dry run: admitted or refused,
// nothing runs): the aggregator passes `restricted`; the collector (host
// network, NET_ADMIN, host paths) is refused under `restricted` and
// `baseline` with the message the chart's README quotes, and admitted
// under `privileged`, the label the README and NOTES.txt name.
func TestE2EPodSecurityAdmission(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, err := chart.Render(root(t), "proxyaudit", "proxyaudit", nil)
	if err != nil {
		t.Fatal(err)
	}
	var aggregator, collector *corev1.PodSpec
	for _, o := range r.Objects {
		switch o.GetKind() {
		case "Deployment":
			if aggregator, err = r.PodSpec("Deployment", o.GetName()); err != nil {
				t.Fatal(err)
			}
		case "DaemonSet":
			if collector, err = r.PodSpec("DaemonSet", o.GetName()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if aggregator == nil || collector == nil {
		t.Fatalf("the chart renders %v: want a Deployment and a DaemonSet", r.Kinds())
	}
	readme, err := os.ReadFile(filepath.Join(root(t), chart.Dir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	notes, err := os.ReadFile(filepath.Join(root(t), chart.Dir, "templates", "NOTES.txt"))
	if err != nil {
		t.Fatal(err)
	}
	const label = "pod-security.kubernetes.io/enforce=privileged"
	for name, doc := range map[string][]byte{"the chart's README": readme, "NOTES.txt": notes} {
		if !strings.Contains(string(doc), label) {
			t.Errorf("%s does not name the label the collector's namespace needs (%s)", name, label)
		}
	}
	admit := func(level, name string, spec *corev1.PodSpec) error {
		ns := "pa-pss-" + level
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: *spec.DeepCopy()}
		_, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	}
	for _, level := range []string{"restricted", "baseline", "privileged"} {
		_, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "pa-pss-" + level,
			Labels: map[string]string{"pod-security.kubernetes.io/enforce": level, "pod-security.kubernetes.io/enforce-version": "latest"}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// The pods' ServiceAccounts, as the chart makes them (admission
		// looks them up before PodSecurity judges the pod).
		for _, sa := range []string{aggregator.ServiceAccountName, collector.ServiceAccountName} {
			if _, err := c.Client.CoreV1().ServiceAccounts("pa-pss-"+level).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if err := admit(level, "aggregator", aggregator); err != nil {
			t.Errorf("the aggregator's pod under %s: %v", level, err)
		}
		err = admit(level, "collector", collector)
		switch {
		case level == "privileged" && err != nil:
			t.Errorf("the collector's pod under privileged: %v", err)
		case level != "privileged" && err == nil:
			t.Errorf("the collector's pod was admitted under %s", level)
		case level != "privileged":
			t.Logf("under %s: %v", level, err)
			// The README quotes what the user meets in the DaemonSet's
			// events, up to the first reason.
			msg := err.Error()
			i := strings.Index(msg, "violates PodSecurity")
			if i < 0 {
				t.Errorf("refused under %s, but not by PodSecurity: %v", level, err)
				continue
			}
			quote := msg[i:]
			if i := strings.Index(quote, ")"); i > 0 {
				quote = quote[:i+1]
			}
			if !strings.Contains(string(readme), quote) {
				t.Errorf("the chart's README does not quote what the API server says under %s: %q", level, quote)
			}
		}
	}
}
