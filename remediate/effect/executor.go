package effect

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/remediate"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/clock"
)

// MirrorPodAnnotation marks the API's copy of a static pod.
const MirrorPodAnnotation = "kubernetes.io/config.mirror"

// Outcome is what became of an action, for metrics.
type Outcome string

// Outcomes.
const (
	Done     Outcome = "done"
	Simulate Outcome = "dry_run"
	Refused  Outcome = "refused"
	Failed   Outcome = "failed"
	// Fenced: not taken, as this replica no longer leads or the record
	// moved on under it.
	Fenced Outcome = "fenced"
)

// Executor is the only code that changes the cluster. It enforces dry-run
// and the fleet budget a second time, against the live incident record,
// acts only while its replica leads, and records every action as an
// Event on the Node, a log line and a metric, and the incident in the
// record (Incidents) before the change it describes.
type Executor struct {
	Client kubernetes.Interface
	Policy remediate.Policy
	// Incidents is where incidents are kept (outside dry-run).
	Incidents *Incidents
	// Lead says whether this replica leads, and its term (the Lease's
	// transitions when it began leading): asked before every action, and
	// every record write carries the term. Nil: always leading, term 0
	// (a single replica without election).
	Lead func() (term int64, ok bool)
	// ProxyNamespace and ProxySelector find kube-proxy's pods;
	// AgentNamespace and AgentSelector Cilium's agent pods, restarted on
	// nodes where Cilium replaces kube-proxy.
	ProxyNamespace, ProxySelector string
	AgentNamespace, AgentSelector string
	Notifier                      remediate.Notifier
	Log                           *zap.Logger
	// Observe counts an action's outcome (metrics); may be nil.
	Observe func(kind remediate.ActionKind, o Outcome)
	// Component names the Events' source.
	Component string
	// Journal is told every action as the Event says it, whatever the
	// notifiers (the status page's record of actions); may be nil.
	Journal remediate.Notifier
	// Flusher reaches the nodes' collectors to delete stale conntrack
	// entries (the aggregator); nil: flushes fail.
	Flusher Flusher
	// Clock dates Events, conditions and the incidents just written; nil
	// is the real clock.
	Clock clock.PassiveClock

	mu sync.Mutex
	// dry holds incidents in dry-run, where nothing is written.
	dry map[string]remediate.Incident
	// static and noPod remember what a restart attempt found on a node;
	// inspected when Inspect last looked.
	static, noPod map[string]bool
	inspected     map[string]time.Time
	// unrecorded holds incidents decided but not written (the record's
	// write failed), until a write succeeds: the planner must not decide
	// the same again every round (a failed record re-paged every second).
	unrecorded map[string]remediate.Incident
	// planned is each node's record as read this round: an action whose
	// record changed meanwhile is not carried out.
	planned map[string]remediate.Incident
}

func (e *Executor) now() time.Time {
	if e.Clock == nil {
		return time.Now()
	}
	return e.Clock.Now()
}

func (e *Executor) init() {
	if e.dry == nil {
		e.dry, e.static, e.noPod, e.inspected = map[string]remediate.Incident{}, map[string]bool{}, map[string]bool{}, map[string]time.Time{}
		e.unrecorded, e.planned = map[string]remediate.Incident{}, map[string]remediate.Incident{}
	}
}

func (e *Executor) lead() (int64, bool) {
	if e.Lead == nil {
		return 0, true
	}
	return e.Lead()
}

// ErrNotLeading: the replica lost the lease; nothing is done or said.
var ErrNotLeading = errors.New("not leading: this replica no longer acts")

// Load reads the incident record at the start of a round (a no-op in
// dry-run).
func (e *Executor) Load(ctx context.Context) error {
	e.mu.Lock()
	e.init()
	clear(e.planned)
	e.mu.Unlock()
	if e.Policy.Mode == remediate.DryRun {
		return nil
	}
	if e.Incidents == nil {
		return errors.New("no incident record configured")
	}
	return e.Incidents.Load(ctx)
}

// Incident returns the node's incident: from the record, or from memory
// in dry-run. The record as read is the base this round's actions on the
// node are checked against.
func (e *Executor) Incident(node string) remediate.Incident {
	return e.incident(node, true)
}

