package remediate

import (
	"fmt"
	"strings"
	"time"
)

// PauseRequest is a fleet-wide pause of every repair, as kept in the
// pause ConfigMap (`proxyaudit pause` writes it): who paused, why, since
// when and, optionally, until when. Detection, findings and pages go on.
type PauseRequest struct {
	By, Reason   string
	Since, Until time.Time
}

// The pause ConfigMap's keys.
const (
	PauseKeyBy     = "by"
	PauseKeyReason = "reason"
	PauseKeySince  = "since"
	PauseKeyUntil  = "until"
)

// Data is the request as the ConfigMap's data.
func (p PauseRequest) Data() map[string]string {
	d := map[string]string{PauseKeyBy: p.By, PauseKeyReason: p.Reason, PauseKeySince: p.Since.UTC().Format(time.RFC3339)}
	if !p.Until.IsZero() {
		d[PauseKeyUntil] = p.Until.UTC().Format(time.RFC3339)
	}
	return d
}

// DecodePause reads a pause ConfigMap's data; no "since" is no pause (an
// empty ConfigMap, as the chart makes it). A malformed request is an
// error: the caller holds repairs rather than guess.
func DecodePause(data map[string]string) (PauseRequest, bool, error) {
	since := data[PauseKeySince]
	if since == "" {
		return PauseRequest{}, false, nil
	}
	p := PauseRequest{By: data[PauseKeyBy], Reason: data[PauseKeyReason]}
	var err error
	if p.Since, err = time.Parse(time.RFC3339, since); err != nil {
		return PauseRequest{}, true, fmt.Errorf("pause request: since %q is not an RFC 3339 time", clip(since))
	}
	if u := data[PauseKeyUntil]; u != "" {
		if p.Until, err = time.Parse(time.RFC3339, u); err != nil {
			return PauseRequest{}, true, fmt.Errorf("pause request: until %q is not an RFC 3339 time", clip(u))
		}
	}
	return p, true, nil
}

// Active reports whether the pause holds at now.
func (p PauseRequest) Active(now time.Time) bool { return p.Until.IsZero() || now.Before(p.Until) }

// String is "by alice since 2026-11-27T09:00:00Z (until …): reason".
func (p PauseRequest) String() string {
	s := "by " + orUnknown(p.By) + " since " + p.Since.UTC().Format(time.RFC3339)
	if !p.Until.IsZero() {
		s += " until " + p.Until.UTC().Format(time.RFC3339)
	}
	return s + ": " + orUnknown(p.Reason)
}

func orUnknown(s string) string {
	if s = strings.TrimSpace(s); s == "" {
		return "(not said)"
	}
	return clip(s)
}

// clip keeps text from a ConfigMap short in pages and logs.
func clip(s string) string {
	if len(s) > 200 {
		return strings.ToValidUTF8(s[:200], "") + "…"
	}
	return s
}
