package live

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/remediatetest"
)

// until polls cond (generous deadline) and fails with what.
func (l *live) until(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			fs, _ := l.findings()
			t.Fatalf("after %s, still waiting for %s; findings:\n  %s\n%s", d, what, describe(fs), l.logs())
		}
		time.Sleep(500 * time.Millisecond)
	}
	return time.Since(start)
}

func (l *live) node(ctx context.Context, name string) *corev1.Node {
	n, err := l.c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		l.t.Fatal(err)
	}
	return n
}

// events returns the messages of proxyaudit's Events on a node with
// reason, since the test's live system started.
func (l *live) events(ctx context.Context, node, reason string) []string {
	evs, err := l.c.Client.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.name=" + node + ",reason=" + reason})
	if err != nil {
		l.t.Fatal(err)
	}
	uid := l.node(ctx, node).UID
	var out []string
	for _, e := range evs.Items {
		if e.InvolvedObject.UID != uid {
			l.t.Errorf("Event %s names node UID %q, not %q: kubectl describe node would not show it", e.Name, e.InvolvedObject.UID, uid)
		}
		if !e.FirstTimestamp.Time.Before(l.started.Truncate(time.Second)) {
			out = append(out, e.Message)
		}
	}
	return out
}

func condition(n *corev1.Node) corev1.ConditionStatus {
	for _, c := range n.Status.Conditions {
		if c.Type == remediate.ConditionType {
			return c.Status
		}
	}
	return ""
}