// Peek returns the node's incident as Incident does, for people (the
// status page): without noting it as the base of this round's plan.
func (e *Executor) Peek(node string) remediate.Incident {
	return e.incident(node, false)
}

func (e *Executor) incident(node string, planning bool) remediate.Incident {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.init()
	if e.Policy.Mode == remediate.DryRun {
		return e.dry[node]
	}
	var stored remediate.Incident
	if e.Incidents != nil {
		stored = e.Incidents.Get(node, e.now())
	}
	if planning {
		// The write is checked against the record as read, even when the
		// planner is shown an incident whose write failed.
		e.planned[node] = stored
	}
	if u, ok := e.unrecorded[node]; ok {
		return u
	}
	return stored
}

// Prune drops from the record the nodes that left the cluster and the
// ones left with nothing to remember (no incident, no restart or flush
// within the budget or breaker window), so the record follows the fleet's size.
func (e *Executor) Prune(ctx context.Context, exists func(node string) bool) error {
	if e.Policy.Mode == remediate.DryRun || e.Incidents == nil {
		return nil
	}
	term, ok := e.lead()
	if !ok {
		return ErrNotLeading
	}
	now := e.now()
	keep := max(e.Policy.BudgetWindow, e.Policy.BreakerWindow)
	return e.Incidents.Update(ctx, term, now, func(all map[string]remediate.Incident) (map[string]remediate.Incident, error) {
		drop := map[string]remediate.Incident{}
		for n, inc := range all {
			recent := func(t time.Time) bool { return now.Sub(t) < keep }
			live := inc.Stage != "" || !inc.Cordoned.IsZero() || slices.ContainsFunc(inc.Restarts, recent) || slices.ContainsFunc(inc.Flushes, recent) || inc.FlushHeld != ""
			if !exists(n) || !live {
				drop[n] = remediate.Incident{}
			}
		}
		return drop, nil
	})
}

// Forget drops what the executor remembers of a node that left the
// cluster, and tells the notifier (an open Slack thread is closed): node
// churn must not grow its memory. Its record goes with the next Prune.
func (e *Executor) Forget(node string) {
	e.mu.Lock()
	e.init()
	delete(e.dry, node)
	delete(e.static, node)
	delete(e.noPod, node)
	delete(e.inspected, node)
	delete(e.unrecorded, node)
	delete(e.planned, node)
	e.mu.Unlock()
	if f, ok := e.Notifier.(Forgetter); ok {
		f.Forget(node)
	}
}

// Forgetter is a notifier that keeps per-node state (Slack's threads).
type Forgetter interface {
	Forget(node string)
}

// Fanout tells every notifier (Slack, Alertmanager) in turn; none may
// block.
type Fanout []remediate.Notifier

// Notify tells each.
func (f Fanout) Notify(n remediate.Notice) {
	for _, x := range f {
		x.Notify(n)
	}
}

// Forget forgets in each that keeps per-node state.
func (f Fanout) Forget(node string) {
	for _, x := range f {
		if g, ok := x.(Forgetter); ok {
			g.Forget(node)
		}
	}
}

// Remembered counts the nodes the executor holds anything of in memory
// beyond the current round: it must follow the cluster's size, not the
// number of nodes it ever saw.
func (e *Executor) Remembered() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	seen := map[string]bool{}
	for _, m := range []map[string]remediate.Incident{e.dry, e.unrecorded} {
		for n := range m {
			seen[n] = true
		}
	}
	for _, m := range []map[string]bool{e.static, e.noPod} {
		for n := range m {
			seen[n] = true
		}
	}
	return len(seen)
}

// Inspect looks up the node's kube-proxy pod and records what it found,
// for a node the planner is about to decide on: the page's advice depends
// on it (a static kube-proxy cannot be restarted through the API, and that
// is what its page must say even while the breaker or the budget holds
// restarts back). A failed lookup keeps what was learned before. A node
// looked at within inspectFresh is not looked at again: rounds run every
// second, and fifty drifting nodes were fifty pod lists a second on the
// client the watch barrier and the incident record share. A restart
// looks the pod up again before it deletes anything.
func (e *Executor) Inspect(ctx context.Context, node string, d remediate.Dataplane) (static, noPod bool) {
	e.mu.Lock()
	e.init()
	at, ok := e.inspected[node]
	if age := e.now().Sub(at); ok && age >= 0 && age < inspectFresh {
		static, noPod = e.static[node], e.noPod[node]
		e.mu.Unlock()
		return static, noPod
	}
	e.mu.Unlock()
	pod, mirror, err := e.proxyPod(ctx, node, d)
	e.mu.Lock()
	defer e.mu.Unlock()
	if err != nil {
		e.Log.Warn("cannot look up the pod to restart", zap.String("node", node), zap.Error(err))
	} else {
		e.static[node], e.noPod[node], e.inspected[node] = mirror, pod == nil, e.now()
	}
	return e.static[node], e.noPod[node]
}

