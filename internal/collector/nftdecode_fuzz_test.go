//go:build linux

package collector

import (
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// ruleMsg builds an NFT_MSG_NEWRULE body of kube-proxy's table.
func ruleMsg(chain string, exprs ...[]netlink.Attribute) []byte {
	return nltest.RuleMsg(unix.NFPROTO_IPV4, "kube-proxy", chain, exprs...)
}

// The message builders nf_tables decoders' tests share.
var (
	exprAttr    = nltest.Expr
	be32        = nltest.BE32
	mustAttrs   = nltest.Attrs
	verdictExpr = nltest.Verdict
)

// nftGoto is NFT_GOTO (-4) as the kernel writes it.
var nftGoto = func() uint32 { v := int32(unix.NFT_GOTO); return uint32(v) }()

// elemMsg builds an NFT_MSG_NEWSETELEM body with one element.
func elemMsg(key []byte, chain string) []byte {
	kb, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_DATA_VALUE, Data: key}})
	vb, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_VERDICT_CODE, Data: be32(nftGoto)}, {Type: unix.NFTA_VERDICT_CHAIN, Data: cstring(chain)}})
	db, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NLA_F_NESTED | unix.NFTA_DATA_VERDICT, Data: vb}})
	eb, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_KEY, Data: kb}, {Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_DATA, Data: db}})
	lb, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NLA_F_NESTED | unix.NFTA_LIST_ELEM, Data: eb}})
	body, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_SET_ELEM_LIST_SET, Data: cstring("service-ips")}, {Type: unix.NLA_F_NESTED | unix.NFTA_SET_ELEM_LIST_ELEMENTS, Data: lb}})
	return append([]byte{unix.NFPROTO_IPV4, 0, 0, 0}, body...)
}

// A plain DNAT (immediate address, immediate port, nat) and a goto decode
// to their statements; a service-ips element to its frontend.
func TestNFTDecode(t *testing.T) {
	msg := ruleMsg("endpoint-X",
		exprAttr("cmp", []netlink.Attribute{{Type: unix.NFTA_CMP_SREG, Data: be32(1)}}),
		exprAttr("immediate", []netlink.Attribute{{Type: unix.NFTA_IMMEDIATE_DREG, Data: be32(1)}, {Type: unix.NLA_F_NESTED | unix.NFTA_IMMEDIATE_DATA, Data: mustAttrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: []byte{198, 18, 128, 70}})}}),
		exprAttr("immediate", []netlink.Attribute{{Type: unix.NFTA_IMMEDIATE_DREG, Data: be32(2)}, {Type: unix.NLA_F_NESTED | unix.NFTA_IMMEDIATE_DATA, Data: mustAttrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: []byte{0x1f, 0x90}})}}),
		exprAttr("nat", []netlink.Attribute{{Type: unix.NFTA_NAT_TYPE, Data: be32(unix.NFT_NAT_DNAT)}, {Type: unix.NFTA_NAT_FAMILY, Data: be32(unix.NFPROTO_IPV4)},
			{Type: unix.NFTA_NAT_REG_ADDR_MIN, Data: be32(1)}, {Type: unix.NFTA_NAT_REG_PROTO_MIN, Data: be32(2)}}),
	)
	r, err := decodeRule(msg)
	if err != nil {
		t.Fatal(err)
	}
	if r.chain != "endpoint-X" || len(r.stmts) != 2 || !r.stmts[0].match || r.stmts[1].dnat.String() != "198.18.128.70:8080" {
		t.Fatalf("decoded %+v", r)
	}
	els, err := decodeElems(elemMsg([]byte{198, 19, 0, 10, 17, 0, 0, 0, 0, 53, 0, 0}, "service-X"), nil)
	if err != nil || len(els) != 1 || els[0].target != "service-X" {
		t.Fatalf("elements %+v, %v", els, err)
	}
	k, err := serviceIPKey(4, els[0].key)
	if err != nil || k.String() != "198.19.0.10:53/UDP" {
		t.Fatalf("key %v, %v", k, err)
	}
	if _, err := serviceIPKey(4, []byte{1, 2, 3}); err == nil {
		t.Error("a short key decoded")
	}
}

// Malformed kernel messages never panic, and decoding allocates in
// proportion to the input.
func FuzzNFTDecode(f *testing.F) {
	f.Add(ruleMsg("services", exprAttr("lookup", []netlink.Attribute{{Type: unix.NFTA_LOOKUP_SET, Data: cstring("service-ips")},
		{Type: unix.NFTA_LOOKUP_SREG, Data: be32(1)}, {Type: unix.NFTA_LOOKUP_DREG, Data: be32(0)}})))
	f.Add(elemMsg([]byte{198, 19, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0}, "service-Y"))
	f.Add([]byte{2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			r, _ := decodeRule(data)
			els, _ := decodeElems(data, nil)
			for _, el := range els {
				serviceIPKey(4, el.key)
				nodePortKey(4, el.key)
				dnatValue(4, el.data)
			}
			_ = r
			ruleChainOf(data) // what the notes read of a rule message
			chainOf(data)
		})
		if limit := 64 + 2*float64(len(data)); allocs > limit {
			t.Fatalf("%d bytes decoded with %.0f allocations (limit %.0f)", len(data), allocs, limit)
		}
	})
}
