package effect

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
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
)

// Executor is the only code that changes the cluster. It enforces dry-run
// and the fleet budget a second time, against the live Node objects, and
// records every action as an Event on the Node, a log line and a metric,
// and the incident in the Node's annotations.
type Executor struct {
	Client kubernetes.Interface
	Policy remediate.Policy
	// ProxyNamespace and ProxySelector find kube-proxy's pods.
	ProxyNamespace, ProxySelector string
	Notifier                      remediate.Notifier
	Log                           *zap.Logger
	// Observe counts an action's outcome (metrics); may be nil.
	Observe func(kind remediate.ActionKind, o Outcome)
	// Component names the Events' source.
	Component string
	// Clock dates Events, conditions and the incidents just written; nil
	// is the real clock.
	Clock clock.PassiveClock

	mu sync.Mutex
	// dry holds incidents in dry-run, where annotations are not written.
	dry map[string]remediate.Incident
	// static and noPod remember what a restart attempt found on a node.
	static, noPod map[string]bool
	// written holds incidents just written, until the caller's (informer)
	// view of the Node has caught up: the next round must not repeat an
	// action because its copy of the annotations is a moment old.
	written map[string]writtenIncident
	// unrecorded holds incidents decided but not written (the Node patch
	// failed), until a write succeeds: the planner must not decide the
	// same again every round (a failed record re-paged every second).
	unrecorded map[string]remediate.Incident
}

type writtenIncident struct {
	inc remediate.Incident
	at  time.Time
}

func (e *Executor) now() time.Time {
	if e.Clock == nil {
		return time.Now()
	}
	return e.Clock.Now()
}

// writtenTTL is how long a written incident overrides the caller's view.
const writtenTTL = 30 * time.Second

func (e *Executor) init() {
	if e.dry == nil {
		e.dry, e.static, e.noPod, e.written = map[string]remediate.Incident{}, map[string]bool{}, map[string]bool{}, map[string]writtenIncident{}
		e.unrecorded = map[string]remediate.Incident{}
	}
}

// Incident returns the node's incident: from its annotations, or from
// memory in dry-run.
func (e *Executor) Incident(n *corev1.Node) remediate.Incident {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.init()
	if e.Policy.Mode == remediate.DryRun {
		return e.dry[n.Name]
	}
	if u, ok := e.unrecorded[n.Name]; ok {
		return u
	}
	if w, ok := e.written[n.Name]; ok && e.now().Sub(w.at) < writtenTTL {
		return w.inc
	}
	return remediate.IncidentFromAnnotations(n.Annotations)
}

// Forget drops what the executor remembers of a node that left the
// cluster, and tells the notifier (an open Slack thread is closed): node
// churn must not grow its memory.
func (e *Executor) Forget(node string) {
	e.mu.Lock()
	e.init()
	delete(e.dry, node)
	delete(e.static, node)
	delete(e.noPod, node)
	delete(e.written, node)
	delete(e.unrecorded, node)
	e.mu.Unlock()
	if f, ok := e.Notifier.(Forgetter); ok {
		f.Forget(node)
	}
}

// Forgetter is a notifier that keeps per-node state (Slack's threads).
type Forgetter interface {
	Forget(node string)
}

// Remembered counts the nodes the executor holds anything of: it must
// follow the cluster's size, not the number of nodes it ever saw.
func (e *Executor) Remembered() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	seen := map[string]bool{}
	for n := range e.dry {
		seen[n] = true
	}
	for n := range e.static {
		seen[n] = true
	}
	for n := range e.noPod {
		seen[n] = true
	}
	for n := range e.written {
		seen[n] = true
	}
	for n := range e.unrecorded {
		seen[n] = true
	}
	return len(seen)
}

// Learned says what restart attempts found: a static kube-proxy, or none.
func (e *Executor) Learned(node string) (static, noPod bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.init()
	return e.static[node], e.noPod[node]
}

// Execute carries out the planner's actions in order. One failing action
// does not stop the others; the errors are returned joined.
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
		}
	}
	return errors.Join(errs...)
}

func (e *Executor) execute(ctx context.Context, n *remediate.Notice) error {
	a := &n.Action
	log := e.Log.With(zap.String("node", a.Node), zap.String("action", string(a.Kind)))
	dry := e.Policy.Mode == remediate.DryRun || a.DryRun
	a.DryRun = dry
	// One read of the Node serves the action (live annotations and spec)
	// and its Event (the UID kubectl describe matches on).
	node, err := e.Client.CoreV1().Nodes().Get(ctx, a.Node, metav1.GetOptions{})
	outcome := Failed
	if err != nil {
		err = fmt.Errorf("read node: %w", err)
		node = &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: a.Node}}
	} else {
		outcome, err = e.apply(ctx, n, node, dry)
	}
	if e.Observe != nil {
		e.Observe(a.Kind, outcome)
	}
	switch {
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
	return err
}

