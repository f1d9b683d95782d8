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
