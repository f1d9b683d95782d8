package remediate

import (
	"strings"
	"time"
)

// Node annotations holding a node's incident, so that a new leader
// continues it instead of starting over or repeating an action.
const (
	AnnotationPrefix   = "proxyaudit.io/"
	AnnotationStage    = AnnotationPrefix + "incident-stage"
	AnnotationOpened   = AnnotationPrefix + "incident-opened"
	AnnotationRestarts = AnnotationPrefix + "kube-proxy-restarts"
	// AnnotationCordoned marks a cordon proxyaudit made: only such a
	// cordon is ever undone by proxyaudit.
	AnnotationCordoned = AnnotationPrefix + "cordoned-at"
)

// IncidentFromAnnotations reads a node's incident; unparsable values are
// dropped (a hand-edited annotation must not stop remediation).
func IncidentFromAnnotations(a map[string]string) Incident {
	var inc Incident
	switch s := Stage(a[AnnotationStage]); s {
	case StageOpen, StageRestarted, StageEscalated:
		inc.Stage = s
	}
	inc.Opened, _ = time.Parse(time.RFC3339, a[AnnotationOpened])
	inc.Cordoned, _ = time.Parse(time.RFC3339, a[AnnotationCordoned])
	for _, s := range strings.Split(a[AnnotationRestarts], ",") {
		if t, err := time.Parse(time.RFC3339, strings.TrimSpace(s)); err == nil {
			inc.Restarts = append(inc.Restarts, t)
		}
	}
	return inc
}

// Annotations renders an incident as annotation values for a merge
// patch: a nil value removes the annotation.
func (inc Incident) Annotations() map[string]*string {
	str := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	ts := func(t time.Time) *string {
		if t.IsZero() {
			return nil
		}
		return str(t.UTC().Format(time.RFC3339))
	}
	var rs []string
	for _, t := range inc.Restarts {
		rs = append(rs, t.UTC().Format(time.RFC3339))
	}
	opened := inc.Opened
	if inc.Stage == "" {
		opened = time.Time{}
	}
	return map[string]*string{
		AnnotationStage:    str(string(inc.Stage)),
		AnnotationOpened:   ts(opened),
		AnnotationRestarts: str(strings.Join(rs, ",")),
		AnnotationCordoned: ts(inc.Cordoned),
	}
}
