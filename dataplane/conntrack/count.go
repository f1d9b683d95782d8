package conntrack

import (
	"net/netip"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Entry is what the audit needs of one conntrack entry: its
// original tuple (client to frontend), the reply's source (the DNAT
// destination), whether it was DNATed and answered, its TCP state, its
// start (zero without kernel timestamps), and when its last packet went
// through (zero: unknown), which the collector dates from the entry's
// remaining timeout.
type Entry struct {
	Proto             uint8 // IP protocol number
	OrigSrc, OrigDst  netip.AddrPort
	ReplySrc          netip.AddrPort
	DstNAT, SeenReply bool
	TCPState          string
	Start             time.Time
	LastPacket        time.Time
}

// Counter counts DNATed entries per frontend of a node and
// destination, within a bound on distinct pairs, so that counting a table
// of a million entries costs the pairs, not the entries. The collector
// feeds it from a netlink dump, `proxyaudit diff` from `conntrack -L`.
type Counter struct {
	frontends, nodePorts map[audit.FrontendKey]bool
	local                func(netip.Addr) bool
	max                  int

	byKey            map[conntrackKey]*audit.ConntrackFlows
	undated          map[conntrackKey]bool // a judged entry's last packet unknown
	entries, dropped int
	timestamps       bool
}

type conntrackKey struct {
	fe   audit.FrontendKey
	dest netip.AddrPort
}

// Samples is how many clients a pair keeps for people.
const Samples = 3

// NewCounter counts the entries of frontends (the node's, from
// its rules): cluster, external and load-balancer IPs as they are, node
// ports on any address local says is the node's (nil: any). At most max
// distinct pairs are kept; entries beyond are counted as dropped.
func NewCounter(frontends []audit.FrontendKey, local func(netip.Addr) bool, max int) *Counter {
	c := &Counter{frontends: map[audit.FrontendKey]bool{}, nodePorts: map[audit.FrontendKey]bool{}, local: local, max: max,
		byKey: map[conntrackKey]*audit.ConntrackFlows{}, undated: map[conntrackKey]bool{}}
	for _, k := range frontends {
		if k.NodePort {
			c.nodePorts[k] = true
		} else {
			c.frontends[k] = true
		}
	}
	return c
}

// Add counts one entry, if it is a DNAT of one of the node's frontends.
func (c *Counter) Add(e *Entry) {
	if !e.DstNAT {
		return
	}
	proto, ok := audit.ProtocolName(e.Proto)
	if !ok {
		return
	}
	dst := e.OrigDst.Addr().Unmap()
	fe := audit.FrontendKey{IP: dst, Protocol: proto, Port: e.OrigDst.Port()}
	if !c.frontends[fe] {
		np := audit.NodePortKey(family(dst), proto, e.OrigDst.Port())
		if !c.nodePorts[np] || (c.local != nil && !c.local(dst)) {
			return
		}
		fe = np
	}
	c.entries++
	k := conntrackKey{fe: fe, dest: netip.AddrPortFrom(e.ReplySrc.Addr().Unmap(), e.ReplySrc.Port())}
	f := c.byKey[k]
	if f == nil {
		if len(c.byKey) >= c.max {
			c.dropped++
			return
		}
		f = &audit.ConntrackFlows{Frontend: fe, Dest: k.dest}
		c.byKey[k] = f
	}
	switch proto {
	case "UDP":
		f.UDP++
	case "SCTP":
		f.SCTP++
	case "TCP":
		state := e.TCPState
		if state == "" {
			state = "UNKNOWN"
		}
		if f.TCP == nil {
			f.TCP = map[string]int{}
		}
		f.TCP[state]++
	}
	if !e.SeenReply {
		f.Unreplied++
	}
	if audit.ConntrackJudged(proto, e.TCPState) {
		switch {
		case e.LastPacket.IsZero():
			c.undated[k] = true
		case e.LastPacket.After(f.Active):
			f.Active = e.LastPacket
		}
	}
	if !e.Start.IsZero() {
		c.timestamps = true
		if f.Oldest.IsZero() || e.Start.Before(f.Oldest) {
			f.Oldest = e.Start
		}
	}
	if len(f.Samples) < Samples {
		f.Samples = append(f.Samples, netip.AddrPortFrom(e.OrigSrc.Addr().Unmap(), e.OrigSrc.Port()))
	}
}

// Result is what was counted, sorted.
func (c *Counter) Result(families []int) *audit.Conntrack {
	out := &audit.Conntrack{Families: families, Entries: c.entries, Dropped: c.dropped, Timestamps: c.timestamps,
		Flows: make([]audit.ConntrackFlows, 0, len(c.byKey))}
	for k, f := range c.byKey {
		if c.undated[k] {
			f.Active = time.Time{}
		}
		out.Flows = append(out.Flows, *f)
	}
	audit.SortConntrack(out.Flows)
	return out
}

// family is 4 or 6.
func family(a netip.Addr) int {
	if a.Is4() {
		return 4
	}
	return 6
}
