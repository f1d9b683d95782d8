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
	a := nl.Walk(b)
	var dreg uint32
	var data []byte
	for a.Next() {
		switch a.Type {
		case unix.NFTA_IMMEDIATE_DREG:
			dreg = a.U32()
		case unix.NFTA_IMMEDIATE_DATA:
			data = a.Val
		}
	}
	if a.Err != nil {
		return a.Err
	}
	if dreg != unix.NFT_REG_VERDICT {
		v, _, _, err := nl.DataValue(data)
		if err != nil {
			return err
		}
		*d.reg(dreg) = regState{src: regData, data: v}
		return nil
	}
	v := nl.Walk(data)
	for v.Next() {
		if v.Type != unix.NFTA_DATA_VERDICT {
			continue
		}
		va := nl.Walk(v.Val)
		var code int32
		var chain string
		for va.Next() {
			switch va.Type {
			case unix.NFTA_VERDICT_CODE:
				code = int32(va.U32())
			case unix.NFTA_VERDICT_CHAIN:
				chain = va.Str()
			}
		}
		if va.Err != nil {
			return va.Err
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
	}
	return v.Err
}

// nat: a DNAT in native form (loaded address and port).
func (d *iptDecoder) nat(b []byte) error {
	a := nl.Walk(b)
	var typ, regAddr, regAddrMax, regProto, regProtoMax, flags uint32
	for a.Next() {
		switch a.Type {
		case unix.NFTA_NAT_TYPE:
			typ = a.U32()
		case unix.NFTA_NAT_REG_ADDR_MIN:
			regAddr = a.U32()
		case unix.NFTA_NAT_REG_ADDR_MAX:
			regAddrMax = a.U32()
		case unix.NFTA_NAT_REG_PROTO_MIN:
			regProto = a.U32()
		case unix.NFTA_NAT_REG_PROTO_MAX:
			regProtoMax = a.U32()
		case unix.NFTA_NAT_FLAGS:
			flags = a.U32()
		}
	}
	if a.Err != nil {
		return a.Err
	}
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
