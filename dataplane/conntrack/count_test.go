package conntrack

import (
	"net/netip"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// The counter dates a pair by its judged entries' last packets, and
// leaves it undated when one of them is.
func TestConntrackCounterDatesJudgedFlows(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	fe := audit.FrontendKey{IP: netip.MustParseAddr("198.19.0.20"), Protocol: "UDP", Port: 53}
	tfe := audit.FrontendKey{IP: netip.MustParseAddr("198.19.0.20"), Protocol: "TCP", Port: 80}
	c := NewCounter([]audit.FrontendKey{fe, tfe}, nil, 10)
	add := func(proto uint8, port uint16, dest, state string, last time.Time) {
		c.Add(&Entry{Proto: proto, OrigSrc: netip.MustParseAddrPort("198.18.5.5:40000"), OrigDst: netip.AddrPortFrom(fe.IP, port),
			ReplySrc: netip.MustParseAddrPort(dest), DstNAT: true, TCPState: state, LastPacket: last})
	}
	add(17, 53, "198.18.77.3:5353", "", t0)
	add(17, 53, "198.18.77.3:5353", "", t0.Add(5*time.Second))
	add(6, 80, "198.18.77.3:8080", "SYN_SENT", t0.Add(time.Second))
	add(6, 80, "198.18.77.3:8080", "ESTABLISHED", t0.Add(time.Hour)) // not judged: does not date the pair
	add(17, 53, "198.18.77.4:5353", "", t0)
	add(17, 53, "198.18.77.4:5353", "", time.Time{})
	got := map[string]time.Time{}
	for _, f := range c.Result([]int{4}).Flows {
		got[f.Dest.String()] = f.Active
	}
	if !got["198.18.77.3:5353"].Equal(t0.Add(5*time.Second)) || !got["198.18.77.3:8080"].Equal(t0.Add(time.Second)) || !got["198.18.77.4:5353"].IsZero() {
		t.Errorf("pairs dated %v", got)
	}
}
