package stream

import (
	"fmt"
	"hash/fnv"
	"math/bits"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
)

// Limits on a conntrack report: the collector keeps at most 20,000 pairs
// by default; more than MaxConntrackPairs is refused.
const (
	MaxConntrackPairs = 50_000
	maxSamples        = 3
	maxTCPStates      = 12
)

// Conntrack is a node's conntrack counts on the wire: the DNATed flows of
// its frontends per destination. A report carries it when it differs from
// the last one sent on the stream by more than noise (Digest); the
// aggregator keeps the last one it got. Error says why the table could
// not be read (the last counts then stand no more).
type Conntrack struct {
	Pairs      []ConntrackPair `json:"pairs"`
	Entries    int             `json:"entries"`
	Dropped    int             `json:"dropped,omitempty"`
	Timestamps bool            `json:"timestamps,omitempty"`
	Families   []int           `json:"families,omitempty"`
	Error      string          `json:"error,omitempty"`
}

// ConntrackPair is one frontend's flows to one destination.
type ConntrackPair struct {
	Frontend  string         `json:"k"`
	Dest      string         `json:"d"`
	UDP       int            `json:"u,omitempty"`
	SCTP      int            `json:"s,omitempty"`
	TCP       map[string]int `json:"t,omitempty"`
	Unreplied int            `json:"r,omitempty"`
	// Oldest is the oldest flow's start, Unix seconds (0: unknown).
	Oldest int64 `json:"o,omitempty"`
	// Active is the last packet of a judged flow (UDP, a TCP connection
	// attempt), Unix seconds (0: unknown). The collector sends it only
	// for destinations its rules no longer send the frontend to.
	Active int64 `json:"a,omitempty"`
	// Quiet: no packet since the collector's previous read (Active is
	// older): the flows only count down (an older collector never says
	// so; its flows are judged by Active alone).
	Quiet   bool     `json:"q,omitempty"`
	Samples []string `json:"c,omitempty"`
}

// FromConntrack converts a read to its wire form.
func FromConntrack(ct *audit.Conntrack) *Conntrack {
	out := &Conntrack{Entries: ct.Entries, Dropped: ct.Dropped, Timestamps: ct.Timestamps, Families: slices.Clone(ct.Families),
		Pairs: make([]ConntrackPair, 0, len(ct.Flows))}
	for _, f := range ct.Flows {
		p := ConntrackPair{Frontend: KeyString(f.Frontend), Dest: f.Dest.String(), UDP: f.UDP, SCTP: f.SCTP, TCP: f.TCP, Unreplied: f.Unreplied}
		if !f.Oldest.IsZero() {
			p.Oldest = f.Oldest.Unix()
		}
		if !f.Active.IsZero() {
			p.Active = f.Active.Unix()
		}
		for _, s := range f.Samples {
			p.Samples = append(p.Samples, s.String())
		}
		out.Pairs = append(out.Pairs, p)
	}
	return out
}

// Digest hashes what matters of the counts: the pairs, each count in
// powers of two, the oldest flow to the minute. A steady node whose flows
// come and go at the same rate sends its counts once.
func (c *Conntrack) Digest() uint64 {
	h := fnv.New64a()
	w := func(s string) { h.Write([]byte(s)); h.Write([]byte{0}) }
	mag := func(n int) string { return strconv.Itoa(bits.Len(uint(max(n, 0)))) }
	w(c.Error)
	w(mag(c.Entries))
	w(mag(c.Dropped))
	for _, p := range c.Pairs {
		w(p.Frontend)
		w(p.Dest)
		w(mag(p.UDP))
		w(mag(p.SCTP))
		w(mag(p.Unreplied))
		w(strconv.FormatInt(p.Oldest/60, 10))
		// To ten seconds: a flow still carrying packets to a destination
		// that left is sent again as the time moves (only such pairs
		// carry Active, see ConntrackPair).
		w(strconv.FormatInt(p.Active/10, 10))
		w(strconv.FormatBool(p.Quiet))
		states := make([]string, 0, len(p.TCP))
		for s := range p.TCP {
			states = append(states, s)
		}
		sort.Strings(states)
		for _, s := range states {
			w(s)
			w(mag(p.TCP[s]))
		}
	}
	return h.Sum64()
}

// Model validates what a collector sent and converts it: bounded counts,
// known frontends' keys, addresses; names it shows people cleaned.
func (c *Conntrack) Model() (*audit.Conntrack, error) {
	if len(c.Pairs) > MaxConntrackPairs {
		return nil, fmt.Errorf("conntrack: %d pairs (at most %d)", len(c.Pairs), MaxConntrackPairs)
	}
	if c.Entries < 0 || c.Dropped < 0 || len(c.Families) > 2 {
		return nil, fmt.Errorf("conntrack: %d entries, %d dropped, families %v", c.Entries, c.Dropped, c.Families)
	}
	out := &audit.Conntrack{Entries: c.Entries, Dropped: c.Dropped, Timestamps: c.Timestamps, Families: slices.Clone(c.Families),
		Flows: make([]audit.ConntrackFlows, 0, len(c.Pairs))}
	for _, p := range c.Pairs {
		fe, err := ParseKey(p.Frontend)
		if err != nil {
			return nil, fmt.Errorf("conntrack: %w", err)
		}
		dest, err := netip.ParseAddrPort(p.Dest)
		if err != nil {
			return nil, fmt.Errorf("conntrack: destination %q: not an address and port", clip(p.Dest))
		}
		if p.UDP < 0 || p.SCTP < 0 || p.Unreplied < 0 || len(p.TCP) > maxTCPStates || len(p.Samples) > maxSamples || p.Oldest < 0 || p.Active < 0 {
			return nil, fmt.Errorf("conntrack: pair %s -> %s out of range", p.Frontend, clip(p.Dest))
		}
		f := audit.ConntrackFlows{Frontend: fe, Dest: dest, UDP: p.UDP, SCTP: p.SCTP, Unreplied: p.Unreplied}
		if len(p.TCP) > 0 {
			f.TCP = make(map[string]int, len(p.TCP))
			for s, n := range p.TCP {
				if n < 0 {
					return nil, fmt.Errorf("conntrack: pair %s -> %s: negative count", p.Frontend, clip(p.Dest))
				}
				f.TCP[safetext.Clean(s, 16)] = n
			}
		}
		if f.Unreplied > f.Total() {
			return nil, fmt.Errorf("conntrack: pair %s -> %s: %d unreplied of %d flows", p.Frontend, clip(p.Dest), f.Unreplied, f.Total())
		}
		if p.Oldest > 0 {
			f.Oldest = time.Unix(p.Oldest, 0)
		}
		if p.Active > 0 {
			f.Active, f.Quiet = time.Unix(p.Active, 0), p.Quiet
		}
		for _, s := range p.Samples {
			a, err := netip.ParseAddrPort(s)
			if err != nil {
				return nil, fmt.Errorf("conntrack: client %q: not an address and port", clip(s))
			}
			f.Samples = append(f.Samples, a)
		}
		out.Flows = append(out.Flows, f)
	}
	audit.SortConntrack(out.Flows)
	return out, nil
}