// apply makes the change (or, in dry-run, records what it would be).
func (e *Executor) apply(ctx context.Context, n *remediate.Notice, node *corev1.Node, dry bool) (Outcome, error) {
	a := &n.Action
	if dry {
		e.mu.Lock()
		if a.Incident.Stage == "" && a.Incident.Cordoned.IsZero() && len(a.Incident.Restarts) == 0 {
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
	switch a.Kind {
	case remediate.RestartProxy, remediate.Cordon:
		if why := e.overBudget(ctx, a.Node); why != "" {
			a.Kind, a.Reason = remediate.Page, a.Reason+"; the executor refused: "+why
			a.Incident.Restarts = remediate.IncidentFromAnnotations(node.Annotations).Restarts
			a.Incident.Cordoned = time.Time{}
			return Refused, e.annotate(ctx, node, a.Incident, nil)
		}
	}
	switch a.Kind {
	case remediate.RestartProxy:
		pod, static, err := e.proxyPod(ctx, a.Node)
		if err != nil {
			return Failed, err
		}
		if pod == nil || static {
			e.mu.Lock()
			e.static[a.Node], e.noPod[a.Node] = static, pod == nil
			e.mu.Unlock()
			a.Kind = remediate.Page
			if static {
				a.Reason += "; not restarted (mirror pod " + pod.Name + "): " + remediate.StaticProxyAdvice
			} else {
				a.Reason += fmt.Sprintf("; not restarted: no pod matching %s in %s on this node", e.ProxySelector, e.ProxyNamespace)
			}
			a.Incident.Stage = remediate.StageOpen
			a.Incident.Restarts = a.Incident.Restarts[:len(a.Incident.Restarts)-1]
			return Refused, e.annotate(ctx, node, a.Incident, nil)
		}
		// Record first: a leader that dies after the delete must not
		// restart again on taking over. A restart that then does not
		// happen is taken back (open, without it): the next round tries
		// again instead of judging, and escalating on, a restart that
		// never was.
		undo := a.Incident
		undo.Stage = remediate.StageOpen
		undo.Restarts = slices.Clone(a.Incident.Restarts[:max(len(a.Incident.Restarts)-1, 0)])
		if err := e.annotate(ctx, node, a.Incident, nil); err != nil {
			e.mu.Lock()
			e.unrecorded[a.Node] = undo
			e.mu.Unlock()
			a.Incident = undo
			return Failed, err
		}
		uid := pod.UID
		err = e.Client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
		if err != nil && !apierrors.IsNotFound(err) {
			err = fmt.Errorf("delete kube-proxy pod %s/%s: %w", pod.Namespace, pod.Name, err)
			a.Incident = undo
			return Failed, errors.Join(err, e.annotate(ctx, node, undo, nil))
		}
		a.Reason += fmt.Sprintf(" (deleted pod %s/%s)", pod.Namespace, pod.Name)
		return Done, nil
	case remediate.Cordon:
		if node.Spec.Unschedulable {
			a.Incident.Cordoned = time.Time{} // someone else's cordon: never ours to undo
			a.Kind, a.Reason = remediate.Page, a.Reason+"; already cordoned by someone else"
			return Refused, e.annotate(ctx, node, a.Incident, nil)
		}
		return Done, e.annotate(ctx, node, a.Incident, map[string]any{"unschedulable": true})
	case remediate.Uncordon:
		if _, ours := node.Annotations[remediate.AnnotationCordoned]; !ours {
			a.Kind = remediate.Resolve
			return Refused, e.annotate(ctx, node, a.Incident, nil)
		}
		return Done, e.annotate(ctx, node, a.Incident, map[string]any{"unschedulable": nil})
	default: // Page, Resolve
		return Done, e.annotate(ctx, node, a.Incident, nil)
	}
}

// overBudget re-counts, from the live Nodes, the nodes in remediation.
func (e *Executor) overBudget(ctx context.Context, self string) string {
	nodes, err := e.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		return "cannot list nodes to check the budget: " + err.Error()
	}
	busy := 0
	for _, n := range nodes.Items {
		inc := remediate.IncidentFromAnnotations(n.Annotations)
		if n.Name != self && (inc.Stage == remediate.StageRestarted || !inc.Cordoned.IsZero()) {
			busy++
		}
	}
	limit := min(e.Policy.MaxConcurrent, int(math.Floor(e.Policy.MaxShare*float64(len(nodes.Items)))))
	if busy >= limit {
		return fmt.Sprintf("%d other node(s) already in remediation, limit %d", busy, limit)
	}
	return ""
}

// proxyPod finds the node's kube-proxy pod and whether it is a mirror pod.
func (e *Executor) proxyPod(ctx context.Context, node string) (*corev1.Pod, bool, error) {
	pods, err := e.Client.CoreV1().Pods(e.ProxyNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: e.ProxySelector, FieldSelector: "spec.nodeName=" + node})
	if err != nil {
		return nil, false, fmt.Errorf("find kube-proxy pod: %w", err)
	}
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp != nil {
			continue
		}
		_, mirror := p.Annotations[MirrorPodAnnotation]
		return p, mirror, nil
	}
	return nil, false, nil
}

// annotate writes the incident (and any spec change) in one merge patch.
func (e *Executor) annotate(ctx context.Context, node *corev1.Node, inc remediate.Incident, spec map[string]any) error {
	patch := map[string]any{"metadata": map[string]any{"annotations": inc.Annotations()}}
	if spec != nil {
		patch["spec"] = spec
	}
	body, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := e.Client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, body, metav1.PatchOptions{}); err != nil {
		// Remembered, so that the planner does not decide it again each
		// round; a cordon or uncordon failed with it is retried instead.
		if spec == nil {
			e.mu.Lock()
			e.unrecorded[node.Name] = inc
			e.mu.Unlock()
		}
		return fmt.Errorf("record the incident on the node: %w", err)
	}
	e.mu.Lock()
	e.written[node.Name] = writtenIncident{inc: inc, at: e.now()}
	delete(e.unrecorded, node.Name)
	e.mu.Unlock()
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
