package aggregator

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// The leader reads every holder's partial each second. In full that is
// every node's status, ~1.2 KB a node: ~120 MB/s of JSON at 100,000
// nodes. So a holder answers with what changed since the version the
// leader last read: a node's state and the facts that make findings at
// once (a flip between in sync and lagging with the whole status), its
// last report when it moved by reportEvery (NodeLight), its
// whole status (counts, lag, kube-proxy and collector figures) when it is
// new and then at most every detailEvery, and the nodes that left. Findings are whole in every
// answer: they are small unless the fleet is drifting, and then they are
// what matters.

// detailEvery is how old a node's whole status may be on the leader;
// reportEvery how far its last report may trail (a node reports every
// second or so under churn: sending each would be most of the bytes).
// Its state and findings are never older than a read.
const (
	detailEvery = 10 * time.Second
	reportEvery = 3 * time.Second
)

// keepVersions is how many versions (about one a second) a holder keeps
// the nodes that left for: a leader further behind is answered in full.
const keepVersions = 300

// NodeLight is the part of a node's status sent as soon as it changes.
type NodeLight struct {
	Node       string          `json:"node"`
	State      audit.NodeState `json:"state"`
	LastReport time.Time       `json:"lastReport,omitzero"`
	Mode       audit.Mode      `json:"mode,omitempty"`
	ReadError  string          `json:"readError,omitempty"`
	Warnings   []string        `json:"warnings,omitempty"`
	StaleFlows int             `json:"staleFlows,omitempty"`
}

func lightOf(st audit.NodeStatus) NodeLight {
	return NodeLight{Node: st.Node, State: st.State, LastReport: st.LastReport, Mode: st.Mode, ReadError: st.ReadError, Warnings: st.Warnings, StaleFlows: st.StaleFlows}
}

// same: o says nothing the leader must know now that l does not: its
// last report moved by less than reportEvery, and its state is the same,
// or went between in sync and lagging (within grace: no finding, no
// repair; under churn nodes flip between the two every second, and those
// flips ride with the whole status).
func (l NodeLight) same(o NodeLight) bool {
	calm := func(s audit.NodeState) bool { return s == audit.NodeInSync || s == audit.NodeLagging }
	return o.LastReport.Sub(l.LastReport) < reportEvery && (l.State == o.State || calm(l.State) && calm(o.State)) && l.Mode == o.Mode && l.ReadError == o.ReadError && l.StaleFlows == o.StaleFlows && slices.Equal(l.Warnings, o.Warnings)
}

func (l NodeLight) onto(st *audit.NodeStatus) {
	st.State, st.LastReport, st.Mode, st.ReadError, st.Warnings, st.StaleFlows = l.State, l.LastReport, l.Mode, l.ReadError, l.Warnings, l.StaleFlows
}

// partialLog is a replica's partial as the leader may read it: each
// node's status as last sent, the version each part last changed, the
// nodes that left.
type partialLog struct {
	mu      sync.Mutex
	epoch   string // this replica's run: versions of another run mean nothing
	version uint64
	shards  []int
	at      time.Time
	missing []audit.TimedFinding
	drift   []audit.TimedFinding
	drifted map[string]time.Time
	nodes   map[string]*loggedNode
	gone    map[string]uint64 // node → the version it left at
	floor   uint64            // the nodes that left before it are forgotten
}

type loggedNode struct {
	status   audit.NodeStatus
	changed  uint64 // its light part (or all of it)
	detailed uint64 // all of it
	detailAt time.Time
}

func newPartialLog(epoch string) *partialLog {
	return &partialLog{epoch: epoch, nodes: map[string]*loggedNode{}, gone: map[string]uint64{}}
}

// stagger spreads the nodes' whole-status refreshes over detailEvery, so
// that nodes that arrived together are not all sent again together.
func stagger(node string) time.Duration {
	return time.Duration(maphash.String(staggerSeed, node) % uint64(detailEvery))
}

var staggerSeed = maphash.MakeSeed()

