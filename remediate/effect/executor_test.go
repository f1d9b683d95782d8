package effect

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/proxyaudit/proxyaudit/remediate"
)

// pages counts notices by kind.
type pages struct{ kinds []remediate.ActionKind }

func (p *pages) Notify(n remediate.Notice) { p.kinds = append(p.kinds, n.Kind) }

// rounds runs the planner and the executor as the aggregator does, once a
// second, over one drifted node.
func rounds(t *testing.T, ex *Executor, clk *clocktesting.FakeClock, p remediate.Policy, n int, exempt string) []remediate.ActionKind {
	t.Helper()
	var acted []remediate.ActionKind
	for range n {
		node, err := ex.Client.CoreV1().Nodes().Get(context.Background(), "node-a", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := ex.Load(context.Background()); err != nil {
			t.Log(err)
		}
		fleet := remediate.Fleet{Nodes: []remediate.Node{{Name: "node-a", Drifted: true, Summary: "StuckProxy: test", Exempt: exempt,
			Unschedulable: node.Spec.Unschedulable, Incident: ex.Incident("node-a")}}}
		actions := remediate.Plan(clk.Now(), p, fleet)
		for _, a := range actions {
			acted = append(acted, a.Kind)
		}
		_ = ex.Execute(context.Background(), actions, nil)
		clk.Step(time.Second)
	}
	return acted
}

// executor is one with the record in the fake client.
func executor(t *testing.T, client *fake.Clientset, clk *clocktesting.FakeClock, p remediate.Policy, n remediate.Notifier) *Executor {
	return &Executor{Client: client, Policy: p, Notifier: n, Clock: clk, Log: zaptest.NewLogger(t), ProxyNamespace: "kube-system", ProxySelector: "k8s-app=kube-proxy",
		Incidents: &Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents"}}
}

func stored(t *testing.T, ex *Executor, node string) remediate.Incident {
	t.Helper()
	if err := ex.Incidents.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	return ex.Incidents.Get(node, ex.now())
}

// failing makes the fake API server refuse the first n of these verbs on
// resource (every one when n < 0), as an unhappy etcd would.
func failing(client *fake.Clientset, n int, resource string, verbs ...string) {
	for _, verb := range verbs {
		client.PrependReactor(verb, resource, func(k8stesting.Action) (bool, runtime.Object, error) {
			if n == 0 {
				return false, nil, nil
			}
			n--
			return true, nil, errors.New("the API server timed out")
		})
	}
}

func noon() *clocktesting.FakeClock {
	return clocktesting.NewFakeClock(time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC))
}

func proxyNode() []runtime.Object {
	return []runtime.Object{
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-a", UID: "u1", Labels: map[string]string{"k8s-app": "kube-proxy"}},
			Spec: corev1.PodSpec{NodeName: "node-a"}},
	}
}

// A page whose incident cannot be written is still one page: before, the
// planner saw no incident and paged again every round (10 in 10).
func TestFailedIncidentRecordPagesOnce(t *testing.T) {
	client := fake.NewClientset(proxyNode()...)
	failing(client, -1, "configmaps", "create", "update")
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode = remediate.Restart
	rec := &pages{}
	ex := executor(t, client, clk, p, rec)
	if acted := rounds(t, ex, clk, p, 10, "label x"); len(acted) != 1 || len(rec.kinds) != 1 {
		t.Errorf("10 rounds with the record failing: actions %v, notices %v; want one page", acted, rec.kinds)
	}
}

