package audit

import corev1 "k8s.io/api/core/v1"

// Quiet is why a node's collector is not expected to report: the judge
// never calls such a node CollectorMissing (it still judges it while it
// reports), and remediation pages about a node that is Leaving but never
// acts on it. The zero value means the node is expected to report.
type Quiet string

// Reasons a node is not expected to report.
const (
	QuietDeleting   Quiet = "being deleted"
	QuietAutoscaler Quiet = "removed by the cluster autoscaler"
	// QuietNotReady: a broken node is the kubelet's finding; its
	// collector being down with it is not news.
	QuietNotReady Quiet = "not Ready"
)

// Leaving says the node is going away (deleted, or removed by the
// cluster autoscaler): nothing on it is worth repairing.
func (q Quiet) Leaving() bool { return q == QuietDeleting || q == QuietAutoscaler }

// ToBeDeletedTaint is the cluster autoscaler's mark on a node it removes.
const ToBeDeletedTaint = "ToBeDeletedByClusterAutoscaler"

// QuietOf says why n is not expected to report, or "". A node without a
// Ready condition at all is expected: nothing says it is broken.
func QuietOf(n *corev1.Node) Quiet {
	if n.DeletionTimestamp != nil {
		return QuietDeleting
	}
	for _, t := range n.Spec.Taints {
		if t.Key == ToBeDeletedTaint {
			return QuietAutoscaler
		}
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status != corev1.ConditionTrue {
			return QuietNotReady
		}
	}
	return ""
}
