package remediate

import (
	"strings"
	"time"
)

// AlertName is the alertname of an incident's alert in Alertmanager;
// StormAlertName that of a mass divergence (about the fleet, no node).
const (
	AlertName      = "ProxyAuditIncident"
	StormAlertName = "ProxyAuditMassDivergence"
)

// Alert is an incident as Alertmanager sees it: firing while the incident
// lasts, ended when it resolves. Its labels are what silences match and
// receivers route on, so they change only when the incident does: kind
// is the node's state, severity warning while proxyaudit may still repair
// the node and critical once it needs a human (escalated) or is about the
// whole fleet. Evidence and the last action are annotations.
type Alert struct {
	Node     string // "" for the fleet (a storm)
	Kind     string
	Severity string
	// Summary is one line; Evidence the node's findings, worst first;
	// Action the last thing proxyaudit did or decided, and why.
	Summary  string
	Evidence []string
	Action   string
	Since    time.Time
}

// Severities.
const (
	SeverityWarning  = "warning"
	SeverityCritical = "critical"
)

// NodeAlert is the alert of a node with an incident.
func NodeAlert(n Node, kind string) Alert {
	sev := SeverityWarning
	if n.Incident.Stage == StageEscalated {
		sev = SeverityCritical
	}
	return Alert{Node: n.Name, Kind: kind, Severity: sev, Summary: n.Summary, Since: n.Incident.Opened}
}

// Alerting says whether a node's incident is one to keep firing: drifted,
// or an open incident on a node not back in sync (its collector silent,
// say). A healthy node's incident resolves this round.
func Alerting(n Node) bool {
	return n.Drifted || (n.Incident.Stage != "" && !n.Healthy)
}

// Labels are the alert's identity in Alertmanager.
func (a Alert) Labels(cluster string) map[string]string {
	l := map[string]string{"alertname": AlertName, "kind": a.Kind, "severity": a.Severity}
	if a.Node == "" {
		l["alertname"] = StormAlertName
	} else {
		l["node"] = a.Node
	}
	if cluster != "" {
		l["cluster"] = cluster
	}
	return l
}

// Annotations are what a receiver shows.
func (a Alert) Annotations(cluster string) map[string]string {
	where := a.Node
	if a.Node == "" {
		where = "the fleet"
	}
	if cluster != "" {
		where += " (" + cluster + ")"
	}
	an := map[string]string{"summary": "kube-proxy rules drifted on " + where + ": " + a.Summary}
	if len(a.Evidence) > 0 {
		ev := a.Evidence
		if len(ev) > 20 {
			ev = append(ev[:20:20], "…")
		}
		an["description"] = strings.Join(ev, "\n")
	}
	if a.Action != "" {
		an["proxyaudit_action"] = a.Action
	}
	return an
}