// A restart whose pod delete fails is taken back: the next round restarts
// again. Before, the incident said "restarted" and, the node still
// drifting after the recheck, the ladder cordoned it without a restart.
func TestFailedRestartIsRetriedNotEscalated(t *testing.T) {
	client := fake.NewClientset(proxyNode()...)
	failing(client, 1, "pods", "delete")
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy, p.Cooldown = remediate.RestartAndCordon, remediate.MustBudget("100%"), 0
	ex := executor(t, client, clk, p, &pages{})
	first := rounds(t, ex, clk, p, 1, "")
	clk.Step(p.Recheck + time.Second) // long enough for the ladder to judge a restart
	second := rounds(t, ex, clk, p, 1, "")
	if len(first) != 1 || first[0] != remediate.RestartProxy || len(second) != 1 || second[0] != remediate.RestartProxy {
		t.Fatalf("a failed restart, then: %v; want RestartProxy, then RestartProxy again", append(first, second...))
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(context.Background(), "kube-proxy-a", metav1.GetOptions{}); err == nil {
		t.Error("the kube-proxy pod was not deleted on the retry")
	}
	if inc := stored(t, ex, "node-a"); inc.Stage != remediate.StageRestarted || len(inc.Restarts) != 1 {
		t.Errorf("incident after the retry: %+v, want restarted once", inc)
	}
}

// What a node can write — its own Node's annotations — steers nothing: an
// incident dated 2099 in the old annotations holds no budget, and the
// cordon marker on an admin's cordon does not make proxyaudit uncordon.
// Before, the kubelet of node-b held the fleet's only slot forever and
// node-a was never repaired.
func TestNodeCannotSteerItsRemediation(t *testing.T) {
	objs := proxyNode()
	objs = append(objs, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-b", Annotations: map[string]string{
		"proxyaudit.io/incident-stage": "restarted", "proxyaudit.io/kube-proxy-restarts": "2099-01-01T00:00:00Z",
		remediate.AnnotationCordoned: "2026-11-23T10:00:00Z"}}, Spec: corev1.NodeSpec{Unschedulable: true}})
	client := fake.NewClientset(objs...)
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.RestartAndCordon, remediate.MustBudget("100%")
	ex := executor(t, client, clk, p, &pages{})
	ctx := context.Background()
	if err := ex.Load(ctx); err != nil {
		t.Fatal(err)
	}
	fleet := remediate.Fleet{Nodes: []remediate.Node{
		{Name: "node-a", Drifted: true, Summary: "StuckProxy: test", Incident: ex.Incident("node-a")},
		{Name: "node-b", Healthy: true, Unschedulable: true, Incident: ex.Incident("node-b")},
	}}
	actions := remediate.Plan(clk.Now(), p, fleet)
	if err := ex.Execute(ctx, actions, nil); err != nil {
		t.Fatal(err)
	}
	if len(actions) != 1 || actions[0].Kind != remediate.RestartProxy || actions[0].Node != "node-a" {
		t.Fatalf("actions %+v; want only node-a's kube-proxy restarted", actions)
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(ctx, "kube-proxy-a", metav1.GetOptions{}); err == nil {
		t.Error("node-a's kube-proxy was not restarted")
	}
	if b, _ := client.CoreV1().Nodes().Get(ctx, "node-b", metav1.GetOptions{}); !b.Spec.Unschedulable {
		t.Error("proxyaudit uncordoned node-b, whose cordon it never made")
	}
}

// A record dated in the future is not believed: a restart "in 2099" would
// otherwise keep its node "restarted" and the fleet's budget spent.
func TestFutureRecordHoldsNoBudget(t *testing.T) {
	objs := append(proxyNode(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-b"}},
		&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-incidents", ResourceVersion: "1"},
			Data: map[string]string{"node-b": `{"stage":"restarted","opened":"2099-01-01T00:00:00Z","restarts":["2099-01-01T00:00:00Z"]}`}})
	client := fake.NewClientset(objs...)
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
	ex := executor(t, client, clk, p, &pages{})
	if acted := rounds(t, ex, clk, p, 1, ""); len(acted) != 1 || acted[0] != remediate.RestartProxy {
		t.Fatalf("actions %v; want node-a restarted", acted)
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(context.Background(), "kube-proxy-a", metav1.GetOptions{}); err == nil {
		t.Error("the executor refused node-a: the future record held the budget")
	}
}

// A replica that no longer leads, or whose term is older than the
// record's, does nothing and says nothing.
func TestFencedReplicaActsNot(t *testing.T) {
	for _, tc := range []struct {
		name string
		lead func() (int64, bool)
	}{
		{"lease lost", func() (int64, bool) { return 7, false }},
		{"older term", func() (int64, bool) { return 3, true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := append(proxyNode(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-incidents",
				ResourceVersion: "1", Annotations: map[string]string{TermAnnotation: "5"}}})
			client := fake.NewClientset(objs...)
			clk := noon()
			p := remediate.DefaultPolicy()
			p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
			rec := &pages{}
			ex := executor(t, client, clk, p, rec)
			ex.Lead = tc.lead
			outcomes := map[Outcome]int{}
			ex.Observe = func(_ remediate.ActionKind, o Outcome) { outcomes[o]++ }
			acted := rounds(t, ex, clk, p, 3, "")
			if len(acted) == 0 || outcomes[Fenced] != len(acted) || len(rec.kinds) != 0 {
				t.Errorf("planned %v, outcomes %v, notices %v; want every action fenced, no notice", acted, outcomes, rec.kinds)
			}
			if _, err := client.CoreV1().Pods("kube-system").Get(context.Background(), "kube-proxy-a", metav1.GetOptions{}); err != nil {
				t.Error("a fenced replica deleted the kube-proxy pod")
			}
			evs, _ := client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{})
			if len(evs.Items) != 0 {
				t.Errorf("a fenced replica recorded %d Events", len(evs.Items))
			}
		})
	}
}