// drift makes the node's kube-proxy miss changes (frozen: a restart
// cures it; hung informer: it does not, the new one cannot reach the API
// either) and changes two services.
func (l *live) drift(ctx context.Context, t *testing.T, n *localcluster.Node, curable bool) localcluster.Undo {
	t.Helper()
	fault := n.HangInformer
	if curable {
		fault = n.Freeze
	}
	undo, err := fault(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if curable {
		// A restart replaces the frozen process; thawing is only for
		// when nobody restarted it.
		pid := n.ProxyPID()
		thaw := undo
		undo = func(ctx context.Context) error {
			if n.ProxyPID() == pid {
				return thaw(ctx)
			}
			return nil
		}
	}
	l.epoch++
	for _, i := range []int{40, 41} {
		if err := l.setEndpoints(ctx, i, l.epoch); err != nil {
			t.Fatal(err)
		}
	}
	return undo
}

// Remediation on the real cluster: the stand-in kubelet restarts
// kube-proxy when proxyaudit deletes its pod.
func TestE2ERemediation(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	if err := c.ManageProxyPods(ctx, "agg-nft"); err != nil {
		t.Fatal(err)
	}

	t.Run("dry-run changes nothing and says what it would do", func(t *testing.T) {
		l := newLive(ctx, t, "remediation.mode=dry-run", "remediation.maxShare=0.5")
		n := c.Node("agg-ipt")
		undo := l.drift(ctx, t, n, true)
		l.until(t, grace+time.Minute, "a dry-run Event on agg-ipt", func() bool {
			return len(l.events(ctx, n.Name, "ProxyauditDryRun")) > 0
		})
		if msg := l.events(ctx, n.Name, "ProxyauditDryRun")[0]; !strings.Contains(msg, "would RestartProxy") {
			t.Errorf("dry-run Event: %s", msg)
		}
		time.Sleep(3 * interval)
		node := l.node(ctx, n.Name)
		if n.ProxyRestarts() != 0 || node.Spec.Unschedulable || len(node.Annotations) > 0 && node.Annotations[remediate.AnnotationStage] != "" || condition(node) != "" {
			t.Fatalf("dry-run changed the cluster: restarts %d, unschedulable %v, annotations %v, condition %q",
				n.ProxyRestarts(), node.Spec.Unschedulable, node.Annotations, condition(node))
		}
		if err := undo(ctx); err != nil {
			t.Fatal(err)
		}
		if err := n.RestartProxy(ctx); err != nil { // by hand, as an SRE would
			t.Fatal(err)
		}
		l.waitAllInSync("agg-ipt restarted by hand")
	})

	t.Run("restart, re-audit, cordon, uncordon", func(t *testing.T) {
		sl := remediatetest.NewSlack(t, remediatetest.Flaky)
		l := newLive(ctx, t, "remediation.mode=restart-and-cordon", "remediation.recheck=25s",
			"remediation.maxNodes=1", "remediation.maxShare=0.5", "remediation.cooldown=1m",
			"slack.botToken=xoxb-e2e-test", "slack.channel=C0PROXYAUDIT", "slack.apiURL="+sl.URL, "clusterName=e2e")

		// A dead API connection: the restart cures it.
		n := c.Node("agg-ipt")
		undo := l.drift(ctx, t, n, true)
		took := l.until(t, grace+2*time.Minute, "kube-proxy restarted and agg-ipt back in sync", func() bool {
			fs, err := l.findings()
			return err == nil && n.ProxyRestarts() == 1 && len(fs) == 0 && condition(l.node(ctx, n.Name)) == corev1.ConditionFalse
		})
		t.Logf("agg-ipt repaired by a restart %s after the change", took.Round(time.Second))
		undo(ctx)
		l.until(t, time.Minute, "the incident closed on agg-ipt", func() bool {
			inc := remediate.IncidentFromAnnotations(l.node(ctx, n.Name).Annotations)
			return inc.Stage == "" && len(inc.Restarts) == 1
		})
		if len(l.events(ctx, n.Name, "ProxyauditRestartProxy")) != 1 || len(l.events(ctx, n.Name, "ProxyauditResolve")) != 1 {
			t.Errorf("Events: restart %v, resolve %v", l.events(ctx, n.Name, "ProxyauditRestartProxy"), l.events(ctx, n.Name, "ProxyauditResolve"))
		}
		// Slack (its first answers 429, then 500): one thread, opened with
		// the evidence, closed resolved, the opening message updated.
		l.until(t, time.Minute, "the Slack thread for agg-ipt resolved", func() bool { return sl.Updates.Load() >= 1 })
		ps := sl.Posts()
		if len(ps) < 2 || ps[0].Get("thread_ts") != "" || !strings.Contains(ps[0].Get("blocks"), "churn/churn-4") ||
			!strings.Contains(ps[0].Get("text"), "Restarting kube-proxy on agg-ipt") ||
			ps[len(ps)-1].Get("thread_ts") == "" || !strings.Contains(ps[len(ps)-1].Get("text"), "back in sync") {
			t.Errorf("Slack thread:\n%v", ps)
		}
		if sl.Refused.Load() != 2 {
			t.Errorf("Slack refused %d posts, want 2 (429, 500) retried", sl.Refused.Load())
		}

		// A hung informer the restart does not cure: cordoned after the
		// re-audit; healthy again once the fault is gone: uncordoned.
		n = c.Node("agg-legacy")
		undo = l.drift(ctx, t, n, false)
		l.until(t, grace+2*time.Minute, "agg-legacy cordoned", func() bool { return l.node(ctx, n.Name).Spec.Unschedulable })
		node := l.node(ctx, n.Name)
		if n.ProxyRestarts() != 1 || condition(node) != corev1.ConditionTrue || node.Annotations[remediate.AnnotationCordoned] == "" {
			t.Fatalf("before the cordon: restarts %d, condition %q, annotations %v", n.ProxyRestarts(), condition(node), node.Annotations)
		}
		if err := undo(ctx); err != nil {
			t.Fatal(err)
		}
		l.until(t, 2*time.Minute, "agg-legacy uncordoned by proxyaudit", func() bool {
			node := l.node(ctx, n.Name)
			return !node.Spec.Unschedulable && node.Annotations[remediate.AnnotationCordoned] == "" && condition(node) == corev1.ConditionFalse
		})

		// A static kube-proxy: no delete, a page with instructions.
		n = c.Node("agg-nft")
		undo = l.drift(ctx, t, n, true)
		l.until(t, grace+time.Minute, "a page for the static kube-proxy", func() bool {
			for _, m := range l.events(ctx, n.Name, "ProxyauditActionRefused") {
				if strings.Contains(m, "static pod") {
					return true
				}
			}
			return false
		})
		if n.ProxyRestarts() != 0 {
			t.Errorf("a static kube-proxy was restarted")
		}
		undo(ctx)
		if err := n.RestartProxy(ctx); err != nil {
			t.Fatal(err)
		}
		l.waitAllInSync("agg-nft restarted by hand")
		fs, _ := l.findings()
		if len(fs) != 0 {
			t.Errorf("findings left: %s", describe(fs))
		}
	})

	t.Run("leader crash loop: no repair repeated, none lost", func(t *testing.T) {
		l := newLive(ctx, t, "remediation.mode=restart", "remediation.recheck=30s",
			"remediation.maxNodes=1", "remediation.maxShare=0.5", "remediation.cooldown=10m")
		n := c.Node("agg-ipt")
		patch := []byte(`{"metadata":{"annotations":{"` + remediate.AnnotationRestarts + `":null}}}`)
		if _, err := c.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		before := n.ProxyRestarts()
		undo := l.drift(ctx, t, n, true)
		defer undo(ctx)
		// Kill whichever replica holds the Lease every 10 s for a minute,
		// restarting it at once, as a crash-looping pod would.
		kills := 0
		for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(10 * time.Second) {
			holder := l.leader(ctx)
			ip, _, _ := strings.Cut(holder, ":")
			if p := l.aggs[ip]; p != nil && !p.Exited() {
				p.Kill()
				l.startAggregator(ip)
				kills++
			}
		}
		t.Logf("injected: the leader SIGKILLed %d times in a minute, restarted each time; %s drifted (frozen kube-proxy)", kills, n.Name)
		l.waitAllInSync(n.Name + " repaired")
		l.until(t, 2*time.Minute, "the incident closed", func() bool {
			return remediate.IncidentFromAnnotations(l.node(ctx, n.Name).Annotations).Stage == ""
		})
		if got := n.ProxyRestarts() - before; got != 1 {
			t.Errorf("kube-proxy on %s restarted %d times through the crash loop, want exactly 1", n.Name, got)
		}
		t.Logf("%s repaired with one kube-proxy restart; incident closed", n.Name)
	})

	t.Run("fleet cap, then the leader killed mid-incident", func(t *testing.T) {
		l := newLive(ctx, t, "remediation.mode=restart", "remediation.recheck=40s",
			"remediation.maxNodes=5", "remediation.maxShare=0.5", "remediation.cooldown=10m")
		a, b := c.Node("agg-ipt"), c.Node("agg-legacy")
		// The earlier restarts count against the per-node budget and
		// cooldown; clear them, as an operator would after a drill.
		for _, n := range []*localcluster.Node{a, b} {
			patch := []byte(`{"metadata":{"annotations":{"` + remediate.AnnotationRestarts + `":null}}}`)
			if _, err := c.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		ra, rb := a.ProxyRestarts(), b.ProxyRestarts()
		undoA, err := a.HangInformer(ctx)
		if err != nil {
			t.Fatal(err)
		}
		undoB := l.drift(ctx, t, b, false)
		// Two of three nodes hung, a cap of floor(0.5 × 3) = 1: one is
		// restarted, the other only paged.
		restarted := func() int64 { return a.ProxyRestarts() - ra + b.ProxyRestarts() - rb }
		l.until(t, grace+time.Minute, "one restart and one capped page", func() bool {
			capped := 0
			for _, n := range []string{a.Name, b.Name} {
				for _, m := range l.events(ctx, n, "ProxyauditPage") {
					if strings.Contains(m, "remediation budget reached") {
						capped++
					}
				}
			}
			return restarted() == 1 && capped == 1
		})
		first := a
		if b.ProxyRestarts() > rb {
			first = b
		}
		before := first.ProxyRestarts()
		// Kill the leader while the restarted node waits for its re-audit.
		old := l.leader(ctx)
		ip, _, _ := strings.Cut(old, ":")
		l.aggs[ip].Kill()
		l.until(t, 30*time.Second, "a new leader", func() bool { cur := l.leader(ctx); return cur != "" && cur != old })
		l.startAggregator(ip)
		// The new leader continues from the annotations: the restart did
		// not help and the cooldown forbids another, so it pages.
		l.until(t, 2*time.Minute, "the new leader escalates "+first.Name+" without restarting it again", func() bool {
			for _, m := range l.events(ctx, first.Name, "ProxyauditPage") {
				if strings.Contains(m, "needs a human") {
					return true
				}
			}
			return false
		})
		if first.ProxyRestarts() != before {
			t.Fatalf("%s restarted again within its cooldown after the leader change", first.Name)
		}
		// Its restart judged, the budget is free: the other node may now
		// get its restart (that is the cap working, not a repeat).
		if err := undoA(ctx); err != nil {
			t.Fatal(err)
		}
		if err := undoB(ctx); err != nil {
			t.Fatal(err)
		}
		for _, n := range []*localcluster.Node{a, b} {
			if err := n.RestartProxy(ctx); err != nil { // the human
				t.Fatal(err)
			}
		}
		l.waitAllInSync("both nodes repaired by hand")
		l.until(t, time.Minute, "both incidents closed", func() bool {
			return remediate.IncidentFromAnnotations(l.node(ctx, a.Name).Annotations).Stage == "" &&
				remediate.IncidentFromAnnotations(l.node(ctx, b.Name).Annotations).Stage == ""
		})
	})
}