// publish records a new partial of the shards held.
func (l *partialLog) publish(p audit.Partial, shards []int, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.version++
	v := l.version
	l.shards, l.at, l.missing, l.drift, l.drifted = shards, p.At, p.Missing, p.Drift, p.Drifted
	seen := make(map[string]bool, len(p.Nodes))
	for _, st := range p.Nodes {
		seen[st.Node] = true
		e := l.nodes[st.Node]
		switch {
		case e == nil:
			l.nodes[st.Node] = &loggedNode{status: st, changed: v, detailed: v, detailAt: now.Add(-stagger(st.Node))}
			delete(l.gone, st.Node)
		case now.Sub(e.detailAt) >= detailEvery:
			e.detailAt = now
			// Once per node per detailEvery: DeepEqual's cost is no matter,
			// and it misses no field added to the status later.
			if !reflect.DeepEqual(e.status, st) {
				e.status, e.changed, e.detailed = st, v, v
			}
		case !lightOf(e.status).same(lightOf(st)):
			lightOf(st).onto(&e.status)
			e.changed = v
		}
	}
	for n := range l.nodes {
		if !seen[n] {
			delete(l.nodes, n)
			l.gone[n] = v
		}
	}
	if v > keepVersions {
		for n, at := range l.gone {
			if at <= v-keepVersions {
				delete(l.gone, n)
				l.floor = max(l.floor, at)
			}
		}
	}
}

// since answers a read by the leader, who holds version since of run
// epoch: the changes after it, or every node when the leader holds
// nothing this log can follow. ok is false before the first publish.
func (l *partialLog) since(epoch string, since uint64) (PartialResponse, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.version == 0 {
		return PartialResponse{}, false
	}
	r := PartialResponse{Epoch: l.epoch, Version: l.version, Shards: l.shards,
		Partial: audit.Partial{At: l.at, Missing: l.missing, Drift: l.drift, Drifted: l.drifted}}
	full := epoch != l.epoch || since == 0 || since < l.floor || since > l.version
	for _, n := range slices.Sorted(maps.Keys(l.nodes)) {
		e := l.nodes[n]
		switch {
		case full || e.detailed > since:
			r.Partial.Nodes = append(r.Partial.Nodes, e.status)
		case e.changed > since:
			r.States = append(r.States, lightOf(e.status))
		}
		if full && e.status.State != audit.NodeMissing && e.status.State != audit.NodePending {
			r.Partial.Reporting++
		}
	}
	if !full {
		r.Since = since
		for n, at := range l.gone {
			if at > since {
				r.Gone = append(r.Gone, n)
			}
		}
		slices.Sort(r.Gone)
	}
	return r, true
}

// partialMirror is a holder's partial as the leader has read it.
type partialMirror struct {
	epoch   string
	version uint64
	shards  []int
	partial audit.Partial // Nodes in no order: see nodes
	nodes   map[string]audit.NodeStatus
}

// query is what the leader asks the holder for: the changes after what
// it holds.
func (m *partialMirror) query() string {
	if m == nil || m.version == 0 {
		return ""
	}
	return "?epoch=" + m.epoch + "&since=" + strconv.FormatUint(m.version, 10)
}

// apply takes a holder's answer: in full (Since 0), or the changes after
// the version the mirror holds. An answer that does not follow it leaves
// the mirror as it was, and asks for everything next time.
func (m *partialMirror) apply(r *PartialResponse) error {
	if r.Since == 0 {
		m.nodes = make(map[string]audit.NodeStatus, len(r.Partial.Nodes))
		for _, st := range r.Partial.Nodes {
			m.nodes[st.Node] = st
		}
	} else {
		if r.Epoch != m.epoch || r.Since != m.version {
			err := fmt.Errorf("answered the changes since version %d of run %q; the leader holds %d of %q", r.Since, clip(r.Epoch), m.version, clip(m.epoch))
			m.version = 0
			return err
		}
		// Indexed once: a scan of the answer's nodes per state made an
		// answer of 700 KB take seconds (trust review 4, item 4).
		whole := make(map[string]bool, len(r.Partial.Nodes))
		for _, st := range r.Partial.Nodes {
			whole[st.Node] = true
		}
		for _, l := range r.States {
			if _, ok := m.nodes[l.Node]; !ok && !whole[l.Node] {
				m.version = 0
				return fmt.Errorf("sent the state of node %q, which it never sent", clip(l.Node))
			}
		}
		for _, n := range r.Gone {
			delete(m.nodes, n)
		}
		for _, st := range r.Partial.Nodes {
			m.nodes[st.Node] = st
		}
		for _, l := range r.States {
			st := m.nodes[l.Node]
			l.onto(&st)
			m.nodes[l.Node] = st
		}
	}
	m.epoch, m.version, m.shards = r.Epoch, r.Version, r.Shards
	m.partial = audit.Partial{At: r.Partial.At, Missing: r.Partial.Missing, Drift: r.Partial.Drift, Drifted: r.Partial.Drifted}
	return nil
}