// inspectFresh is how long what Inspect found is used without looking
// again.
const inspectFresh = 10 * time.Second

// Learned says what lookups found last: a static kube-proxy, or none.
func (e *Executor) Learned(node string) (static, noPod bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.init()
	return e.static[node], e.noPod[node]
}

// Execute carries out the planner's actions in order. One failing action
// does not stop the others; the errors are returned joined. Once the
// replica no longer leads (or is fenced), nothing more is done.
func (e *Executor) Execute(ctx context.Context, actions []remediate.Action, notices map[string]remediate.Notice) error {
	e.mu.Lock()
	e.init()
	e.mu.Unlock()
	var errs []error
	for _, a := range actions {
		n := notices[a.Node]
		n.Action = a
		if err := e.execute(ctx, &n); err != nil {
			errs = append(errs, fmt.Errorf("%s %s: %w", a.Kind, a.Node, err))
			if errors.Is(err, ErrNotLeading) || errors.Is(err, ErrFenced) {
				break
			}
		}
	}
	return errors.Join(errs...)
}

func (e *Executor) execute(ctx context.Context, n *remediate.Notice) error {
	a := &n.Action
	log := e.Log.With(zap.String("node", a.Node), zap.String("action", string(a.Kind)))
	dry := e.Policy.Mode == remediate.DryRun || a.DryRun
	a.DryRun = dry
	term, leading := e.lead()
	if !leading || ctx.Err() != nil {
		e.observe(a.Kind, Fenced)
		return ErrNotLeading
	}
	// One read of the Node serves the action (its spec) and its Event
	// (the UID kubectl describe matches on).
	node, err := e.Client.CoreV1().Nodes().Get(ctx, a.Node, metav1.GetOptions{})
	outcome := Failed
	if err != nil {
		err = fmt.Errorf("read node: %w", err)
		node = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: a.Node}}
	} else {
		outcome, err = e.apply(ctx, term, n, node, dry)
	}
	e.observe(a.Kind, outcome)
	switch {
	case outcome == Fenced:
		// Another replica leads or the record moved on: it decides now.
		log.Warn("remediation action not taken", zap.Error(err))
		return err
	case err != nil:
		log.Error("remediation action failed", zap.Error(err), zap.String("reason", a.Reason))
		e.event(ctx, node, corev1.EventTypeWarning, "ProxyauditActionFailed", fmt.Sprintf("%s failed: %v (%s)", a.Kind, err, a.Reason))
		a.Reason += fmt.Sprintf(" — %s FAILED: %v", a.Kind, err)
	case outcome == Refused:
		log.Warn("remediation action refused by the executor", zap.String("reason", a.Reason))
		e.event(ctx, node, corev1.EventTypeWarning, "ProxyauditActionRefused", a.Reason)
	case dry && a.Kind != remediate.Page && a.Kind != remediate.Resolve:
		log.Info("dry-run: would act", zap.String("reason", a.Reason))
		e.event(ctx, node, corev1.EventTypeNormal, "ProxyauditDryRun", "would "+string(a.Kind)+": "+a.Reason)
	default:
		log.Info("remediation action", zap.String("reason", a.Reason), zap.Bool("dry_run", dry))
		typ := corev1.EventTypeWarning
		if a.Kind == remediate.Resolve || a.Kind == remediate.Uncordon {
			typ = corev1.EventTypeNormal
		}
		e.event(ctx, node, typ, "Proxyaudit"+string(a.Kind), a.Reason)
	}
	if e.Notifier != nil {
		e.Notifier.Notify(*n)
	}
	if e.Journal != nil {
		e.Journal.Notify(*n)
	}
	return err
}

