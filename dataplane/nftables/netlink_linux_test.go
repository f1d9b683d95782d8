//go:build linux

package nftables

import (
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// A plain DNAT (immediate address, immediate port, nat) and a goto decode
// to their statements; a service-ips element to its frontend.
func TestNFTDecode(t *testing.T) {
	msg := nltest.RuleMsg(unix.NFPROTO_IPV4, "kube-proxy", "endpoint-X",
		nltest.Expr("cmp", []netlink.Attribute{{Type: unix.NFTA_CMP_SREG, Data: nltest.BE32(1)}}),
		nltest.Expr("immediate", []netlink.Attribute{{Type: unix.NFTA_IMMEDIATE_DREG, Data: nltest.BE32(1)}, {Type: unix.NLA_F_NESTED | unix.NFTA_IMMEDIATE_DATA, Data: nltest.Attrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: []byte{198, 18, 128, 70}})}}),
		nltest.Expr("immediate", []netlink.Attribute{{Type: unix.NFTA_IMMEDIATE_DREG, Data: nltest.BE32(2)}, {Type: unix.NLA_F_NESTED | unix.NFTA_IMMEDIATE_DATA, Data: nltest.Attrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: []byte{0x1f, 0x90}})}}),
		nltest.Expr("nat", []netlink.Attribute{{Type: unix.NFTA_NAT_TYPE, Data: nltest.BE32(unix.NFT_NAT_DNAT)}, {Type: unix.NFTA_NAT_FAMILY, Data: nltest.BE32(unix.NFPROTO_IPV4)},
			{Type: unix.NFTA_NAT_REG_ADDR_MIN, Data: nltest.BE32(1)}, {Type: unix.NFTA_NAT_REG_PROTO_MIN, Data: nltest.BE32(2)}}),
	)
	r, err := DecodeRule(msg)
	if err != nil {
		t.Fatal(err)
	}
	if r.Chain != "endpoint-X" || len(r.Stmts) != 2 || !r.Stmts[0].Match || r.Stmts[1].DNAT.String() != "198.18.128.70:8080" {
		t.Fatalf("decoded %+v", r)
	}
	els, err := DecodeElems(nltest.ElemMsg("service-ips", []byte{198, 19, 0, 10, 17, 0, 0, 0, 0, 53, 0, 0}, "service-X"), nil)
	if err != nil || len(els) != 1 || els[0].Target != "service-X" {
		t.Fatalf("elements %+v, %v", els, err)
	}
	k, err := ServiceIPKey(4, els[0].Key)
	if err != nil || k.String() != "198.19.0.10:53/UDP" {
		t.Fatalf("key %v, %v", k, err)
	}
	if _, err := ServiceIPKey(4, []byte{1, 2, 3}); err == nil {
		t.Error("a short key decoded")
	}
}

// Malformed kernel messages never panic, and decoding allocates in
// proportion to the input.
func FuzzNFTDecode(f *testing.F) {
	f.Add(nltest.RuleMsg(unix.NFPROTO_IPV4, "kube-proxy", "services", nltest.Expr("lookup", []netlink.Attribute{{Type: unix.NFTA_LOOKUP_SET, Data: nltest.CString("service-ips")},
		{Type: unix.NFTA_LOOKUP_SREG, Data: nltest.BE32(1)}, {Type: unix.NFTA_LOOKUP_DREG, Data: nltest.BE32(0)}})))
	f.Add(nltest.ElemMsg("service-ips", []byte{198, 19, 0, 10, 6, 0, 0, 0, 0, 80, 0, 0}, "service-Y"))
	f.Add([]byte{2, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			r, _ := DecodeRule(data)
			els, _ := DecodeElems(data, nil)
			for _, el := range els {
				ServiceIPKey(4, el.Key)
				NodePortKey(4, el.Key)
				DNATValue(4, el.Data)
			}
			_ = r
		})
		if limit := 64 + 2*float64(len(data)); allocs > limit {
			t.Fatalf("%d bytes decoded with %.0f allocations (limit %.0f)", len(data), allocs, limit)
		}
	})
}
