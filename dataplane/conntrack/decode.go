package conntrack

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ctnetlink's attribute numbers (linux/netfilter/nfnetlink_conntrack.h)
// and status bits (linux/netfilter/nf_conntrack_common.h).
const (
	ctaTupleOrig  = 1
	ctaTupleReply = 2
	ctaStatus     = 3
	ctaProtoInfo  = 4
	ctaTimeout    = 7
	ctaID         = 12
	ctaTimestamp  = 20
	ctaStatusMask = 26

	ctaTupleIP    = 1
	ctaTupleProto = 2

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3

	ctaProtoInfoTCP      = 1
	ctaProtoInfoTCPState = 1

	ctaTimestampStart = 1

	ipsSeenReply = 1 << 1
	ipsAssured   = 1 << 2
	ipsDstNAT    = 1 << 5

	nlaTypeMask = 0x3fff // without NLA_F_NESTED and NLA_F_NET_BYTEORDER
	nlaFNested  = 1 << 15
)

// tcpStates are conntrack's TCP states (enum tcp_conntrack), as
// conntrack -L prints them.
var tcpStates = [...]string{"NONE", "SYN_SENT", "SYN_RECV", "ESTABLISHED", "FIN_WAIT", "CLOSE_WAIT", "LAST_ACK", "TIME_WAIT", "CLOSE", "SYN_SENT2"}

// ctEntry is what the audit needs of one conntrack entry.
type ctEntry struct {
	proto             uint8
	origSrc, origDst  netip.AddrPort
	replySrc          netip.AddrPort
	status            uint32
	tcpState          uint8
	hasTCPState       bool
	start             uint64 // ns since the epoch; 0 without timestamps
	timeout           uint32 // seconds left before the entry expires (CTA_TIMEOUT)
	hasTimeout        bool
	id                uint32 // CTA_ID: a delete names it, so that a new flow on the same tuple is not deleted
	family            uint8
	hasOrig, hasReply bool
}

var errCTShort = errors.New("conntrack: truncated attribute")