func (e *Executor) observe(k remediate.ActionKind, o Outcome) {
	if e.Observe != nil {
		e.Observe(k, o)
	}
}

// Flusher has a node's collector delete the conntrack entries of pairs.
type Flusher interface {
	Flush(ctx context.Context, node string, pairs []remediate.StalePair) ([]remediate.FlushResult, error)
}

// errMoved: the node's record changed since the round was planned (another
// writer): the action is left for the next round, planned afresh.
var errMoved = errors.New("the node's incident record changed since this round was planned; re-planning")

// apply makes the change (or, in dry-run, records what it would be).
func (e *Executor) apply(ctx context.Context, term int64, n *remediate.Notice, node *corev1.Node, dry bool) (Outcome, error) {
	a := &n.Action
	if dry {
		e.mu.Lock()
		if a.Incident.Empty() {
			delete(e.dry, a.Node)
		} else {
			e.dry[a.Node] = a.Incident
		}
		e.mu.Unlock()
		if a.Kind == remediate.Page || a.Kind == remediate.Resolve {
			return Done, nil
		}
		return Simulate, nil
	}
	e.mu.Lock()
	base := e.planned[a.Node]
	e.mu.Unlock()
	switch a.Kind {
	case remediate.RestartProxy:
		pod, static, err := e.proxyPod(ctx, a.Node, a.Dataplane)
		if err != nil {
			return Failed, err
		}
		if pod == nil || static {
			e.mu.Lock()
			e.static[a.Node], e.noPod[a.Node], e.inspected[a.Node] = static, pod == nil, e.now()
			e.mu.Unlock()
			a.Kind = remediate.Page
			if static {
				a.Reason += "; not restarted (mirror pod " + pod.Name + "): " + remediate.StaticProxyAdvice
			} else {
				ns, sel := e.podsOf(a.Dataplane)
				a.Reason += fmt.Sprintf("; not restarted: no pod matching %s in %s on this node", sel, ns)
			}
			a.Incident.Stage = remediate.StageOpen
			a.Incident.Restarts = a.Incident.Restarts[:len(a.Incident.Restarts)-1]
			return e.recordRefused(ctx, term, a, base)
		}
		// Record first: a leader that dies after the delete must not
		// restart again on taking over. A restart that then does not
		// happen is taken back (open, without it): the next round tries
		// again instead of judging, and escalating on, a restart that
		// never was.
		undo := a.Incident
		undo.Stage = remediate.StageOpen
		undo.Restarts = slices.Clone(a.Incident.Restarts[:max(len(a.Incident.Restarts)-1, 0)])
		if out, err := e.record(ctx, term, a, base, true); err != nil || out != Done {
			if out == Failed {
				e.mu.Lock()
				e.unrecorded[a.Node] = undo
				e.mu.Unlock()
				a.Incident = undo
			}
			return out, err
		}
		uid := pod.UID
		err = e.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
		if err != nil && !apierrors.IsNotFound(err) {
			err = fmt.Errorf("delete kube-proxy pod %s/%s: %w", pod.Namespace, pod.Name, err)
			recorded := a.Incident
			a.Incident = undo
			_, uerr := e.record(ctx, term, a, recorded, false)
			return Failed, errors.Join(err, uerr)
		}
		a.Reason += fmt.Sprintf(" (deleted pod %s/%s)", pod.Namespace, pod.Name)
		return Done, nil
	case remediate.Cordon:
		if node.Spec.Unschedulable {
			a.Incident.Cordoned = time.Time{} // someone else's cordon: never ours to undo
			a.Kind, a.Reason = remediate.Page, a.Reason+"; already cordoned by someone else"
			return e.recordRefused(ctx, term, a, base)
		}
		if out, err := e.record(ctx, term, a, base, true); err != nil || out != Done {
			return out, err
		}
		if err := e.patchNode(ctx, node.Name, map[string]any{"unschedulable": true}, a.Incident.Cordoned); err != nil {
			// Not cordoned: back to the record before, so the next round
			// decides the cordon again.
			recorded := a.Incident
			a.Incident = base
			_, uerr := e.record(ctx, term, a, recorded, false)
			return Failed, errors.Join(err, uerr)
		}
		return Done, nil
	case remediate.Uncordon:
		_, marked := node.Annotations[remediate.AnnotationCordoned]
		switch {
		case !node.Spec.Unschedulable:
			a.Kind, a.Reason = remediate.Resolve, a.Reason+"; someone else uncordoned the node already"
		case !marked:
			a.Kind, a.Reason = remediate.Resolve, a.Reason+"; left cordoned: the node's "+remediate.AnnotationCordoned+" marker is gone (someone changed the node), so the cordon may no longer be proxyaudit's; uncordon by hand if it should go"
		default:
			if err := e.patchNode(ctx, node.Name, map[string]any{"unschedulable": nil}, time.Time{}); err != nil {
				return Failed, err
			}
			return e.record(ctx, term, a, base, false)
		}
		return e.recordRefused(ctx, term, a, base)
	case remediate.FlushConntrack:
		if e.Flusher == nil {
			return Failed, errors.New("no way to reach the nodes' collectors")
		}
		// Recorded first, like a restart: a leader that dies after the
		// flush must not flush again at once on taking over (the flush
		// counts against the node's budget even when it then fails).
		if out, err := e.record(ctx, term, a, base, true); err != nil || out != Done {
			return out, err
		}
		results, err := e.Flusher.Flush(ctx, a.Node, a.Flush)
		deleted, refused := 0, 0
		var said []string
		for i, r := range results {
			deleted += r.Deleted
			if r.Refused != "" {
				refused++
				said = append(said, fmt.Sprintf("%s → %s refused by the collector: %s", a.Flush[i].Frontend, a.Flush[i].Dest, r.Refused))
			}
		}
		switch {
		case results == nil:
		case deleted == 1:
			a.Reason += " (deleted 1 entry)"
		default:
			a.Reason += fmt.Sprintf(" (deleted %d entries)", deleted)
		}
		for _, s := range said {
			a.Reason += "; " + s
		}
		switch {
		case err != nil:
			return Failed, fmt.Errorf("flush on the node: %w", err)
		case refused == len(a.Flush):
			return Refused, nil
		}
		return Done, nil
	default: // Page, Resolve
		return e.record(ctx, term, a, base, false)
	}
}

