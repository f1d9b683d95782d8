package chart_test

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/localcluster"
	"github.com/proxyaudit/proxyaudit/internal/openreports"
)

// The leader's writer on the real API server: reports appear with the
// drift, follow it (an update at most every UpdateEvery), go when it ends;
// a new leader adopts what it finds without a write and keeps the report
// of a node it has not heard yet; a leader that lost its Lease writes
// nothing; a report deleted by hand comes back at the next relist; the
// owner (a ClusterRole) is on every report.
func TestE2EOpenReportsWriter(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	installOpenReportsCRD(ctx, t, c)
	owner, err := c.Client.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "proxyaudit-writer-test"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Client.RbacV1().ClusterRoles().Delete(context.Background(), owner.Name, metav1.DeleteOptions{})
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	reports := dc.Resource(openreports.Resource)
	defer reports.DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})

	writes := func() *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "writes"}, []string{"verb", "outcome"})
	}
	newWriter := func(w *prometheus.CounterVec) *openreports.Writer {
		return openreports.NewWriter(openreports.WriterConfig{Client: dc, WritesPerSecond: 50, UpdateEvery: 2 * time.Second, Relist: 3 * time.Second,
			Owner: &openreports.OwnerReference{APIVersion: "rbac.authorization.k8s.io/v1", Kind: "ClusterRole", Name: owner.Name, UID: string(owner.UID)}, Writes: w})
	}
	total := func(w *prometheus.CounterVec, verb string) int {
		return int(testutil.ToFloat64(w.WithLabelValues(verb, "ok")))
	}
	since := time.Now().Add(-time.Minute).Truncate(time.Second)
	stale := func(node, ep string) audit.TimedFinding {
		return audit.TimedFinding{Since: since, Finding: audit.Finding{Node: node, Service: "kube-system/kube-dns", Port: "dns", Protocol: "UDP", Family: 4,
			Scope: audit.ScopeCluster, Kind: audit.StaleEndpoint, Endpoint: ep, Detail: "routes to " + ep + ", which the cluster no longer lists"}}
	}
	verdict := func(states map[string]audit.NodeState, fs ...audit.TimedFinding) *audit.Verdict {
		v := &audit.Verdict{Findings: fs}
		for _, n := range slices.Sorted(maps.Keys(states)) {
			v.Nodes = append(v.Nodes, audit.NodeStatus{Node: n, State: states[n]})
		}
		return v
	}
	// held returns the reports on the API server: name → its results' endpoints.
	held := func() map[string]string {
		t.Helper()
		l, err := reports.List(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, it := range l.Items {
			if refs := it.GetOwnerReferences(); len(refs) != 1 || refs[0].UID != owner.UID {
				t.Errorf("%s is not owned by the ClusterRole: %+v", it.GetName(), refs)
			}
			var eps []string
			res, _ := it.Object["results"].([]any)
			for _, r := range res {
				props, _ := r.(map[string]any)["properties"].(map[string]any)
				eps = append(eps, fmt.Sprint(props["endpoint"]))
			}
			out[it.GetName()] = strings.Join(eps, ",")
		}
		return out
	}
	waitHeld := func(want string) {
		t.Helper()
		var got string
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			if got = fmt.Sprint(held()); got == want {
				return
			}
		}
		t.Fatalf("the API server holds %s, want %s", got, want)
	}

	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	w1 := writes()
	leader := newWriter(w1)
	go leader.Run(runCtx)
	term1, endTerm1 := context.WithCancel(ctx)
	defer endTerm1()

	// node-b drifts; node-d's collector is silent; node-c is in sync.
	states := map[string]audit.NodeState{"node-b": audit.NodeStuck, "node-c": audit.NodeInSync, "node-d": audit.NodeMissing}
	missing := audit.TimedFinding{Since: since, Finding: audit.Finding{Node: "node-d", Kind: audit.CollectorMissing, Detail: "no report for 1m"}}
	leader.Offer(term1, verdict(states, stale("node-b", "198.18.0.10:53"), missing))
	waitHeld("map[proxyaudit-node-node-b:198.18.0.10:53 proxyaudit-node-node-d:<nil>]")

	// node-b's drift grows: its report follows, within UpdateEvery.
	for i := range 10 { // offered every second, as the leader does
		leader.Offer(term1, verdict(states, stale("node-b", "198.18.0.10:53"), stale("node-b", "198.18.0.11:53"), missing))
		if i < 9 {
			time.Sleep(300 * time.Millisecond)
		}
	}
	waitHeld("map[proxyaudit-node-node-b:198.18.0.10:53,198.18.0.11:53 proxyaudit-node-node-d:<nil>]")
	if n := total(w1, "update"); n != 1 {
		t.Errorf("node-b's report was updated %d times for one change offered ten times", n)
	}

	// node-b heals: its report goes at once.
	states["node-b"] = audit.NodeInSync
	leader.Offer(term1, verdict(states, missing))
	waitHeld("map[proxyaudit-node-node-d:<nil>]")

	// The leader loses its Lease: what it offers after is not written.
	endTerm1()
	leader.Offer(term1, verdict(states, stale("node-c", "198.18.0.12:53"), missing))
	time.Sleep(time.Second)
	waitHeld("map[proxyaudit-node-node-d:<nil>]")
	stopRun()

	// A new leader, not yet hearing node-d (pending): it adopts node-d's
	// report as it is, without a write, and writes node-c's new drift.
	w2 := writes()
	next := newWriter(w2)
	runCtx2, stopRun2 := context.WithCancel(ctx)
	defer stopRun2()
	go next.Run(runCtx2)
	term2, endTerm2 := context.WithCancel(ctx)
	defer endTerm2()
	pending := map[string]audit.NodeState{"node-b": audit.NodeInSync, "node-c": audit.NodeStuck, "node-d": audit.NodePending}
	next.Offer(term2, verdict(pending, stale("node-c", "198.18.0.12:53")))
	waitHeld("map[proxyaudit-node-node-c:198.18.0.12:53 proxyaudit-node-node-d:<nil>]")
	if u, d := total(w2, "update"), total(w2, "delete"); u != 0 || d != 0 {
		t.Errorf("the new leader rewrote what it found: %d updates, %d deletes", u, d)
	}
	// Someone deletes node-c's report by hand: the next relist puts it back.
	if err := reports.Delete(ctx, openreports.Name("node-c"), metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for range 8 {
		time.Sleep(time.Second)
		next.Offer(term2, verdict(pending, stale("node-c", "198.18.0.12:53")))
	}
	waitHeld("map[proxyaudit-node-node-c:198.18.0.12:53 proxyaudit-node-node-d:<nil>]")
	// node-d is heard again, in sync: its report goes.
	pending["node-d"] = audit.NodeInSync
	next.Offer(term2, verdict(pending, stale("node-c", "198.18.0.12:53")))
	waitHeld("map[proxyaudit-node-node-c:198.18.0.12:53]")
	if n := total(w2, "create"); n != 2 {
		t.Errorf("the new leader created %d reports, want 2 (node-c, and again after it was deleted)", n)
	}
}