// whole is the holder's partial as last read, every node in name order.
func (m *partialMirror) whole() audit.Partial {
	p := m.partial
	p.Nodes = make([]audit.NodeStatus, 0, len(m.nodes))
	for _, n := range slices.Sorted(maps.Keys(m.nodes)) {
		p.Nodes = append(p.Nodes, m.nodes[n])
	}
	return p
}

// decodePartial reads a holder's answer, taking at most maxNodes node
// entries (whole statuses, states and nodes gone, each): a node entry
// decoded from "{}" is ~77 times its bytes in memory, so a bound on
// bytes alone let a 64 MiB answer need gigabytes (trust review 4, item 4).
// The entries are decoded one at a time and the count checked first.
func decodePartial(body []byte, maxNodes int) (*PartialResponse, error) {
	var w struct {
		PartialResponse
		Partial struct {
			audit.Partial
			Nodes bounded[audit.NodeStatus] `json:"nodes"`
		} `json:"partial"`
		States bounded[NodeLight] `json:"states"`
		Gone   bounded[string]    `json:"gone"`
	}
	w.Partial.Nodes.max, w.States.max, w.Gone.max = maxNodes, maxNodes, maxNodes
	if err := json.Unmarshal(body, &w); err != nil {
		return nil, err
	}
	out := w.PartialResponse
	out.Partial = w.Partial.Partial
	out.Partial.Nodes, out.States, out.Gone = w.Partial.Nodes.items, w.States.items, w.Gone.items
	return &out, nil
}

// bounded is a JSON list decoded element by element, refused past max.
type bounded[T any] struct {
	max   int
	items []T
}

func (b *bounded[T]) UnmarshalJSON(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	if tok == nil {
		return nil
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return fmt.Errorf("want a list, got %v", tok)
	}
	for dec.More() {
		if len(b.items) >= b.max {
			return fmt.Errorf("more than %d node entries: more than the holder's shards have nodes", b.max)
		}
		var v T
		if err := dec.Decode(&v); err != nil {
			return err
		}
		b.items = append(b.items, v)
	}
	_, err = dec.Token()
	return err
}

// PartialResponse is GET /internal/v1/partial[?epoch=E&since=V]: a
// replica's judgement of the nodes of the shards it holds, version
// Version of its run Epoch. With Since 0 Partial holds every node; else
// only the changes after version Since (partials.go): Partial.Nodes the
// nodes new or sent whole again, States the nodes whose state changed,
// Gone the nodes that left. Partial's findings are always whole.
type PartialResponse struct {
	Replica string        `json:"replica"`
	Shards  []int         `json:"shards"`
	Epoch   string        `json:"epoch,omitempty"`
	Version uint64        `json:"version,omitempty"`
	Since   uint64        `json:"since,omitempty"`
	Partial audit.Partial `json:"partial"`
	States  []NodeLight   `json:"states,omitempty"`
	Gone    []string      `json:"gone,omitempty"`
}

// gathered is one holder's partial as the leader last read it: another
// replica's kept from its answers (mirror), or this replica's own.
type gathered struct {
	mirror *partialMirror
	own    *PartialResponse
	at     time.Time
}

func (g gathered) shards() []int {
	if g.own != nil {
		return g.own.Shards
	}
	return g.mirror.shards
}

func (g gathered) whole() audit.Partial {
	if g.own != nil {
		return g.own.Partial
	}
	return g.mirror.whole()
}
