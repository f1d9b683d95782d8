package live

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/remediate"
	"github.com/proxyaudit/proxyaudit/remediate/effect"
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

// incident is the node's incident in proxyaudit's record (a ConfigMap in
// its namespace).
func (l *live) incident(ctx context.Context, node string) remediate.Incident {
	cm, err := l.c.Client.CoreV1().ConfigMaps(ns).Get(ctx, "proxyaudit-aggregator-incidents", metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return remediate.Incident{}
	}
	if err != nil {
		l.t.Fatal(err)
	}
	inc, _ := remediate.DecodeIncident(cm.Data[node], time.Now())
	return inc
}

// forgetRestarts drops a node from the record, as an operator would after
// a drill: earlier restarts count against its budget and cooldown.
func (l *live) forgetRestarts(ctx context.Context, node string) {
	patch := []byte(`{"data":{"` + node + `":null}}`)
	_, err := l.c.Client.CoreV1().ConfigMaps(ns).Patch(ctx, "proxyaudit-aggregator-incidents", types.MergePatchType, patch, metav1.PatchOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		l.t.Fatal(err)
	}
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
		if n.ProxyRestarts() != 0 || node.Spec.Unschedulable || !l.incident(ctx, n.Name).Empty() || condition(node) != "" {
			t.Fatalf("dry-run changed the cluster: restarts %d, unschedulable %v, incident %+v, condition %q",
				n.ProxyRestarts(), node.Spec.Unschedulable, l.incident(ctx, n.Name), condition(node))
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
			inc := l.incident(ctx, n.Name)
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
		if n.ProxyRestarts() != 1 || condition(node) != corev1.ConditionTrue || node.Annotations[remediate.AnnotationCordoned] == "" || l.incident(ctx, n.Name).Cordoned.IsZero() {
			t.Fatalf("before the cordon: restarts %d, condition %q, annotations %v, incident %+v", n.ProxyRestarts(), condition(node), node.Annotations, l.incident(ctx, n.Name))
		}
		if err := undo(ctx); err != nil {
			t.Fatal(err)
		}
		l.until(t, 2*time.Minute, "agg-legacy uncordoned by proxyaudit", func() bool {
			node := l.node(ctx, n.Name)
			return !node.Spec.Unschedulable && node.Annotations[remediate.AnnotationCordoned] == "" && condition(node) == corev1.ConditionFalse &&
				l.incident(ctx, n.Name).Cordoned.IsZero()
		})

		// A static kube-proxy: no delete, a page with instructions. The
		// aggregator looks the pod up before planning, so this is a page
		// (the planner's own refusal); a restart the executor refused
		// would say the same.
		n = c.Node("agg-nft")
		undo = l.drift(ctx, t, n, true)
		l.until(t, grace+time.Minute, "a page for the static kube-proxy", func() bool {
			for _, reason := range []string{"ProxyauditPage", "ProxyauditActionRefused"} {
				for _, m := range l.events(ctx, n.Name, reason) {
					if strings.Contains(m, "static pod") {
						return true
					}
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
		l.forgetRestarts(ctx, n.Name)
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
			return l.incident(ctx, n.Name).Stage == ""
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
			l.forgetRestarts(ctx, n.Name)
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
		// The new leader continues from the record: the restart did
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
			return l.incident(ctx, a.Name).Stage == "" && l.incident(ctx, b.Name).Stage == ""
		})
	})
}

// Two replicas that both believe they lead (the old one has not yet
// noticed it lost the Lease) race to repair two drifted nodes with room
// for one. On the real API server the record's compare-and-swap lets
// exactly one restart through, whichever writes first, and once the new
// leader has written, the old term is fenced out entirely. Before, each
// counted the budget from a list of Nodes and patched without a
// resourceVersion: both restarted.
func TestE2EIncidentRecordFencing(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const rns = "pa-fence"
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: rns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	// No controller manager here makes the namespace's default account.
	if _, err := c.Client.CoreV1().ServiceAccounts(rns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "default"}},
		metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	nodes := []string{"pa-fence-a", "pa-fence-b"}
	for _, n := range nodes {
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			_ = c.Client.CoreV1().Nodes().Delete(context.Background(), n, metav1.DeleteOptions{})
		}
		_ = c.Client.CoreV1().Namespaces().Delete(context.Background(), rns, metav1.DeleteOptions{})
	})
	zero := int64(0)
	pods := func() (gone int) {
		for _, n := range nodes {
			p, err := c.Client.CoreV1().Pods(rns).Get(ctx, "kube-proxy-"+n, metav1.GetOptions{})
			if apierrors.IsNotFound(err) || err == nil && p.DeletionTimestamp != nil {
				gone++
			} else if err != nil {
				t.Fatal(err)
			}
		}
		return gone
	}
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxConcurrent, p.MaxShare, p.BreakerWindow = remediate.Restart, 1, 1, 0
	clk := clock.RealClock{}
	replica := func(term int64) *effect.Executor {
		return &effect.Executor{Client: c.Client, Policy: p, Clock: clk, Log: zaptest.NewLogger(t), ProxyNamespace: rns, ProxySelector: "k8s-app=kube-proxy",
			Incidents: &effect.Incidents{Client: c.Client, Namespace: rns, Name: "incidents"}, Lead: func() (int64, bool) { return term, true }}
	}
	plan := func(ex *effect.Executor, drifted string) []remediate.Action {
		if err := ex.Load(ctx); err != nil {
			t.Fatal(err)
		}
		var f remediate.Fleet
		for _, n := range nodes {
			f.Nodes = append(f.Nodes, remediate.Node{Name: n, Drifted: n == drifted, Healthy: n != drifted, Summary: "StuckProxy: test", Incident: ex.Incident(n)})
		}
		return remediate.Plan(clk.Now(), p, f)
	}
	for round := range 10 {
		_ = c.Client.CoreV1().ConfigMaps(rns).Delete(ctx, "incidents", metav1.DeleteOptions{})
		for _, n := range nodes {
			_ = c.Client.CoreV1().Pods(rns).Delete(ctx, "kube-proxy-"+n, metav1.DeleteOptions{GracePeriodSeconds: &zero})
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: rns, Name: "kube-proxy-" + n, Labels: map[string]string{"k8s-app": "kube-proxy"}},
				Spec: corev1.PodSpec{NodeName: n, Containers: []corev1.Container{{Name: "c", Image: "none"}}}}
			for {
				_, err := c.Client.CoreV1().Pods(rns).Create(ctx, pod, metav1.CreateOptions{})
				if err == nil {
					break
				}
				if !apierrors.IsAlreadyExists(err) || ctx.Err() != nil {
					t.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond) // the forced delete is finishing
			}
		}
		old, cur := replica(1), replica(2)
		oldActs, curActs := plan(old, nodes[0]), plan(cur, nodes[1])
		start := make(chan struct{})
		done := make(chan error, 2)
		for _, r := range []struct {
			ex   *effect.Executor
			acts []remediate.Action
		}{{old, oldActs}, {cur, curActs}} {
			go func() { <-start; done <- r.ex.Execute(ctx, r.acts, nil) }()
		}
		close(start)
		errOld, errCur := <-done, <-done
		if got := pods(); got != 1 {
			t.Fatalf("round %d: %d kube-proxy pods deleted with room for one (errors: %v; %v)", round, got, errOld, errCur)
		}
		// The new leader has written: the old one may do nothing more.
		if err := old.Load(ctx); err != nil {
			t.Fatal(err)
		}
		inc := old.Incident(nodes[1])
		inc.Stage = remediate.StageEscalated
		page := remediate.Action{Kind: remediate.Page, Node: nodes[1], Reason: "still drifted", Incident: inc}
		if err := old.Execute(ctx, []remediate.Action{page}, nil); !errors.Is(err, effect.ErrFenced) {
			t.Fatalf("round %d: the old leader acted after the new one wrote: %v", round, err)
		}
	}
}