// Node names of up to 253 characters (FQDNs are common) each get their
// report on the real API server: the name cut with a hash where it would
// be too long, the label a hash where it is over 63, the node whole in an
// annotation and the scope. One report the API server refuses (here an
// admission policy's no) is skipped and counted, never the pass: one
// 71-character node name sorting first stopped every write (trust review
// 4, item 8: 0 reports after 3 passes).
func TestE2EOpenReportsLongNodeNames(t *testing.T) {
	c := localcluster.Shared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	installOpenReportsCRD(ctx, t, c)
	dc, err := dynamic.NewForConfig(c.RESTConfig)
	if err != nil {
		t.Fatal(err)
	}
	reports := dc.Resource(openreports.Resource)
	defer reports.DeleteCollection(context.Background(), metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
	// The API server refuses node-refused's report.
	policy := &admissionregistrationv1.ValidatingAdmissionPolicy{ObjectMeta: metav1.ObjectMeta{Name: "refuse-one-report"},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{Operations: []admissionregistrationv1.OperationType{"CREATE", "UPDATE"},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{"openreports.io"}, APIVersions: []string{"*"}, Resources: []string{"clusterreports"}}}}}},
			Validations: []admissionregistrationv1.Validation{{Expression: `object.metadata.name != "proxyaudit-node-node-refused"`, Message: "refused by the test"}}}}
	if _, err := c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(context.Background(), policy.Name, metav1.DeleteOptions{})
	binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: "refuse-one-report"},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: policy.Name, ValidationActions: []admissionregistrationv1.ValidationAction{"Deny"}}}
	if _, err := c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(context.Background(), binding.Name, metav1.DeleteOptions{})
	// The API server takes a new policy in after a moment: until a dry run
	// of node-refused's report is refused, the test would prove nothing
	// (in make test the writer once got there first).
	refusedReport := func() *unstructured.Unstructured {
		for _, r := range openreports.Build(&audit.Verdict{Nodes: []audit.NodeStatus{{Node: "node-refused", State: audit.NodeNoRules}},
			Findings: []audit.TimedFinding{{Since: time.Now(), Finding: audit.Finding{Node: "node-refused", Kind: audit.NoRules, Detail: "no rules"}}}}) {
			if r.Metadata.Name == openreports.Name("node-refused") {
				raw, err := json.Marshal(r)
				if err != nil {
					t.Fatal(err)
				}
				u := &unstructured.Unstructured{}
				if err := u.UnmarshalJSON(raw); err != nil {
					t.Fatal(err)
				}
				return u
			}
		}
		t.Fatal("no report for node-refused")
		return nil
	}()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		_, err := reports.Create(ctx, refusedReport, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil && strings.Contains(err.Error(), "refused by the test") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the admission policy was not in force after 30 s (a dry run: %v)", err)
		}
	}

	long71 := "a" + strings.Repeat("0123456789", 7)
	fqdn := strings.Repeat("ip-198-18-0-1.", 17) + "eu-west-1.compute.internal"
	fqdn = fqdn[len(fqdn)-253:]
	names := []string{long71, fqdn, "node-refused", "node-b", "node-c", "node-d", "node-e"}
	v := &audit.Verdict{}
	for _, n := range names {
		v.Nodes = append(v.Nodes, audit.NodeStatus{Node: n, State: audit.NodeNoRules})
		v.Findings = append(v.Findings, audit.TimedFinding{Since: time.Now().Add(-time.Minute), Finding: audit.Finding{Node: n, Kind: audit.NoRules, Detail: "no rules"}})
	}
	w := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "writes"}, []string{"verb", "outcome"})
	writer := openreports.NewWriter(openreports.WriterConfig{Client: dc, WritesPerSecond: 50, UpdateEvery: time.Second, Relist: time.Minute, Writes: w})
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go writer.Run(runCtx)
	writer.Offer(ctx, v)
	want := map[string]string{} // report name → node annotation
	for _, n := range names {
		if n != "node-refused" {
			want[openreports.Name(n)] = n
		}
	}
	var got map[string]string
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		l, err := reports.List(ctx, metav1.ListOptions{LabelSelector: openreports.LabelManagedBy + "=" + openreports.Source})
		if err != nil {
			t.Fatal(err)
		}
		got = map[string]string{}
		for _, it := range l.Items {
			got[it.GetName()] = it.GetAnnotations()[openreports.AnnotationNode]
			if lv := it.GetLabels()[openreports.LabelNode]; len(lv) > 63 {
				t.Fatalf("%s: label of %d characters", it.GetName(), len(lv))
			}
		}
		if fmt.Sprint(got) == fmt.Sprint(want) {
			break
		}
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("the API server holds %v, want %v", got, want)
	}
	if refused := testutil.ToFloat64(w.WithLabelValues("create", "error")); refused < 1 {
		t.Errorf("the refused report was not counted (%v)", refused)
	}
	for _, n := range []string{long71, fqdn} {
		t.Logf("node of %d characters: report %s, label %s", len(n), openreports.Name(n), openreports.NodeLabel(n))
	}
}
