// Package remediate decides (pure planner) and carries out (one executor)
// repairs of drifted nodes: restart kube-proxy, cordon, page.
package remediate
