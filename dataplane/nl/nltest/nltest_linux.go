// Package nltest builds nf_tables netlink messages for the decoders'
// tests (iptables-nft's and nftables mode's): a rule of chosen
// expressions, as the kernel would send it.
package nltest

import (
	"encoding/binary"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// RuleMsg builds an NFT_MSG_NEWRULE body (nfgenmsg header of family fam,
// NFPROTO_*) of table and chain with the given expressions.
func RuleMsg(fam byte, table, chain string, exprs ...[]netlink.Attribute) []byte {
	var list []netlink.Attribute
	for _, e := range exprs {
		list = append(list, netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: Attrs(e...)})
	}
	body := Attrs(
		netlink.Attribute{Type: unix.NFTA_RULE_TABLE, Data: CString(table)},
		netlink.Attribute{Type: unix.NFTA_RULE_CHAIN, Data: CString(chain)},
		netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_RULE_EXPRESSIONS, Data: Attrs(list...)},
	)
	return append([]byte{fam, 0, 0, 0}, body...)
}

// Expr is one expression: its name and its data's attributes.
func Expr(name string, data []netlink.Attribute) []netlink.Attribute {
	return []netlink.Attribute{{Type: unix.NFTA_EXPR_NAME, Data: CString(name)}, {Type: unix.NLA_F_NESTED | unix.NFTA_EXPR_DATA, Data: Attrs(data...)}}
}

// BE32 is v in network order, as nf_tables attributes carry numbers.
func BE32(v uint32) []byte { return binary.BigEndian.AppendUint32(nil, v) }

// CString is s with its NUL.
func CString(s string) []byte { return append([]byte(s), 0) }

// Attrs marshals attributes; it panics on what netlink cannot encode (a
// test's mistake).
func Attrs(a ...netlink.Attribute) []byte {
	b, err := netlink.MarshalAttributes(a)
	if err != nil {
		panic(err)
	}
	return b
}

// Verdict is an immediate expression holding a verdict (code: NF_*, or
// NFT_JUMP/NFT_GOTO to chain) in register 0.
func Verdict(code int32, chain string) []netlink.Attribute {
	v := []netlink.Attribute{{Type: unix.NFTA_VERDICT_CODE, Data: BE32(uint32(code))}}
	if chain != "" {
		v = append(v, netlink.Attribute{Type: unix.NFTA_VERDICT_CHAIN, Data: CString(chain)})
	}
	return Expr("immediate", []netlink.Attribute{{Type: unix.NFTA_IMMEDIATE_DREG, Data: BE32(0)},
		{Type: unix.NLA_F_NESTED | unix.NFTA_IMMEDIATE_DATA, Data: Attrs(netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_DATA_VERDICT, Data: Attrs(v...)})}})
}

// ElemMsg builds an NFT_MSG_NEWSETELEM body of set with one element: key,
// and a goto to chain as its value.
func ElemMsg(set string, key []byte, chain string) []byte {
	gotoCode := int32(unix.NFT_GOTO)
	verdict := Attrs(netlink.Attribute{Type: unix.NFTA_VERDICT_CODE, Data: BE32(uint32(gotoCode))}, netlink.Attribute{Type: unix.NFTA_VERDICT_CHAIN, Data: CString(chain)})
	elem := Attrs(
		netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_KEY, Data: Attrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: key})},
		netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_DATA, Data: Attrs(netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_DATA_VERDICT, Data: verdict})},
	)
	body := Attrs(netlink.Attribute{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: CString(set)},
		netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_LIST_ELEMENTS, Data: Attrs(netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: elem})})
	return append([]byte{unix.NFPROTO_IPV4, 0, 0, 0}, body...)
}

// MsgType is nf_tables message type t as the kernel announces it.
func MsgType(t uint16) uint16 { return unix.NFNL_SUBSYS_NFTABLES<<8 | t }

// SetMsg builds an NFT_MSG_NEWSET (or DELSET) body.
func SetMsg(table, name string, handle uint64, flags uint32) []byte {
	body, _ := netlink.MarshalAttributes([]netlink.Attribute{
		{Type: unix.NFTA_SET_TABLE, Data: CString(table)},
		{Type: unix.NFTA_SET_NAME, Data: CString(name)},
		{Type: unix.NFTA_SET_FLAGS, Data: BE32(flags)},
		{Type: nftaSetHandle, Data: binary.BigEndian.AppendUint64(nil, handle)},
	})
	return append([]byte{unix.NFPROTO_IPV4, 0, 0, 0}, body...)
}

// SetElemMsg is ElemMsg for set of table.
func SetElemMsg(table, set string, key byte, chain string) []byte {
	m := ElemMsg("service-ips", []byte{key}, chain)
	head, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_SET_ELEM_LIST_TABLE, Data: CString(table)}})
	// ElemMsg names service-ips: rename by rebuilding its attributes.
	ad, _ := netlink.NewAttributeDecoder(m[4:])
	var rest []netlink.Attribute
	for ad.Next() {
		if ad.Type() == unix.NFTA_SET_ELEM_LIST_SET {
			rest = append(rest, netlink.Attribute{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: CString(set)})
			continue
		}
		rest = append(rest, netlink.Attribute{Type: ad.Type() | ad.TypeFlags(), Data: ad.Bytes()})
	}
	b, _ := netlink.MarshalAttributes(rest)
	return append(append([]byte{unix.NFPROTO_IPV4, 0, 0, 0}, head...), b...)
}

// TableMsg builds an NFT_MSG_NEWTABLE (or DELTABLE) body of ip.
func TableMsg(name string) []byte {
	b, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_TABLE_NAME, Data: CString(name)}})
	return append([]byte{unix.NFPROTO_IPV4, 0, 0, 0}, b...)
}

// GenMsg is an NFT_MSG_NEWGEN body without its attributes.
var GenMsg = []byte{unix.NFPROTO_UNSPEC, 0, 0, 0}

// nftaSetHandle is NFTA_SET_HANDLE, which golang.org/x/sys does not name.
const nftaSetHandle = 0x10

// NATRuleNote is a notification of a rule of KUBE-SERVICES in table nat:
// its handle, the rule it goes after (with hasPos), a jump.
func NATRuleNote(fam byte, handle, pos uint64, hasPos bool) []byte {
	jump := Verdict(unix.NFT_JUMP, "KUBE-SVC-AAAAAAAAAAAAAAAA")
	b, _ := netlink.MarshalAttributes(jump)
	list, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: b}})
	attrs := []netlink.Attribute{
		{Type: unix.NFTA_RULE_TABLE, Data: CString("nat")},
		{Type: unix.NFTA_RULE_CHAIN, Data: CString("KUBE-SERVICES")},
		{Type: unix.NFTA_RULE_HANDLE, Data: binary.BigEndian.AppendUint64(nil, handle)},
	}
	if hasPos {
		attrs = append(attrs, netlink.Attribute{Type: unix.NFTA_RULE_POSITION, Data: binary.BigEndian.AppendUint64(nil, pos)})
	}
	attrs = append(attrs, netlink.Attribute{Type: unix.NLA_F_NESTED | unix.NFTA_RULE_EXPRESSIONS, Data: list})
	body, _ := netlink.MarshalAttributes(attrs)
	return append([]byte{fam, 0, 0, 0}, body...)
}