// ctAttr encodes one netlink attribute, padded to four bytes.
func ctAttr(typ uint16, val []byte) []byte {
	b := make([]byte, 4, 4+len(val)+3)
	binary.NativeEndian.PutUint16(b, uint16(4+len(val)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	b = append(b, val...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// ctNested encodes a nested attribute holding attrs.
func ctNested(typ uint16, attrs ...[]byte) []byte {
	var v []byte
	for _, a := range attrs {
		v = append(v, a...)
	}
	return ctAttr(typ|nlaFNested, v)
}

func be16(v uint16) []byte { return binary.BigEndian.AppendUint16(nil, v) }

// nla walks netlink attributes without allocating: it returns the first
// attribute's type and value and the rest.
func nla(b []byte) (typ uint16, val, rest []byte, err error) {
	if len(b) < 4 {
		return 0, nil, nil, errCTShort
	}
	l := int(binary.NativeEndian.Uint16(b))
	if l < 4 || l > len(b) {
		return 0, nil, nil, fmt.Errorf("conntrack: attribute length %d of %d bytes", l, len(b))
	}
	typ = binary.NativeEndian.Uint16(b[2:]) & nlaTypeMask
	val = b[4:l]
	next := (l + 3) &^ 3
	if next > len(b) {
		next = len(b)
	}
	return typ, val, b[next:], nil
}

// decodeCT decodes one IPCTNL_MSG_CT_NEW message body (nfgenmsg, then
// attributes) into e, which it resets. Unknown attributes are skipped;
// a malformed one is an error, never a panic.
func decodeCT(body []byte, e *ctEntry) error {
	*e = ctEntry{}
	if len(body) < 4 {
		return errCTShort
	}
	e.family = body[0]
	for b := body[4:]; len(b) > 0; {
		typ, val, rest, err := nla(b)
		if err != nil {
			return err
		}
		b = rest
		switch typ {
		case ctaTupleOrig:
			var src, dst netip.AddrPort
			if e.proto, src, dst, err = decodeTuple(val); err != nil {
				return err
			}
			e.origSrc, e.origDst, e.hasOrig = src, dst, true
		case ctaTupleReply:
			var src netip.AddrPort
			if _, src, _, err = decodeTuple(val); err != nil {
				return err
			}
			e.replySrc, e.hasReply = src, true
		case ctaStatus:
			if len(val) < 4 {
				return errCTShort
			}
			e.status = binary.BigEndian.Uint32(val)
		case ctaID:
			if len(val) < 4 {
				return errCTShort
			}
			e.id = binary.BigEndian.Uint32(val)
		case ctaTimeout:
			if len(val) < 4 {
				return errCTShort
			}
			e.timeout, e.hasTimeout = binary.BigEndian.Uint32(val), true
		case ctaProtoInfo:
			if err := decodeProtoInfo(val, e); err != nil {
				return err
			}
		case ctaTimestamp:
			for t := val; len(t) > 0; {
				typ, v, rest, err := nla(t)
				if err != nil {
					return err
				}
				t = rest
				if typ == ctaTimestampStart && len(v) >= 8 {
					e.start = binary.BigEndian.Uint64(v)
				}
			}
		}
	}
	if !e.hasOrig || !e.hasReply {
		return errors.New("conntrack: entry without both tuples")
	}
	return nil
}

func decodeTuple(b []byte) (proto uint8, src, dst netip.AddrPort, err error) {
	var sip, dip netip.Addr
	var sport, dport uint16
	for len(b) > 0 {
		typ, val, rest, err := nla(b)
		if err != nil {
			return 0, src, dst, err
		}
		b = rest
		switch typ {
		case ctaTupleIP:
			for ip := val; len(ip) > 0; {
				typ, v, rest, err := nla(ip)
				if err != nil {
					return 0, src, dst, err
				}
				ip = rest
				switch {
				case (typ == ctaIPv4Src || typ == ctaIPv4Dst) && len(v) == 4:
					a := netip.AddrFrom4([4]byte(v))
					if typ == ctaIPv4Src {
						sip = a
					} else {
						dip = a
					}
				case (typ == ctaIPv6Src || typ == ctaIPv6Dst) && len(v) == 16:
					a := netip.AddrFrom16([16]byte(v))
					if typ == ctaIPv6Src {
						sip = a
					} else {
						dip = a
					}
				}
			}
		case ctaTupleProto:
			for p := val; len(p) > 0; {
				typ, v, rest, err := nla(p)
				if err != nil {
					return 0, src, dst, err
				}
				p = rest
				switch {
				case typ == ctaProtoNum && len(v) >= 1:
					proto = v[0]
				case typ == ctaProtoSrcPort && len(v) >= 2:
					sport = binary.BigEndian.Uint16(v)
				case typ == ctaProtoDstPort && len(v) >= 2:
					dport = binary.BigEndian.Uint16(v)
				}
			}
		}
	}
	if !sip.IsValid() || !dip.IsValid() {
		return 0, src, dst, errors.New("conntrack: tuple without addresses")
	}
	return proto, netip.AddrPortFrom(sip, sport), netip.AddrPortFrom(dip, dport), nil
}

func decodeProtoInfo(b []byte, e *ctEntry) error {
	for len(b) > 0 {
		typ, val, rest, err := nla(b)
		if err != nil {
			return err
		}
		b = rest
		if typ != ctaProtoInfoTCP {
			continue
		}
		for t := val; len(t) > 0; {
			typ, v, rest, err := nla(t)
			if err != nil {
				return err
			}
			t = rest
			if typ == ctaProtoInfoTCPState && len(v) >= 1 {
				e.tcpState, e.hasTCPState = v[0], true
			}
		}
	}
	return nil
}

// countInto decodes each entry body a dump hands it and counts it in c:
// the reader's path, which the tests and the fuzz target take too. With
// timeouts, each entry's last packet is dated from its remaining timeout
// as of now.
func countInto(c *Counter, now time.Time, timeouts *ctTimeouts) func(body []byte) error {
	return func(body []byte) error {
		var e ctEntry
		if err := decodeCT(body, &e); err != nil {
			return err
		}
		ce := e.entry()
		if timeouts != nil {
			ce.LastPacket = e.lastPacket(now, timeouts)
		}
		c.Add(&ce)
		return nil
	}
}

// entry is the decoded entry as the audit counts it.
func (e *ctEntry) entry() Entry {
	out := Entry{Proto: e.proto, OrigSrc: e.origSrc, OrigDst: e.origDst, ReplySrc: e.replySrc,
		DstNAT: e.status&ipsDstNAT != 0, SeenReply: e.status&ipsSeenReply != 0}
	if e.hasTCPState {
		out.TCPState = "UNKNOWN"
		if int(e.tcpState) < len(tcpStates) {
			out.TCPState = tcpStates[e.tcpState]
		}
	}
	if e.start != 0 {
		out.Start = time.Unix(0, int64(e.start))
	}
	return out
}

// ctTimeouts are the node's conntrack timeouts (the
// net.netfilter.nf_conntrack_*timeout* sysctls), in seconds: what the
// kernel sets an entry's timeout to at each packet.
type ctTimeouts struct {
	udp, udpStream          uint32
	tcp                     [len(tcpStates)]uint32
	tcpMaxRetrans, tcpUnack uint32
}

// defaultCTTimeouts are the kernel's defaults (Linux 6.x), used for a
// sysctl that cannot be read.
var defaultCTTimeouts = ctTimeouts{udp: 30, udpStream: 120,
	// NONE, SYN_SENT, SYN_RECV, ESTABLISHED, FIN_WAIT, CLOSE_WAIT,
	// LAST_ACK, TIME_WAIT, CLOSE, SYN_SENT2
	tcp:           [len(tcpStates)]uint32{0, 120, 60, 432000, 120, 60, 30, 120, 10, 120},
	tcpMaxRetrans: 300, tcpUnack: 300}

// lastPacket dates the entry's last packet: the kernel sets its timeout
// to the state's at each packet and counts it down, so the last packet
// was (state's timeout − remaining) ago. Where more than one timeout can
// apply (an ESTABLISHED connection with data unacknowledged or
// retransmitted gets 300 s instead of days), the shortest one not below
// what remains is taken: the latest
// the last packet can have been, so that doubt makes an entry look
// live, never dying; so does the second the kernel's count rounds away.
// Zero: unknown (no timeout in the dump, or a state without a known
// timeout). The kernel does not refresh a SYN_SENT entry when the SYN is
// sent again (Linux 6.18 here): a connection attempt is dated by its first
// SYN.
func (e *ctEntry) lastPacket(now time.Time, to *ctTimeouts) time.Time {
	if !e.hasTimeout {
		return time.Time{}
	}
	var cands []uint32
	switch e.proto {
	case 17:
		// Assured (replied, and still going two seconds on): every
		// packet sets the stream timeout; before, the short one.
		cands = []uint32{to.udp}
		if e.status&ipsAssured != 0 {
			cands = []uint32{to.udpStream}
		}
	case 6:
		if !e.hasTCPState || int(e.tcpState) >= len(to.tcp) || to.tcp[e.tcpState] == 0 {
			return time.Time{}
		}
		st := to.tcp[e.tcpState]
		cands = []uint32{st}
		if st > to.tcpMaxRetrans {
			cands = append(cands, to.tcpMaxRetrans)
		}
		if st > to.tcpUnack {
			cands = append(cands, to.tcpUnack)
		}
	default:
		return time.Time{}
	}
	best := uint32(0)
	for _, t := range cands {
		if t >= e.timeout && (best == 0 || t < best) {
			best = t
		}
	}
	if best == 0 {
		// More left than any timeout the sysctls say (changed since the
		// packet): the packet is now.
		return now
	}
	// The kernel rounds what remains down to the second: the packet may
	// be up to a second later than the count says.
	elapsed := best - e.timeout
	if elapsed > 0 {
		elapsed--
	}
	return now.Add(-time.Duration(elapsed) * time.Second)
}

// FlushTarget is one pair a flush deletes the entries of: flows whose
// original destination is Frontend (a node port: on any of the node's
// addresses) and whose DNAT destination is Dest. UDP entries always; TCP
// entries only with TCP, and then only connection attempts the
// destination never answered (SYN_SENT): an answered connection is never
// deleted, whatever the aggregator asks.
type FlushTarget struct {
	Frontend audit.FrontendKey
	Dest     netip.AddrPort
	TCP      bool
	// Explicit, for a node port, are the node's frontends that are not
	// node ports: a flow to one of them (an external or load-balancer IP
	// that is one of the node's addresses, on the node port's port) is
	// that frontend's — kube-proxy's KUBE-SERVICES matches it before
	// KUBE-NODEPORTS — and never the node port's to delete.
	Explicit map[audit.FrontendKey]bool
}

// matches says whether the decoded entry is one of t's.
func (t *FlushTarget) matches(e *ctEntry, local func(netip.Addr) bool) bool {
	if e.status&ipsDstNAT == 0 || e.replySrc.Addr().Unmap() != t.Dest.Addr().Unmap() || e.replySrc.Port() != t.Dest.Port() {
		return false
	}
	proto, ok := audit.ProtocolName(e.proto)
	if !ok || proto != t.Frontend.Protocol {
		return false
	}
	switch proto {
	case "UDP":
	case "TCP":
		// tcp_conntrack: 1 SYN_SENT, 9 SYN_SENT2 (simultaneous open), and
		// never a reply: nothing answered, nothing to cut.
		if !t.TCP || !e.hasTCPState || (e.tcpState != 1 && e.tcpState != 9) || e.status&ipsSeenReply != 0 {
			return false
		}
	default:
		return false
	}
	dst := e.origDst.Addr().Unmap()
	if t.Frontend.NodePort {
		return e.origDst.Port() == t.Frontend.Port && dst.Is4() == (t.Frontend.Family() == 4) && local != nil && local(dst) &&
			!t.Explicit[audit.FrontendKey{IP: dst, Protocol: proto, Port: t.Frontend.Port}]
	}
	return dst == t.Frontend.IP.Unmap() && e.origDst.Port() == t.Frontend.Port
}
