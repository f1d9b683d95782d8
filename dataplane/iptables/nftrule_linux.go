package iptables

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// This file decodes iptables-nft's rules as the kernel's nf_tables netlink
// messages hold them into what the audit reads (Rule): exactly
// what the text parser takes from the same rule as iptables-save prints
// it. iptables-nft writes addresses, protocols and ports as native
// expressions (payload or meta loads, bitwise masks, cmp), verdicts as
// immediates, and everything else as xtables extensions whose payload is
// the legacy struct (match: comment, tcp, udp, sctp, addrtype, ...;
// target: DNAT with its nf_nat_range2, MARK, MASQUERADE, ...).
//
// The decoder is strict where the model depends on the rule: in the
// dispatch chains (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-EXT-*, KUBE-FW-*)
// any expression it does not know is an ErrUndecodable, and the reader
// then reads that family with iptables-save instead: never a rule read
// wrong or dropped silently. Endpoint and policy chains are read for
// their DNAT targets and jumps only; chains the audit does not read are
// not decoded at all. Pure and fuzzed.

// ErrUndecodable is a rule the netlink decoder does not understand well
// enough to say what iptables-save would print for it.
var ErrUndecodable = errors.New("a rule the netlink decoder cannot read")

// undecodable wraps ErrUndecodable with what was not understood.
func undecodable(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrUndecodable, fmt.Sprintf(format, args...))
}

// NFTRule is one decoded rule message.
type NFTRule struct {
	// Table and Chain point into the message: a dump's rules are compared
	// with the chain being read, not each copied.
	Table, Chain []byte
	Handle       uint64
	// Position is the handle of the rule this one follows (set in a
	// notification of a rule inserted after another).
	Position    uint64
	HasPosition bool
	// Skipped: a chain the audit does not read (rule not decoded).
	Skipped bool
	Rule    Rule
}

// Attributes golang.org/x/sys does not name.
const (
	nftaRuleUserdata  = 7   // NFTA_RULE_USERDATA
	udataTypeComment  = 0   // iptables-nft's UDATA_TYPE_COMMENT
	xtCommentLen      = 256 // XT_MAX_COMMENT_LEN
	nfNATRangeMapIPs  = 1 << 0
	nfNATRangeProto   = 1 << 1
	nfNATRangeRandom  = 1 << 2
	nfNATRangePersist = 1 << 3
	nfNATRangeFully   = 1 << 4
	xtTCPInvDstPort   = 0x02 // XT_TCP_INV_DSTPT, XT_UDP_INV_DSTPT
	xtSCTPDestPorts   = 0x02 // XT_SCTP_DEST_PORTS
	nfDrop            = 0    // NF_DROP
	nfAccept          = 1    // NF_ACCEPT
)

// DecodeNFTRule reads one NFT_MSG_NEWRULE body of an iptables-nft
// table of family fam (4, 6). A rule of a chain the audit does not read
// comes back skipped, its expressions not looked at.
func DecodeNFTRule(data []byte, fam int) (NFTRule, error) {
	var out NFTRule
	a, err := nl.Body(data, "rule")
	if err != nil {
		return out, err
	}
	var exprs, udata []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_RULE_TABLE:
			out.Table = nl.CStr(a.Val)
		case unix.NFTA_RULE_CHAIN:
			out.Chain = nl.CStr(a.Val)
		case unix.NFTA_RULE_HANDLE:
			out.Handle = a.U64()
		case unix.NFTA_RULE_POSITION:
			out.Position, out.HasPosition = a.U64(), true
		case unix.NFTA_RULE_EXPRESSIONS:
			exprs = a.Val
		case nftaRuleUserdata:
			udata = a.Val
		}
	}
	if a.Err != nil {
		return out, fmt.Errorf("nf_tables rule in chain %q: %w", clip(out.Chain), a.Err)
	}
	if !Reads(string(out.Chain)) {
		out.Skipped = true
		return out, nil
	}
	d := iptDecoder{fam: fam, strict: strictChain(out.Chain)}
	list := nl.Walk(exprs)
	n := 0
	for list.Next() {
		if n++; n > nl.MaxRuleExprs {
			return out, fmt.Errorf("nf_tables rule in chain %q: more than %d expressions", clip(out.Chain), nl.MaxRuleExprs)
		}
		if err := d.expr(list.Val); err != nil {
			return out, fmt.Errorf("rule %d in chain %s: %w", out.Handle, clip(out.Chain), err)
		}
	}
	if list.Err != nil {
		return out, fmt.Errorf("nf_tables rule in chain %q: %w", clip(out.Chain), list.Err)
	}
	if d.r.Comment == "" && !d.hasComment {
		d.r.Comment = udataComment(udata)
	}
	if d.r.HasDPort && d.r.Proto == "" {
		// iptables-save prints a port only under -p tcp/udp/sctp.
		return out, fmt.Errorf("rule %d in chain %s: %w", out.Handle, clip(out.Chain), undecodable("a destination port without a protocol"))
	}
	out.Rule = d.r
	return out, nil
}

