// Package api is the aggregator's HTTP API as it travels: the JSON bodies
// of /api/v1 and the names of the reader token's header and audience. The
// CLI imports it alone, without the aggregator's informers, leader
// election or metrics.
package api

import (
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// TokenHeader carries the reader token through the API server's service
// proxy, which strips Authorization (kubernetes#38775).
const TokenHeader = "X-Proxyaudit-Token"

// DefaultReaderAudience is the audience reader tokens are minted for.
const DefaultReaderAudience = "proxyaudit-api"

// FindingsResponse is GET /api/v1/findings: the audit's finding contract
// with since per finding, and the summary `proxyaudit diff` prints.
type FindingsResponse struct {
	At    time.Time  `json:"at"`
	Stale *StaleView `json:"stale,omitempty"`
	// RecoveringUntil: node drift is held back until then, after the
	// aggregator's view came back from an API outage.
	RecoveringUntil *time.Time `json:"recoveringUntil,omitempty"`
	Leader          string     `json:"leader"`
	Grace           string     `json:"grace"`
	// RemediationHold says why every repair is held (pages only): a
	// pause (who, since, why) or being outside the maintenance windows.
	RemediationHold string               `json:"remediationHold,omitempty"`
	Findings        []audit.TimedFinding `json:"findings"`
	Summary         audit.Summary        `json:"summary"`
}

// StaleView is set while the leader's view of the API is stale: the
// findings and node states are the last ones judged before Since, not
// current, and nothing is repaired.
type StaleView struct {
	Since  time.Time `json:"since"`
	Reason string    `json:"reason"`
}

// NodesResponse is GET /api/v1/nodes.
type NodesResponse struct {
	At    time.Time          `json:"at"`
	Stale *StaleView         `json:"stale,omitempty"`
	Nodes []audit.NodeStatus `json:"nodes"`
}

// NodeResponse is GET /api/v1/nodes/{name}: the node and its findings.
type NodeResponse struct {
	At    time.Time  `json:"at"`
	Stale *StaleView `json:"stale,omitempty"`
	audit.NodeStatus
	Findings []audit.TimedFinding `json:"findings"`
}

// ExplainResponse is GET /api/v1/nodes/{name}/explain[?service=ns/name]:
// the node's rules traced service by service against the cluster.
type ExplainResponse struct {
	Node string `json:"node"`
	Mode string `json:"mode"`
	// States are the services that are not in sync, with their state.
	States map[string]audit.ServiceState `json:"states"`
	Ports  []audit.PortTrace             `json:"ports"`
	// Collector is what the node's collector says its reads cost.
	Collector *audit.CollectorCost `json:"collector,omitempty"`
}
