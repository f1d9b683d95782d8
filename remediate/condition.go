package remediate

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

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
