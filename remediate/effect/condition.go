package effect

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/remediate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SetCondition writes the condition when it changed since the last write
// this executor made (or the node shows a different value).
func (e *Executor) SetCondition(ctx context.Context, node *corev1.Node, status corev1.ConditionStatus, reason, msg string) error {
	for _, c := range node.Status.Conditions {
		if c.Type == remediate.ConditionType && c.Status == status && c.Reason == reason {
			return nil
		}
	}
	now := metav1.NewTime(e.now())
	patch := map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{{
		Type: remediate.ConditionType, Status: status, Reason: reason, Message: nodeText(msg),
		LastHeartbeatTime: now, LastTransitionTime: now,
	}}}}
	body, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := e.Client.CoreV1().Nodes().PatchStatus(ctx, node.Name, body); err != nil {
		return fmt.Errorf("set %s on node %s: %w", remediate.ConditionType, node.Name, err)
	}
	return nil
}

// nodeText is a message for a Node condition or Event, which kubectl
// describe prints to a terminal: escapes shown, not obeyed, and at most
// 1000 bytes (the message may quote a node's text; the Node object is
// read by every kubelet and controller).
func nodeText(msg string) string { return safetext.Clip(safetext.Terminal(msg), 1000) }
