package audit

import (
	"net/netip"
	"sort"
	"time"
)

// Conntrack is what a node's connection-tracking table holds for its
// service frontends: the flows the kernel DNATed, counted per frontend
// (the flow's original destination) and DNAT destination (where its
// packets really go). Rules are half of the dataplane: a flow keeps its
// DNAT decision for as long as it lives, so a UDP client that keeps
// sending stays pinned to a pod IP after the rule and the pod are gone.
type Conntrack struct {
	// Families lists the IP families the read covered (4, 6).
	Families []int
	// Flows are sorted by frontend, then destination.
	Flows []ConntrackFlows
	// Entries is how many DNATed entries the table held; Dropped how many
	// of them fell beyond the reader's bound on distinct (frontend,
	// destination) pairs and are counted nowhere else.
	Entries, Dropped int
	// Timestamps: the kernel stamps each entry's start
	// (net.netfilter.nf_conntrack_timestamp=1), so Oldest is exact; else
	// Oldest is when the collector first saw the pair.
	Timestamps bool
}

// ConntrackFlows counts the flows of one frontend DNATed to one
// destination.
type ConntrackFlows struct {
	Frontend FrontendKey
	Dest     netip.AddrPort
	// UDP, SCTP: flows of those protocols. TCP: by conntrack state
	// (ESTABLISHED, TIME_WAIT, ...).
	UDP, SCTP int
	TCP       map[string]int `json:",omitempty"`
	// Unreplied flows never saw a reply ([UNREPLIED] in conntrack -L): a
	// client sending into a destination that does not answer.
	Unreplied int
	// Oldest is the start of the oldest flow (see Conntrack.Timestamps).
	Oldest time.Time `json:",omitzero"`
	// Samples are a few clients (original sources), for people.
	Samples []netip.AddrPort `json:",omitempty"`
}

// Total is every flow counted.
func (f ConntrackFlows) Total() int {
	n := f.UDP + f.SCTP
	for _, c := range f.TCP {
		n += c
	}
	return n
}

// SortConntrack orders flows by frontend, then destination.
func SortConntrack(fs []ConntrackFlows) {
	sort.Slice(fs, func(i, j int) bool {
		if fs[i].Frontend != fs[j].Frontend {
			return fs[i].Frontend.less(fs[j].Frontend)
		}
		return fs[i].Dest.Compare(fs[j].Dest) < 0
	})
}
