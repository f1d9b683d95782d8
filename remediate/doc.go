// Package remediate decides repairs of drifted nodes: a pure planner that
// takes findings, each node's incident and the policy, and returns actions
// (restart kube-proxy, cordon, uncordon, page, resolve) as data. It reads
// no clock and changes nothing; package remediate/effect carries the
// actions out.
package remediate
