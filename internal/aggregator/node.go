// A node as the fleet knows it: its stream, its copy of the rules, and
// what was last judged of them.

package aggregator

import (
	"slices"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// node is one node's stream: the copy of its rules and what was last
// assessed of them.
type node struct {
	name             string
	collectorVersion string // from its hello
	conn             *conn
	state            *stream.State
	complete         bool // a full snapshot arrived on this stream
	lastSeq          uint64
	heard            time.Time
	fresh            bool   // a report since the last assessment
	version          uint64 // bumps when state changes
	noRules          bool
	// shownSince: the first report on this stream showing the rules as
	// they are now (their version); judged: the time the last judgement
	// was made as of; before: the rules earlier reports showed, earliest
	// first, while no judgement reached them (at most maxShown). See
	// judgeAt.
	shownSince, judged time.Time
	before             []shown

	// readNowFor is the grace deadline a read-now request was last sent
	// for: one request per crossing.
	readNowFor time.Time
	// reads are the collector's read counts as it last said them.
	reads map[stream.ReadReason]uint64
	// fallbacks is the collector's count of reads that fell back to the
	// text tool, as last reported.
	fallbacks uint64
	// conntrack is the node's conntrack counts as last sent (nil: none
	// yet, or the collector does not read them); conntrackErr why the
	// collector could not read them last.
	conntrack    *audit.Conntrack
	conntrackErr string
	// ctJudged is the last judgement of conntrack, for these counts
	// against the history at ctJudgedSeq (its TouchSeq), made at
	// ctJudgedAt: reused while neither moved, for a quarter grace.
	ctJudged    []audit.TimedFinding
	ctJudgedFor *audit.Conntrack
	ctJudgedSeq uint64
	ctJudgedAt  time.Time

	assessedVersion, assessedGen uint64
	assessments                  []audit.ServiceAssessment
	base                         *baseline // Evaluate's goroutine only
}

// shown is what one of a node's reports showed: its rules (immutable
// buckets, cheap to keep), their version, and the span they were shown.
type shown struct {
	state     stream.State
	at, since time.Time
	version   uint64
	noRules   bool
}

// maxShown bounds the rules a node's reports showed that wait for a
// judgement: a stream sends at most four reports a second and the view
// trails the API by a second or so, so a few suffice; past it the
// intermediate rules go first (never the earliest, which dates a drift,
// nor a table without rules, which dates everything after it).
const maxShown = 4

// keepShown queues s after the rules waiting in q, making room as
// maxShown says.
func keepShown(q []shown, s shown) []shown {
	if len(q) >= maxShown {
		drop := 1
		for i := 1; i < len(q); i++ {
			if !q[i].noRules {
				drop = i
				break
			}
		}
		q = slices.Delete(q, drop, drop+1)
	}
	return append(q, s)
}

// baseline is a node's last assessment and what it was made from, so the
// next one reassesses only the services that changed since: those whose
// kept versions the History touched, and those owning a frontend the
// node's rules changed. At the anchors a full assessment costs ~0.2-0.4 s;
// under 100 changes a second a node's report changes a few hundred.
//
// A baseline serves other nodes too (a peer's): a node with none of its
// own (a new stream, every stream after a leader change) starts from the
// newest baseline of its mode and zone, reassessing besides the services
// whose expectations differ between the two nodes (audit.Dependents).
type baseline struct {
	rules      stream.State
	touchSeq   uint64
	node, zone string
	// services are the assessments of services not in sync or draining,
	// sorted by service: the node's assessment itself, shared (a map of
	// them per node was a third of the leader's heap at 5,000 nodes).
	services []audit.ServiceAssessment
	// unowned are the keys of the rules' frontends no kept version of any
	// service had.
	unowned []string
}

// clip cleans s for a log line or a message, at most 80 bytes.
func clip(s string) string { return safetext.Clean(s, 80) }
