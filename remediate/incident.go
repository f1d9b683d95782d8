package remediate

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"
)

// AnnotationCordoned marks, on the Node, a cordon proxyaudit made. It is a
// marker for people and for the chart's admission policy (which lets
// proxyaudit uncordon only a node carrying it), not the record: proxyaudit
// decides from its own incident record, which a node cannot write, and
// undoes a cordon only when both say it is its own.
const AnnotationCordoned = "proxyaudit.io/cordoned-at"

// LegacyAnnotations held incidents on the Node before 0.x: a node's
// kubelet may write its own Node's annotations, so a compromised node
// could hold the fleet budget or have an admin's cordon undone. They are
// read no more and removed when proxyaudit next patches the node.
var LegacyAnnotations = []string{"proxyaudit.io/incident-stage", "proxyaudit.io/incident-opened", "proxyaudit.io/kube-proxy-restarts"}

// ClockSkew is how far in the future a recorded time may lie and still be
// believed (replicas' clocks differ a little).
const ClockSkew = time.Minute

// record is an incident as stored: one JSON value per node.
type record struct {
	Stage    Stage       `json:"stage,omitempty"`
	Opened   *time.Time  `json:"opened,omitempty"`
	Restarts []time.Time `json:"restarts,omitempty"`
	Cordoned *time.Time  `json:"cordoned,omitempty"`
	Flushes  []time.Time `json:"flushes,omitempty"`
	// FlushHeld is the digest of the hold and pairs last paged.
	FlushHeld string `json:"flushHeld,omitempty"`
}

// Empty: nothing to remember (no incident, no restart, no cordon).
func (inc Incident) Empty() bool {
	return inc.Stage == "" && len(inc.Restarts) == 0 && inc.Cordoned.IsZero() && len(inc.Flushes) == 0 && inc.FlushHeld == ""
}

// Encode renders the incident for its record.
func (inc Incident) Encode() string {
	r := record{Stage: inc.Stage, Restarts: slices.Clone(inc.Restarts), Flushes: slices.Clone(inc.Flushes), FlushHeld: inc.FlushHeld}
	if inc.Stage != "" && !inc.Opened.IsZero() {
		t := inc.Opened.UTC()
		r.Opened = &t
	}
	if !inc.Cordoned.IsZero() {
		t := inc.Cordoned.UTC()
		r.Cordoned = &t
	}
	for i := range r.Restarts {
		r.Restarts[i] = r.Restarts[i].UTC()
	}
	for i := range r.Flushes {
		r.Flushes[i] = r.Flushes[i].UTC()
	}
	b, _ := json.Marshal(r) // times and strings only: cannot fail
	return string(b)
}

// DecodeIncident reads a record. Times later than now (beyond ClockSkew)
// are dropped: a record from the future must not hold a node "restarted"
// and the fleet's budget with it forever. An unknown stage is an error,
// as is anything that is not a record.
func DecodeIncident(s string, now time.Time) (Incident, error) {
	var r record
	if err := json.Unmarshal([]byte(s), &r); err != nil {
		return Incident{}, fmt.Errorf("not an incident record: %v", err)
	}
	var inc Incident
	switch r.Stage {
	case "", StageOpen, StageRestarted, StageEscalated:
		inc.Stage = r.Stage
	default:
		return Incident{}, fmt.Errorf("unknown incident stage %q", r.Stage)
	}
	past := func(t *time.Time) time.Time {
		if t == nil || t.After(now.Add(ClockSkew)) {
			return time.Time{}
		}
		return *t
	}
	inc.Opened, inc.Cordoned = past(r.Opened), past(r.Cordoned)
	if inc.Stage != "" && inc.Opened.IsZero() {
		inc.Opened = now // an incident without a believable start began now
	}
	for _, t := range r.Restarts {
		if !t.After(now.Add(ClockSkew)) {
			inc.Restarts = append(inc.Restarts, t)
		}
	}
	for _, t := range r.Flushes {
		if !t.After(now.Add(ClockSkew)) {
			inc.Flushes = append(inc.Flushes, t)
		}
	}
	inc.FlushHeld = r.FlushHeld
	if inc.Stage == StageRestarted && len(inc.Restarts) == 0 {
		inc.Stage = StageOpen // restarted, but no believable restart
	}
	return inc, nil
}