// The record follows the fleet: nodes that left, and nodes with nothing
// left to remember, are dropped.
func TestPruneFollowsTheFleet(t *testing.T) {
	clk := noon()
	old := clk.Now().Add(-48 * time.Hour).Format(time.RFC3339)
	client := fake.NewClientset(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-incidents", ResourceVersion: "1"},
		Data: map[string]string{"gone": `{"stage":"open","opened":"2026-11-23T11:00:00Z"}`, "quiet": `{"restarts":["` + old + `"]}`,
			"open": `{"stage":"open","opened":"2026-11-23T11:00:00Z"}`}})
	p := remediate.DefaultPolicy()
	p.Mode = remediate.Restart
	ex := executor(t, client, clk, p, nil)
	if err := ex.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := ex.Prune(context.Background(), func(n string) bool { return n != "gone" }); err != nil {
		t.Fatal(err)
	}
	if err := ex.Incidents.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := ex.Incidents.Nodes(); len(got) != 1 || got[0] != "open" {
		t.Errorf("record after pruning holds %v; want [open]", got)
	}
}

// A static kube-proxy is not restarted: the restart is refused, with an
// ActionRefused Event saying what to do by hand, and the incident stays
// open without a restart counted.
func TestStaticProxyIsRefusedNotRestarted(t *testing.T) {
	objs := proxyNode()
	objs[1].(*corev1.Pod).Annotations = map[string]string{MirrorPodAnnotation: "x"}
	client := fake.NewClientset(objs...)
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
	ex := executor(t, client, clk, p, &pages{})
	outcomes := map[Outcome]int{}
	ex.Observe = func(_ remediate.ActionKind, o Outcome) { outcomes[o]++ }
	rounds(t, ex, clk, p, 1, "")
	evs, _ := client.CoreV1().Events("").List(context.Background(), metav1.ListOptions{})
	if outcomes[Refused] != 1 || len(evs.Items) != 1 || evs.Items[0].Reason != "ProxyauditActionRefused" || !strings.Contains(evs.Items[0].Message, "static pod") {
		t.Errorf("outcomes %v, events %+v; want one refusal saying static pod", outcomes, evs.Items)
	}
	if inc := stored(t, ex, "node-a"); inc.Stage != remediate.StageOpen || len(inc.Restarts) != 0 {
		t.Errorf("incident %+v; want open, no restart", inc)
	}
}

// A replica that leads without an election (scaled down to one) is not
// fenced by the term the last elected leader wrote, and leaves it.
func TestUnelectedReplicaIsNotFenced(t *testing.T) {
	objs := append(proxyNode(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-incidents",
		ResourceVersion: "1", Annotations: map[string]string{TermAnnotation: "5"}}})
	client := fake.NewClientset(objs...)
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
	ex := executor(t, client, clk, p, &pages{})
	ex.Lead = func() (int64, bool) { return Unfenced, true }
	if acted := rounds(t, ex, clk, p, 1, ""); len(acted) != 1 || acted[0] != remediate.RestartProxy {
		t.Fatalf("actions %v", acted)
	}
	if _, err := client.CoreV1().Pods("kube-system").Get(context.Background(), "kube-proxy-a", metav1.GetOptions{}); err == nil {
		t.Error("the unelected replica was fenced: kube-proxy not restarted")
	}
	cm, _ := client.CoreV1().ConfigMaps("proxyaudit").Get(context.Background(), "proxyaudit-incidents", metav1.GetOptions{})
	if cm.Annotations[TermAnnotation] != "5" {
		t.Errorf("recorded term %q, want the elected leader's 5 left as it was", cm.Annotations[TermAnnotation])
	}
}

