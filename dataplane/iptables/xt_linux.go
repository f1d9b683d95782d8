package iptables

import (
	"bytes"
	"encoding/binary"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// xt reads an xtables match or target: its name, revision and the
// legacy struct it carries.
func (d *iptDecoder) xt(b []byte, target bool) error {
	a := nl.Walk(b)
	var name, info []byte
	var rev uint32
	for a.Next() {
		switch a.Type {
		case unix.NFTA_MATCH_NAME: // = NFTA_TARGET_NAME
			name = nl.CStr(a.Val)
		case unix.NFTA_MATCH_REV:
			rev = a.U32()
		case unix.NFTA_MATCH_INFO:
			info = a.Val
		}
	}
	if a.Err != nil {
		return a.Err
	}
	if target {
		d.r.Jump = targetName(name)
		if string(name) == "DNAT" {
			return d.dnat(rev, info)
		}
		return nil
	}
	return d.match(name, info)
}

// targetName is a target's name as a string, the common ones without an
// allocation each.
func targetName(name []byte) string {
	for _, s := range []string{"DNAT", "MARK", "MASQUERADE", "SNAT", "REJECT", "RETURN", "ACCEPT", "DROP"} {
		if string(name) == s {
			return s
		}
	}
	return string(name)
}

// match reads an xtables match's payload (the same struct in an
// iptables-nft rule and a legacy entry).
func (d *iptDecoder) match(name, info []byte) error {
	switch string(name) {
	case "comment":
		d.r.Comment, d.hasComment = cString(info[:min(len(info), xtCommentLen)]), true
	case "tcp", "udp":
		// struct xt_tcp / xt_udp: u16 spts[2], dpts[2] (host order), then
		// (tcp) option, flg_mask, flg_cmp, invflags / (udp) invflags.
		if len(info) < 8 {
			return d.other("%s match of %d bytes", name, len(info))
		}
		lo, hi := binary.NativeEndian.Uint16(info[4:]), binary.NativeEndian.Uint16(info[6:])
		return d.port(string(name), lo, hi)
	case "sctp":
		// struct xt_sctp_info: u16 dpts[2], spts[2], chunkmap[64] (u32),
		// chunk_match_type, flag_info[4] (3 bytes each), flag_count,
		// flags, invflags.
		if len(info) < 288 {
			return d.other("sctp match of %d bytes", len(info))
		}
		if binary.NativeEndian.Uint32(info[284:])&xtSCTPDestPorts == 0 {
			return nil
		}
		return d.port("sctp", binary.NativeEndian.Uint16(info[0:]), binary.NativeEndian.Uint16(info[2:]))
	case "addrtype":
		// rev 0: u16 source, dest, u32 invert_source, invert_dest;
		// rev 1: u16 source, dest, u32 flags. A source type is a condition.
		if len(info) < 4 {
			return d.other("addrtype match of %d bytes", len(info))
		}
		if binary.NativeEndian.Uint16(info) != 0 {
			d.r.Cond = true
		}
	case "statistic", "recent", "nfacct", "mark", "conntrack", "state", "limit", "multiport", "connmark", "pkttype", "physdev", "set", "mac":
		// Matches whose options the text parser skips.
	default:
		return d.other("match %q", clip(name))
	}
	return nil
}

// port records a tcp, udp or sctp match's destination port as iptables-
// save prints it: nothing for any port, "--dport N" (negated or not) for
// one, a range the text parser refuses.
func (d *iptDecoder) port(name string, lo, hi uint16) error {
	switch {
	case lo == 0 && hi == 0xffff:
	case lo == hi:
		d.r.DPort, d.r.HasDPort = lo, true
	default:
		return d.other("%s match of ports %d:%d", name, lo, hi)
	}
	return nil
}

// dnat reads the DNAT target's range: revision 0 (IPv4's
// nf_nat_ipv4_multi_range_compat), 1 (nf_nat_range) or 2 (nf_nat_range2).
// Only one address and one port is what the text parser reads; anything
// else (a range, no port, an offset) is undecodable, as the text parser
// refuses it too.
func (d *iptDecoder) dnat(rev uint32, info []byte) error {
	var flags uint32
	var minIP, maxIP []byte
	var minPort, maxPort uint16
	switch rev {
	case 0:
		if d.fam != 4 || len(info) < 20 || binary.NativeEndian.Uint32(info) != 1 {
			return undecodable("DNAT revision 0 of %d bytes", len(info))
		}
		flags = binary.NativeEndian.Uint32(info[4:])
		minIP, maxIP = info[8:12], info[12:16]
		minPort, maxPort = binary.BigEndian.Uint16(info[16:]), binary.BigEndian.Uint16(info[18:])
	case 1, 2:
		if len(info) < 40 {
			return undecodable("DNAT revision %d of %d bytes", rev, len(info))
		}
		flags = binary.NativeEndian.Uint32(info)
		n := nl.AddrLen(d.fam)
		minIP, maxIP = info[4:4+n], info[20:20+n]
		minPort, maxPort = binary.BigEndian.Uint16(info[36:]), binary.BigEndian.Uint16(info[38:])
	default:
		return undecodable("DNAT revision %d", rev)
	}
	if flags&nfNATRangeMapIPs == 0 || flags&nfNATRangeProto == 0 || flags&^(nfNATRangeMapIPs|nfNATRangeProto|nfNATRangeRandom|nfNATRangePersist|nfNATRangeFully) != 0 ||
		!bytes.Equal(minIP, maxIP) || minPort != maxPort {
		return undecodable("a DNAT to other than one address and port (flags %#x)", flags)
	}
	ip, _ := netip.AddrFromSlice(minIP)
	d.r.DNAT = netip.AddrPortFrom(ip.Unmap(), minPort)
	return nil
}
