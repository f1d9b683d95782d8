package nl

import "golang.org/x/sys/unix"

// What the nf_tables decoders of iptables-nft and nftables mode share.

// Attributes golang.org/x/sys does not name (linux/netfilter/nf_tables.h).
const (
	NFTASetHandle   = 16 // NFTA_SET_HANDLE
	NFTATableHandle = 4  // NFTA_TABLE_HANDLE
)

// DataValue reads an nft_data: a value (NFTA_DATA_VALUE), or a verdict
// (NFTA_DATA_VERDICT) and the chain of a goto or jump.
func DataValue(b []byte) (value []byte, target string, verdict bool, err error) {
	a := Walk(b)
	for a.Next() {
		switch a.Type {
		case unix.NFTA_DATA_VALUE:
			value = a.Val
		case unix.NFTA_DATA_VERDICT:
			verdict = true
			v := Walk(a.Val)
			var code uint32
			var chain string
			for v.Next() {
				switch v.Type {
				case unix.NFTA_VERDICT_CODE:
					code = v.U32()
				case unix.NFTA_VERDICT_CHAIN:
					chain = v.Str()
				}
			}
			if v.Err != nil {
				return nil, "", false, v.Err
			}
			if int32(code) == unix.NFT_GOTO || int32(code) == unix.NFT_JUMP {
				target = chain
			}
		}
	}
	return value, target, verdict, a.Err
}

// The expressions both iptables-nft's and nftables mode's decoders read
// the same way; what each makes of them is its own.

// NAT is a nat expression: its type (NFT_NAT_DNAT, ...), the registers
// its address and port ranges are loaded in (0: none), and its flags.
type NAT struct {
	Type                     uint32
	RegAddrMin, RegAddrMax   uint32
	RegProtoMin, RegProtoMax uint32
	Flags                    uint32
}

// DecodeNAT reads a nat expression's data.
func DecodeNAT(b []byte) (NAT, error) {
	var n NAT
	a := Walk(b)
	for a.Next() {
		switch a.Type {
		case unix.NFTA_NAT_TYPE:
			n.Type = a.U32()
		case unix.NFTA_NAT_REG_ADDR_MIN:
			n.RegAddrMin = a.U32()
		case unix.NFTA_NAT_REG_ADDR_MAX:
			n.RegAddrMax = a.U32()
		case unix.NFTA_NAT_REG_PROTO_MIN:
			n.RegProtoMin = a.U32()
		case unix.NFTA_NAT_REG_PROTO_MAX:
			n.RegProtoMax = a.U32()
		case unix.NFTA_NAT_FLAGS:
			n.Flags = a.U32()
		}
	}
	return n, a.Err
}

// DecodeImmediate reads an immediate expression's data: the register it
// loads (NFT_REG_VERDICT: a verdict) and what (an nft_data).
func DecodeImmediate(b []byte) (dreg uint32, data []byte, err error) {
	a := Walk(b)
	for a.Next() {
		switch a.Type {
		case unix.NFTA_IMMEDIATE_DREG:
			dreg = a.U32()
		case unix.NFTA_IMMEDIATE_DATA:
			data = a.Val
		}
	}
	return dreg, data, a.Err
}

// DataVerdict reads an nft_data holding a verdict: its code (NF_ACCEPT,
// NFT_JUMP, ...) and, for a jump or goto, the chain; ok is false when it
// holds none.
func DataVerdict(b []byte) (code int32, chain string, ok bool, err error) {
	v := Walk(b)
	for v.Next() {
		if v.Type != unix.NFTA_DATA_VERDICT {
			continue
		}
		ok = true
		va := Walk(v.Val)
		for va.Next() {
			switch va.Type {
			case unix.NFTA_VERDICT_CODE:
				code = int32(va.U32())
			case unix.NFTA_VERDICT_CHAIN:
				chain = va.Str()
			}
		}
		if va.Err != nil {
			return 0, "", false, va.Err
		}
	}
	return code, chain, ok, v.Err
}