// A record that could not be written is written with the next decision:
// the page is not repeated meanwhile, and the resolve, once the node is
// healthy, lands in the record and closes the page.
func TestFailedRecordIsWrittenWithTheNextDecision(t *testing.T) {
	client := fake.NewClientset(proxyNode()...)
	failing(client, 1, "configmaps", "create", "update")
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode = remediate.Restart
	rec := &pages{}
	ex := executor(t, client, clk, p, rec)
	rounds(t, ex, clk, p, 3, "label x") // drifted, exempt: one page, its record failed
	if err := ex.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	healthy := remediate.Fleet{Nodes: []remediate.Node{{Name: "node-a", Healthy: true, Incident: ex.Incident("node-a")}}}
	if err := ex.Execute(context.Background(), remediate.Plan(clk.Now(), p, healthy), nil); err != nil {
		t.Fatal(err)
	}
	if len(rec.kinds) != 2 || rec.kinds[0] != remediate.Page || rec.kinds[1] != remediate.Resolve {
		t.Errorf("notices %v; want one page, then the resolve", rec.kinds)
	}
	if inc := stored(t, ex, "node-a"); !inc.Empty() || ex.Remembered() != 0 {
		t.Errorf("after the resolve: record %+v, %d node(s) remembered; want nothing", inc, ex.Remembered())
	}
}

