package remediate

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ConditionType is the Node condition proxyaudit keeps, for consumers of
// node-problem-detector-style conditions (draino, medik8s NHC).
const ConditionType corev1.NodeConditionType = "KubeProxyRulesStale"

// Condition is the condition's value for a node's state; ok is false for
// states that should leave it as it is (lagging within grace, pending).
func Condition(st audit.NodeStatus, headline string) (status corev1.ConditionStatus, reason, msg string, ok bool) {
	switch st.State {
	case audit.NodeInSync:
		return corev1.ConditionFalse, "RulesInSync", fmt.Sprintf("kube-proxy's rules match the cluster for all %d services", st.Services), true
	case audit.NodeStuck, audit.NodeDivergent, audit.NodeNoRules:
		return corev1.ConditionTrue, string(st.State), headline, true
	case audit.NodeMissing:
		return corev1.ConditionUnknown, "CollectorMissing", "proxyaudit's collector on this node is not reporting; the rules are unknown", true
	}
	return "", "", "", false
}

// SetCondition writes the condition when it changed since the last write
// this executor made (or the node shows a different value).
func (e *Executor) SetCondition(ctx context.Context, node *corev1.Node, status corev1.ConditionStatus, reason, msg string) error {
	for _, c := range node.Status.Conditions {
		if c.Type == ConditionType && c.Status == status && c.Reason == reason {
			return nil
		}
	}
	now := metav1.NewTime(time.Now())
	patch := map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{{
		Type: ConditionType, Status: status, Reason: reason, Message: msg,
		LastHeartbeatTime: now, LastTransitionTime: now,
	}}}}
	body, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := e.Client.CoreV1().Nodes().PatchStatus(ctx, node.Name, body); err != nil {
		return fmt.Errorf("set %s on node %s: %w", ConditionType, node.Name, err)
	}
	return nil
}
