// Package effect carries out the remediation planner's actions: the
// Executor is the only code that changes the cluster (deletes a kube-proxy
// pod, cordons, writes the incident and the node condition, records
// Events), and Slack tells people. Dry-run, the live budget check and the
// audit trail live here and nowhere else.
package effect