// The leader plans every second, but reads the record at most once per
// MaxAge: its own writes keep its copy current, and a hand edit is seen
// within MaxAge.
func TestRecordIsReadOncePerMaxAge(t *testing.T) {
	client := fake.NewClientset(&corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "proxyaudit", Name: "proxyaudit-incidents", ResourceVersion: "1"},
		Data: map[string]string{"node-a": `{"stage":"open","opened":"2026-11-23T11:00:00Z"}`}})
	const maxAge = 30 * time.Second
	clk := noon()
	s := &Incidents{Client: client, Namespace: "proxyaudit", Name: "proxyaudit-incidents", MaxAge: maxAge, Clock: clk}
	gets := func() int {
		n := 0
		for _, a := range client.Actions() {
			if a.GetVerb() == "get" && a.GetResource().Resource == "configmaps" {
				n++
			}
		}
		return n
	}
	ctx := context.Background()
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	for range 10 {
		if err := s.Load(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if g := gets(); g != 1 {
		t.Fatalf("10 loads within MaxAge read the record %d times, want 1", g)
	}
	// Its own write is its copy: no read needed to see it.
	err := s.Update(ctx, Unfenced, now, func(map[string]remediate.Incident) (map[string]remediate.Incident, error) {
		return map[string]remediate.Incident{"node-b": {Stage: remediate.StageOpen, Opened: now}}, nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	if g, inc := gets(), s.Get("node-b", now); g != 1 || inc.Stage != remediate.StageOpen {
		t.Fatalf("after its own write: %d reads, node-b %+v; want 1 read and the incident", g, inc)
	}
	// An operator clears node-a by hand: seen once the copy is MaxAge old.
	if _, err := client.CoreV1().ConfigMaps("proxyaudit").Patch(ctx, "proxyaudit-incidents", types.MergePatchType,
		[]byte(`{"data":{"node-a":null}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	clk.Step(maxAge - time.Second)
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	if g := gets(); g != 1 {
		t.Fatalf("a load within MaxAge of its own write read the record (%d reads)", g)
	}
	clk.Step(time.Second)
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	if g, inc := gets(), s.Get("node-a", now); g != 2 || inc.Stage != "" {
		t.Errorf("after MaxAge: %d reads, node-a %+v; want a second read showing the hand edit", g, inc)
	}
}

// The planner learns a static kube-proxy before it decides (Inspect), so
// a page held back by the breaker or the budget still says what to do; a
// lookup that fails keeps what was known.
func TestInspectFindsStaticBeforePlanning(t *testing.T) {
	objs := proxyNode()
	objs[1].(*corev1.Pod).Annotations = map[string]string{MirrorPodAnnotation: "x"}
	client := fake.NewClientset(objs...)
	ex := executor(t, client, noon(), remediate.DefaultPolicy(), &pages{})
	if static, noPod := ex.Inspect(context.Background(), "node-a", remediate.DataplaneKubeProxy); !static || noPod {
		t.Fatalf("mirror pod: static %v, no pod %v", static, noPod)
	}
	client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, errors.New("apiserver away")
	})
	if static, _ := ex.Inspect(context.Background(), "node-a", remediate.DataplaneKubeProxy); !static {
		t.Error("a failed lookup forgot the static kube-proxy")
	}
	if static, noPod := ex.Inspect(context.Background(), "node-b", remediate.DataplaneKubeProxy); static || noPod {
		t.Errorf("never looked up: static %v, no pod %v", static, noPod)
	}
}

// TestInspectLooksAgainOnlyWhenStale: planning runs every second, so a
// drifting node's kube-proxy pod is looked up once per inspectFresh, not
// once per round; after that a change (the pod gone) is seen.
func TestInspectLooksAgainOnlyWhenStale(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "kube-proxy-a",
		Labels: map[string]string{"k8s-app": "kube-proxy"}}, Spec: corev1.PodSpec{NodeName: "node-a"}})
	lists := 0
	client.PrependReactor("list", "pods", func(k8stesting.Action) (bool, runtime.Object, error) {
		lists++
		return false, nil, nil
	})
	clk := noon()
	ex := executor(t, client, clk, remediate.DefaultPolicy(), nil)
	for range 5 {
		if static, noPod := ex.Inspect(ctx, "node-a", remediate.DataplaneKubeProxy); static || noPod {
			t.Fatalf("static %v, no pod %v: want the DaemonSet pod found", static, noPod)
		}
		clk.Step(time.Second)
	}
	if lists != 1 {
		t.Fatalf("%d pod lists in 5 rounds within %s, want 1", lists, inspectFresh)
	}
	if err := client.CoreV1().Pods("kube-system").Delete(ctx, "kube-proxy-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	clk.Step(inspectFresh)
	if _, noPod := ex.Inspect(ctx, "node-a", remediate.DataplaneKubeProxy); !noPod || lists != 2 {
		t.Fatalf("after %s: no pod %v after %d lists, want the pod's absence seen on a second list", inspectFresh, noPod, lists)
	}
}

// On a node where Cilium replaces kube-proxy, the restart deletes the
// node's Cilium agent pod, never a kube-proxy pod that happens to run
// there too (a half-migrated node), and the action says which; without
// an agent pod it is refused naming the agent's selector.
func TestCiliumNodeRestartsTheAgentPod(t *testing.T) {
	objs := append(proxyNode(),
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "cilium-a", UID: "u2", Labels: map[string]string{"k8s-app": "cilium"}},
			Spec: corev1.PodSpec{NodeName: "node-a"}},
		&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "kube-system", Name: "cilium-b", UID: "u3", Labels: map[string]string{"k8s-app": "cilium"}},
			Spec: corev1.PodSpec{NodeName: "node-b"}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-c"}})
	client := fake.NewClientset(objs...)
	clk := noon()
	p := remediate.DefaultPolicy()
	p.Mode, p.MaxUnhealthy = remediate.Restart, remediate.MustBudget("100%")
	ex := executor(t, client, clk, p, &pages{})
	ex.AgentNamespace, ex.AgentSelector = "kube-system", "k8s-app=cilium"
	outcomes := map[Outcome]int{}
	ex.Observe = func(_ remediate.ActionKind, o Outcome) { outcomes[o]++ }
	ctx := context.Background()
	_, noPodC := ex.Inspect(ctx, "node-c", remediate.DataplaneCilium)
	if static, noPod := ex.Inspect(ctx, "node-a", remediate.DataplaneCilium); static || noPod || !noPodC {
		t.Errorf("agent pods: node-a static %v, no pod %v; node-c no pod %v", static, noPod, noPodC)
	}
	p.MaxConcurrent = 5
	fleet := remediate.Fleet{Nodes: []remediate.Node{
		{Name: "node-a", Drifted: true, Summary: "StaleEndpoint: test", Dataplane: remediate.DataplaneCilium},
		{Name: "node-c", Drifted: true, Summary: "StaleEndpoint: test", Dataplane: remediate.DataplaneCilium, NoProxyPod: noPodC},
	}}
	actions := remediate.Plan(clk.Now(), p, fleet)
	if len(actions) != 2 || actions[0].Kind != remediate.RestartProxy || actions[0].Reason != "StaleEndpoint: test; restarting the Cilium agent on the node" ||
		actions[1].Kind != remediate.Page || !strings.Contains(actions[1].Reason, "no Cilium agent pod found on the node") {
		t.Errorf("actions %+v", actions)
	}
	if err := ex.Execute(ctx, actions, nil); err != nil {
		t.Fatal(err)
	}
	pods, _ := client.CoreV1().Pods("kube-system").List(ctx, metav1.ListOptions{})
	var left []string
	for _, p := range pods.Items {
		left = append(left, p.Name)
	}
	if strings.Join(left, ",") != "cilium-b,kube-proxy-a" {
		t.Errorf("pods left %v; want node-a's agent pod deleted, its kube-proxy pod and node-b's agent kept", left)
	}
	if outcomes[Done] != 2 {
		t.Errorf("outcomes %v", outcomes)
	}
	// Without an agent selector nothing is deleted: an empty one would
	// match every pod on the node.
	ex.AgentSelector = ""
	if pod, _, err := ex.proxyPod(ctx, "node-b", remediate.DataplaneCilium); err == nil || pod != nil || !strings.Contains(err.Error(), "--cilium-selector") {
		t.Errorf("no agent selector: pod %v, %v", pod, err)
	}
}