// record writes the action's incident, in one compare-and-swap with a
// check that the node's record is still base (what the round was planned
// on) and, with budget, that the fleet budget allows one more node in
// remediation, counted from the record itself: two replicas that both
// believe they lead cannot both spend the last slot. Over budget, the
// action becomes a page (Refused) and the incident stays open.
func (e *Executor) record(ctx context.Context, term int64, a *remediate.Action, base remediate.Incident, budget bool) (Outcome, error) {
	var nodes map[string]bool
	if budget {
		list, err := e.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err != nil {
			// Cannot count the fleet: refuse, as a page.
			a.Kind, a.Reason = remediate.Page, a.Reason+"; the executor refused: cannot list nodes to check the budget: "+err.Error()
			a.Incident = refused(base, a.Incident)
			return e.recordRefused(ctx, term, a, base)
		}
		nodes = make(map[string]bool, len(list.Items))
		for _, n := range list.Items {
			nodes[n.Name] = true
		}
	}
	why := ""
	err := e.Incidents.Update(ctx, term, e.now(), func(all map[string]remediate.Incident) (map[string]remediate.Incident, error) {
		if all[a.Node].Encode() != base.Encode() {
			return nil, errMoved
		}
		why = ""
		if budget {
			busy := 0
			for n, inc := range all {
				if n != a.Node && nodes[n] && (inc.Stage == remediate.StageRestarted || !inc.Cordoned.IsZero()) {
					busy++
				}
			}
			limit := e.Policy.Limit(len(nodes))
			if busy >= limit {
				why = fmt.Sprintf("%d other node(s) already in remediation, limit %d", busy, limit)
				return map[string]remediate.Incident{a.Node: refused(base, a.Incident)}, nil
			}
		}
		return map[string]remediate.Incident{a.Node: a.Incident}, nil
	})
	return e.recorded(a, err, why, base)
}

// recordRefused writes a refused action's incident (no budget check).
func (e *Executor) recordRefused(ctx context.Context, term int64, a *remediate.Action, base remediate.Incident) (Outcome, error) {
	if out, err := e.record(ctx, term, a, base, false); err != nil || out != Done {
		return out, err
	}
	return Refused, nil
}

