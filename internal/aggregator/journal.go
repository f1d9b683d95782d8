package aggregator

import (
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/internal/ui"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// journalSize bounds the actions the leader remembers for the status page
// (all nodes), and journalPerNode a node's.
const (
	journalSize    = 500
	journalPerNode = 30
)

// journal is the leader's record of remediation actions as their Events
// say them, newest last, for the status page. It lives in memory: a new
// leader starts empty (the incident record and the Events are what
// persist).
type journal struct {
	mu      sync.Mutex
	entries []ui.Entry
	now     func() time.Time
}

// Notify records an action (effect.Executor.Journal).
func (j *journal) Notify(n remediate.Notice) {
	e := ui.Entry{Node: n.Node, Kind: string(n.Kind), Reason: n.Reason, DryRun: n.DryRun, Held: n.Held}
	e.At = j.now()
	j.mu.Lock()
	defer j.mu.Unlock()
	if len(j.entries) >= journalSize {
		j.entries = append(j.entries[:0], j.entries[len(j.entries)-journalSize/2:]...)
	}
	j.entries = append(j.entries, e)
}

// recent returns the entries of node ("" for all), newest first, at most n.
func (j *journal) recent(node string, n int) []ui.Entry {
	j.mu.Lock()
	defer j.mu.Unlock()
	var out []ui.Entry
	for i := len(j.entries) - 1; i >= 0 && len(out) < n; i-- {
		if node == "" || j.entries[i].Node == node {
			out = append(out, j.entries[i])
		}
	}
	return out
}