// strictChain: the dispatch chains, whose every match the model depends
// on.
func strictChain(chain []byte) bool {
	return string(chain) == "KUBE-SERVICES" || string(chain) == "KUBE-NODEPORTS" ||
		bytes.HasPrefix(chain, []byte("KUBE-EXT-")) || bytes.HasPrefix(chain, []byte("KUBE-FW-"))
}

// udataComment reads iptables-nft's comment from a rule's user data
// (newer iptables keeps comments there instead of an xt comment match).
func udataComment(b []byte) string {
	for len(b) >= 2 {
		typ, l := b[0], int(b[1])
		if 2+l > len(b) {
			return ""
		}
		if typ == udataTypeComment {
			return cString(b[2 : 2+l])
		}
		b = b[2+l:]
	}
	return ""
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// regSource is what a register holds.
type regSource uint8

const (
	regNone regSource = iota
	regProto
	regSaddr
	regDaddr
	regDport
	regSport
	regIgnored // an interface name or the mark: iptables-save prints what the parser skips
	regData    // an immediate value (a native DNAT's address or port)
	regOther
)

type regState struct {
	src    regSource
	length int    // bytes loaded (an address prefix loads fewer)
	mask   []byte // from a bitwise
	data   []byte // regData
}

// iptDecoder decodes one rule's expressions in order.
type iptDecoder struct {
	fam        int
	strict     bool
	r          Rule
	hasComment bool
	regs       [32]regState
}

func (d *iptDecoder) reg(n uint32) *regState {
	if n >= uint32(len(d.regs)) {
		return &regState{} // the kernel refuses such registers; a fuzzed one reads as empty
	}
	return &d.regs[n]
}

// other is an expression the decoder does not map: refused where the
// rule matters, ignored elsewhere.
func (d *iptDecoder) other(format string, args ...any) error {
	if d.strict {
		return undecodable(format, args...)
	}
	return nil
}

func (d *iptDecoder) expr(b []byte) error {
	a := nl.Walk(b)
	var name, data []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_EXPR_NAME:
			name = nl.CStr(a.Val)
		case unix.NFTA_EXPR_DATA:
			data = a.Val
		}
	}
	if a.Err != nil {
		return a.Err
	}
	switch string(name) {
	case "counter":
		return nil
	case "payload":
		return d.payload(data)
	case "meta":
		return d.meta(data)
	case "bitwise":
		return d.bitwise(data)
	case "cmp":
		return d.cmp(data)
	case "immediate":
		return d.immediate(data)
	case "match":
		return d.xt(data, false)
	case "target":
		return d.xt(data, true)
	case "nat":
		return d.nat(data)
	case "masq":
		d.r.Jump = "MASQUERADE"
		return nil
	}
	return d.other("expression %q", clip(name))
}

// payload: addresses, the protocol (IPv4's header field) and ports.
func (d *iptDecoder) payload(b []byte) error {
	a := nl.Walk(b)
	var dreg, base, off, l uint32
	for a.Next() {
		switch a.Type {
		case unix.NFTA_PAYLOAD_DREG:
			dreg = a.U32()
		case unix.NFTA_PAYLOAD_BASE:
			base = a.U32()
		case unix.NFTA_PAYLOAD_OFFSET:
			off = a.U32()
		case unix.NFTA_PAYLOAD_LEN:
			l = a.U32()
		}
	}
	if a.Err != nil {
		return a.Err
	}
	src := regOther
	saddr, daddr, alen := uint32(12), uint32(16), uint32(4)
	if d.fam == 6 {
		saddr, daddr, alen = 8, 24, 16
	}
	switch {
	case base == unix.NFT_PAYLOAD_NETWORK_HEADER && off == saddr && l >= 1 && l <= alen:
		src = regSaddr
	case base == unix.NFT_PAYLOAD_NETWORK_HEADER && off == daddr && l >= 1 && l <= alen:
		src = regDaddr
	case base == unix.NFT_PAYLOAD_NETWORK_HEADER && d.fam == 4 && off == 9 && l == 1:
		src = regProto
	case base == unix.NFT_PAYLOAD_TRANSPORT_HEADER && off == 2 && l == 2:
		src = regDport
	case base == unix.NFT_PAYLOAD_TRANSPORT_HEADER && off == 0 && l == 2:
		src = regSport
	}
	*d.reg(dreg) = regState{src: src, length: int(l)}
	return nil
}