// recorded turns a record write's result into the action's outcome.
func (e *Executor) recorded(a *remediate.Action, err error, refusedWhy string, base remediate.Incident) (Outcome, error) {
	switch {
	case errors.Is(err, ErrFenced) || errors.Is(err, errMoved):
		return Fenced, err
	case err != nil:
		// Remembered, so that the planner does not decide it again each
		// round (a cordon's record is taken back by the caller instead).
		e.mu.Lock()
		e.unrecorded[a.Node] = a.Incident
		e.mu.Unlock()
		return Failed, fmt.Errorf("record the incident: %w", err)
	}
	e.mu.Lock()
	delete(e.unrecorded, a.Node)
	e.mu.Unlock()
	if refusedWhy != "" {
		a.Kind, a.Reason = remediate.Page, a.Reason+"; the executor refused: "+refusedWhy
		a.Incident = refused(base, a.Incident)
		return Refused, nil
	}
	return Done, nil
}

// refused is the incident after a restart or cordon the budget refused:
// open (or escalated, for a cordon) with the restarts and cordon it had.
func refused(base, planned remediate.Incident) remediate.Incident {
	inc := planned
	inc.Restarts, inc.Cordoned = base.Restarts, base.Cordoned
	if planned.Stage == remediate.StageRestarted {
		inc.Stage = remediate.StageOpen
	}
	return inc
}

// podsOf is the namespace and selector of the pods programming d.
func (e *Executor) podsOf(d remediate.Dataplane) (string, string) {
	if d == remediate.DataplaneCilium {
		return e.AgentNamespace, e.AgentSelector
	}
	return e.ProxyNamespace, e.ProxySelector
}

// proxyPod finds the node's kube-proxy pod (Cilium's agent pod, for d
// Cilium) and whether it is a mirror pod.
func (e *Executor) proxyPod(ctx context.Context, node string, d remediate.Dataplane) (*corev1.Pod, bool, error) {
	ns, sel := e.podsOf(d)
	if d == remediate.DataplaneCilium && sel == "" {
		// An empty selector would match every pod on the node.
		return nil, false, fmt.Errorf("find the Cilium agent pod: no agent selector configured (--cilium-selector)")
	}
	pods, err := e.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{
		LabelSelector: sel, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return nil, false, fmt.Errorf("find %s pod: %w", d.Agent(), err)
	}
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp != nil || p.Spec.NodeName != node {
			continue // going, or (whatever the API answered) another node's
		}
		_, mirror := p.Annotations[MirrorPodAnnotation]
		return p, mirror, nil
	}
	return nil, false, nil
}

// patchNode cordons or uncordons the node, setting (or, with a zero time,
// removing) the cordoned-at marker the admission policy checks, and
// removing the annotations older versions kept the incident in.
func (e *Executor) patchNode(ctx context.Context, name string, spec map[string]any, cordoned time.Time) error {
	ann := map[string]any{remediate.AnnotationCordoned: nil}
	if !cordoned.IsZero() {
		ann[remediate.AnnotationCordoned] = cordoned.UTC().Format(time.RFC3339)
	}
	for _, k := range remediate.LegacyAnnotations {
		ann[k] = nil
	}
	body, err := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": ann}, "spec": spec})
	if err != nil {
		return err
	}
	if _, err := e.Client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("patch the node: %w", err)
	}
	return nil
}

// event records an Event on the Node (its UID in the reference, which
// kubectl describe node matches on); failures are logged, not fatal.
func (e *Executor) event(ctx context.Context, node *corev1.Node, typ, reason, msg string) {
	now := metav1.NewTime(e.now())
	msg = nodeText(msg)
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: node.Name + ".proxyaudit.", Namespace: metav1.NamespaceDefault},
		InvolvedObject: corev1.ObjectReference{Kind: "Node", Name: node.Name, UID: node.UID, APIVersion: "v1"},
		Reason:         reason, Message: msg, Type: typ,
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		Source:              corev1.EventSource{Component: e.Component},
		ReportingController: "proxyaudit.io/aggregator", ReportingInstance: e.Component,
	}
	if _, err := e.Client.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		e.Log.Warn("cannot record an Event on the node", zap.String("node", node.Name), zap.Error(err))
	}
}
