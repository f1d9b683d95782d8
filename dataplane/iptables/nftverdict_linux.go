// iptables-nft's verdicts and native DNAT in a rule message: immediates
// (a verdict, or a value a nat expression reads) and the nat expression.

package iptables

import (
	"encoding/binary"
	"net/netip"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// immediate: a verdict (jump, goto, accept, ...) or a value loaded for a
// native nat expression.
func (d *iptDecoder) immediate(b []byte) error {
	dreg, data, err := nl.DecodeImmediate(b)
	if err != nil {
		return err
	}
	if dreg != unix.NFT_REG_VERDICT {
		v, _, _, err := nl.DataValue(data)
		if err != nil {
			return err
		}
		*d.reg(dreg) = regState{src: regData, data: v}
		return nil
	}
	code, chain, ok, err := nl.DataVerdict(data)
	if err != nil || !ok {
		return err
	}
	switch code {
	case unix.NFT_JUMP:
		d.r.Jump, d.r.Goto = chain, false
	case unix.NFT_GOTO:
		d.r.Jump, d.r.Goto = chain, true
	case nfAccept:
		d.r.Jump = "ACCEPT"
	case nfDrop:
		d.r.Jump = "DROP"
	case unix.NFT_RETURN:
		d.r.Jump = "RETURN"
	case unix.NFT_CONTINUE:
	default:
		return d.other("verdict %d", code)
	}
	return nil
}

// nat: a DNAT in native form (loaded address and port).
func (d *iptDecoder) nat(b []byte) error {
	n, err := nl.DecodeNAT(b)
	if err != nil {
		return err
	}
	typ, regAddr, regAddrMax, regProto, regProtoMax, flags := n.Type, n.RegAddrMin, n.RegAddrMax, n.RegProtoMin, n.RegProtoMax, n.Flags
	if typ != unix.NFT_NAT_DNAT {
		d.r.Jump = "SNAT"
		return nil
	}
	d.r.Jump = "DNAT"
	addr, port := d.reg(regAddr), d.reg(regProto)
	if addr.src != regData || port.src != regData || (regAddrMax != 0 && regAddrMax != regAddr) || (regProtoMax != 0 && regProtoMax != regProto) ||
		flags&^(nfNATRangeMapIPs|nfNATRangeProto|nfNATRangeRandom|nfNATRangePersist|nfNATRangeFully) != 0 || len(port.data) < 2 {
		return undecodable("a DNAT to other than one address and port")
	}
	ip, ok := netip.AddrFromSlice(addr.data)
	if !ok || len(addr.data) != nl.AddrLen(d.fam) {
		return undecodable("a DNAT address of %d bytes", len(addr.data))
	}
	d.r.DNAT = netip.AddrPortFrom(ip.Unmap(), binary.BigEndian.Uint16(port.data))
	return nil
}