// meta: the layer-4 protocol, interfaces and the mark.
func (d *iptDecoder) meta(b []byte) error {
	a := nl.Walk(b)
	var dreg, key uint32
	hasDreg := false
	for a.Next() {
		switch a.Type {
		case unix.NFTA_META_DREG:
			dreg, hasDreg = a.U32(), true
		case unix.NFTA_META_KEY:
			key = a.U32()
		}
	}
	if a.Err != nil {
		return a.Err
	}
	if !hasDreg {
		// A meta set (MARK's native form): no match.
		return nil
	}
	src := regOther
	switch key {
	case unix.NFT_META_L4PROTO:
		src = regProto
	case unix.NFT_META_IIFNAME, unix.NFT_META_OIFNAME, unix.NFT_META_MARK:
		src = regIgnored
	}
	*d.reg(dreg) = regState{src: src, length: 4}
	return nil
}

// bitwise: an address prefix's mask (or the mark's).
func (d *iptDecoder) bitwise(b []byte) error {
	a := nl.Walk(b)
	var sreg, dreg uint32
	var mask []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_BITWISE_SREG:
			sreg = a.U32()
		case unix.NFTA_BITWISE_DREG:
			dreg = a.U32()
		case unix.NFTA_BITWISE_MASK:
			v, _, _, err := nl.DataValue(a.Val)
			if err != nil {
				return err
			}
			mask = v
		}
	}
	if a.Err != nil {
		return a.Err
	}
	s := *d.reg(sreg)
	switch s.src {
	case regSaddr, regDaddr, regIgnored:
		s.mask = mask
	default:
		s.src = regOther
	}
	*d.reg(dreg) = s
	return nil
}

// cmp: what a match compares a loaded value with.
func (d *iptDecoder) cmp(b []byte) error {
	a := nl.Walk(b)
	var sreg, op uint32
	var value []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_CMP_SREG:
			sreg = a.U32()
		case unix.NFTA_CMP_OP:
			op = a.U32()
		case unix.NFTA_CMP_DATA:
			v, _, _, err := nl.DataValue(a.Val)
			if err != nil {
				return err
			}
			value = v
		}
	}
	if a.Err != nil {
		return a.Err
	}
	s := d.reg(sreg)
	if op != unix.NFT_CMP_EQ && op != unix.NFT_CMP_NEQ {
		switch s.src {
		case regSaddr, regIgnored, regSport:
		default:
			// A port range (--dport a:b): iptables-save prints what the
			// text parser refuses.
			return d.other("cmp op %d on a %s", op, sourceName(s.src))
		}
	}
	neg := op == unix.NFT_CMP_NEQ
	switch s.src {
	case regProto:
		if len(value) < 1 {
			return d.other("a protocol of %d bytes", len(value))
		}
		// iptables-save prints a negated protocol as "! -p tcp"; the text
		// parser takes the protocol all the same.
		proto, ok := audit.ProtocolName(value[0])
		if !ok {
			return d.other("protocol %d", value[0])
		}
		d.r.Proto = proto
	case regSaddr:
		d.r.Cond = true
	case regDaddr:
		full := s.length == nl.AddrLen(d.fam) && (s.mask == nil || allOnes(s.mask))
		if neg || !full {
			d.r.Cond = true
			return nil
		}
		ip, ok := netip.AddrFromSlice(value)
		if !ok || len(value) != nl.AddrLen(d.fam) {
			return d.other("a destination of %d bytes", len(value))
		}
		d.r.Dst = ip.Unmap()
	case regDport:
		if len(value) != 2 {
			return d.other("a port of %d bytes", len(value))
		}
		// "! --dport 80" reads as port 80 in the text parser too.
		d.r.DPort, d.r.HasDPort = binary.BigEndian.Uint16(value), true
	case regSport, regIgnored:
	case regData:
		return d.other("a comparison with an immediate")
	default:
		return d.other("a comparison of a %s", sourceName(s.src))
	}
	return nil
}

func sourceName(s regSource) string {
	switch s {
	case regProto:
		return "protocol"
	case regSaddr:
		return "source address"
	case regDaddr:
		return "destination address"
	case regDport:
		return "destination port"
	case regSport:
		return "source port"
	case regNone:
		return "register never loaded"
	}
	return "value the decoder does not know"
}

func allOnes(b []byte) bool {
	for _, c := range b {
		if c != 0xff {
			return false
		}
	}
	return true
}
