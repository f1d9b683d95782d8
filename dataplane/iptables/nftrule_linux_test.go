//go:build linux

package iptables

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

var updateGolden = flag.Bool("update-golden", false, "rewrite testdata/{iptnft,iptlegacy}/*.golden from what the decoders read now")

// The rule messages of genuine captures, as the kernel sends them, are in
// testdata/iptnft: each family's nat table dump of a capture loaded with
// iptables-restore, and what the decoder reads of each rule (golden). The
// unit tests decode them without root. The collector's reader makes the
// dumps: go test ./internal/collector -run TestCaptureIPTNFTMessages
// -update-netlink (root) recaptures them, then -update-golden here.
var netlinkCaptures = []struct{ file, capture string }{
	{"clean-ipt-a", "audit/testdata/capture/clean/ipt-a.rules"},
	{"large-ipt-a", "audit/testdata/capture/large/ipt-a.rules"},
	{"drift-ds-ipt", "audit/testdata/dualstack/drift/ds-ipt.rules"},
}

func readMessages(t testing.TB, path string) [][]byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	for len(data) >= 4 {
		n := int(binary.LittleEndian.Uint32(data))
		if 4+n > len(data) {
			t.Fatalf("%s: truncated", path)
		}
		out = append(out, data[4:4+n])
		data = data[4+n:]
	}
	return out
}

// decodeAll is what the decoder reads of each message, a line each: the
// chain, then the rule's fields that are set (or "skipped", or the error).
func decodeAll(msgs [][]byte, fam int) []string {
	var out []string
	for _, m := range msgs {
		d, err := DecodeNFTRule(m, fam)
		line := string(d.Chain)
		switch {
		case err != nil:
			line += " error=" + err.Error()
		case d.Skipped:
			line += " skipped"
		default:
			line += " " + describeRule(d.Rule)
		}
		out = append(out, line)
	}
	return out
}

func describeRule(r Rule) string {
	var f []string
	if r.Dst.IsValid() {
		f = append(f, "dst="+r.Dst.String())
	}
	if r.Cond {
		f = append(f, "cond")
	}
	if r.Proto != "" {
		f = append(f, "proto="+r.Proto)
	}
	if r.HasDPort {
		f = append(f, fmt.Sprintf("dport=%d", r.DPort))
	}
	if r.Jump != "" {
		f = append(f, "jump="+r.Jump)
	}
	if r.Goto {
		f = append(f, "goto")
	}
	if r.Comment != "" {
		f = append(f, fmt.Sprintf("comment=%q", r.Comment))
	}
	if r.DNAT.IsValid() {
		f = append(f, "dnat="+r.DNAT.String())
	}
	return strings.Join(f, " ")
}

func TestIPTNFTDecodeCapturedMessages(t *testing.T) {
	for _, c := range netlinkCaptures {
		for _, fam := range []int{4, 6} {
			base := filepath.Join("testdata", "iptnft", fmt.Sprintf("%s.ipv%d", c.file, fam))
			msgs := readMessages(t, base+".msgs")
			got := []byte(strings.Join(decodeAll(msgs, fam), "\n"))
			if *updateGolden {
				if err := os.WriteFile(base+".golden", append(got, '\n'), 0o644); err != nil {
					t.Fatal(err)
				}
				continue
			}
			want, err := os.ReadFile(base + ".golden")
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(append(got, '\n'), want) {
				t.Errorf("%s: decoded rules differ from the golden file (go test -run %s -update-golden, and review the diff)", base, t.Name())
			}
			if fam == 4 && len(msgs) < 40 {
				t.Errorf("%s: only %d messages", base, len(msgs))
			}
			for _, line := range decodeAll(msgs, fam) {
				if strings.Contains(line, " error=") {
					t.Errorf("%s: %s", base, line)
				}
			}
		}
	}
}

// iptRuleMsg builds an NFT_MSG_NEWRULE body of table nat.
func iptRuleMsg(fam byte, chain string, exprs ...[]netlink.Attribute) []byte {
	return nltest.RuleMsg(fam, "nat", chain, exprs...)
}

func payloadExpr(base, off, l uint32) []netlink.Attribute {
	return nltest.Expr("payload", []netlink.Attribute{{Type: unix.NFTA_PAYLOAD_DREG, Data: nltest.BE32(1)}, {Type: unix.NFTA_PAYLOAD_BASE, Data: nltest.BE32(base)},
		{Type: unix.NFTA_PAYLOAD_OFFSET, Data: nltest.BE32(off)}, {Type: unix.NFTA_PAYLOAD_LEN, Data: nltest.BE32(l)}})
}

func metaExpr(key uint32) []netlink.Attribute {
	return nltest.Expr("meta", []netlink.Attribute{{Type: unix.NFTA_META_DREG, Data: nltest.BE32(1)}, {Type: unix.NFTA_META_KEY, Data: nltest.BE32(key)}})
}

func cmpExpr(op uint32, v []byte) []netlink.Attribute {
	return nltest.Expr("cmp", []netlink.Attribute{{Type: unix.NFTA_CMP_SREG, Data: nltest.BE32(1)}, {Type: unix.NFTA_CMP_OP, Data: nltest.BE32(op)},
		{Type: unix.NLA_F_NESTED | unix.NFTA_CMP_DATA, Data: nltest.Attrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: v})}})
}

func xtExpr(kind, name string, rev uint32, info []byte) []netlink.Attribute {
	return nltest.Expr(kind, []netlink.Attribute{{Type: unix.NFTA_MATCH_NAME, Data: nltest.CString(name)}, {Type: unix.NFTA_MATCH_REV, Data: nltest.BE32(rev)},
		{Type: unix.NFTA_MATCH_INFO, Data: info}})
}

func tcpInfo(lo, hi uint16, inv byte) []byte {
	b := make([]byte, 12)
	binary.NativeEndian.PutUint16(b[0:], 0)
	binary.NativeEndian.PutUint16(b[2:], 0xffff)
	binary.NativeEndian.PutUint16(b[4:], lo)
	binary.NativeEndian.PutUint16(b[6:], hi)
	b[11] = inv
	return b
}

func natRange2(flags uint32, min, max netip.Addr, pmin, pmax uint16) []byte {
	b := make([]byte, 44)
	binary.NativeEndian.PutUint32(b, flags)
	a, z := min.AsSlice(), max.AsSlice()
	copy(b[4:], a)
	copy(b[20:], z)
	binary.BigEndian.PutUint16(b[36:], pmin)
	binary.BigEndian.PutUint16(b[38:], pmax)
	return b
}

// Edge cases of the decoder: what iptables-save would print for each, as
// the text parser reads it, or undecodable where the text parser refuses
// (a port range, a DNAT to a range) or the decoder cannot say what would
// be printed (an unknown match in a dispatch chain). Outside the dispatch
// chains only DNAT targets and jumps matter.
func TestIPTNFTDecodeEdges(t *testing.T) {
	v4 := byte(unix.NFPROTO_IPV4)
	dst := func(ip string) [][]netlink.Attribute {
		a := netip.MustParseAddr(ip).AsSlice()
		return [][]netlink.Attribute{payloadExpr(unix.NFT_PAYLOAD_NETWORK_HEADER, 16, uint32(len(a))), cmpExpr(unix.NFT_CMP_EQ, a)}
	}
	tcp := [][]netlink.Attribute{metaExpr(unix.NFT_META_L4PROTO), cmpExpr(unix.NFT_CMP_EQ, []byte{6})}
	dport := func(op uint32, p uint16) [][]netlink.Attribute {
		return [][]netlink.Attribute{payloadExpr(unix.NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2), cmpExpr(op, binary.BigEndian.AppendUint16(nil, p))}
	}
	cat := func(parts ...[][]netlink.Attribute) [][]netlink.Attribute {
		var out [][]netlink.Attribute
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	one := func(e []netlink.Attribute) [][]netlink.Attribute { return [][]netlink.Attribute{e} }
	ip := netip.MustParseAddr("198.18.128.1")
	for _, tc := range []struct {
		name, chain string
		exprs       [][]netlink.Attribute
		want        Rule
		undecodable bool
	}{
		{"cluster IP", "KUBE-SERVICES", cat(tcp, dst("198.19.0.10"), one(xtExpr("match", "comment", 0, append([]byte("ns/svc:http cluster IP"), make([]byte, 240)...))), dport(unix.NFT_CMP_EQ, 80), one(nltest.Verdict(unix.NFT_JUMP, "KUBE-SVC-A"))),
			Rule{Dst: netip.MustParseAddr("198.19.0.10"), Proto: "TCP", DPort: 80, HasDPort: true, Jump: "KUBE-SVC-A", Comment: "ns/svc:http cluster IP"}, false},
		{"goto", "KUBE-SERVICES", one(nltest.Verdict(unix.NFT_GOTO, "KUBE-SVC-A")), Rule{Jump: "KUBE-SVC-A", Goto: true}, false},
		{"prefix destination is a condition", "KUBE-NODEPORTS", cat(tcp, [][]netlink.Attribute{payloadExpr(unix.NFT_PAYLOAD_NETWORK_HEADER, 16, 1), cmpExpr(unix.NFT_CMP_EQ, []byte{127})}, dport(unix.NFT_CMP_EQ, 30080)),
			Rule{Cond: true, Proto: "TCP", DPort: 30080, HasDPort: true}, false},
		{"negated destination is a condition", "KUBE-SERVICES", [][]netlink.Attribute{payloadExpr(unix.NFT_PAYLOAD_NETWORK_HEADER, 16, 4), cmpExpr(unix.NFT_CMP_NEQ, []byte{127, 0, 0, 1})},
			Rule{Cond: true}, false},
		{"source is a condition", "KUBE-EXT-A", [][]netlink.Attribute{payloadExpr(unix.NFT_PAYLOAD_NETWORK_HEADER, 12, 4), cmpExpr(unix.NFT_CMP_EQ, ip.AsSlice())},
			Rule{Cond: true}, false},
		{"source address type is a condition", "KUBE-EXT-A", one(xtExpr("match", "addrtype", 1, []byte{2, 0, 0, 0, 0, 0, 0, 0})), Rule{Cond: true}, false},
		{"destination address type is not", "KUBE-SERVICES", one(xtExpr("match", "addrtype", 1, []byte{0, 0, 2, 0, 0, 0, 0, 0})), Rule{}, false},
		{"negated protocol reads as the protocol (as the text parser does)", "KUBE-SERVICES", [][]netlink.Attribute{metaExpr(unix.NFT_META_L4PROTO), cmpExpr(unix.NFT_CMP_NEQ, []byte{17})},
			Rule{Proto: "UDP"}, false},
		{"xt tcp port", "KUBE-SERVICES", cat(tcp, one(xtExpr("match", "tcp", 0, tcpInfo(53, 53, xtTCPInvDstPort)))), Rule{Proto: "TCP", DPort: 53, HasDPort: true}, false},
		{"xt tcp without ports", "KUBE-SERVICES", cat(tcp, one(xtExpr("match", "tcp", 0, tcpInfo(0, 0xffff, 0)))), Rule{Proto: "TCP"}, false},
		{"xt tcp port range", "KUBE-SERVICES", cat(tcp, one(xtExpr("match", "tcp", 0, tcpInfo(80, 90, 0)))), Rule{}, true},
		{"native port range", "KUBE-SERVICES", cat(tcp, dport(unix.NFT_CMP_GTE, 80)), Rule{}, true},
		{"a port without a protocol", "KUBE-SERVICES", dport(unix.NFT_CMP_EQ, 80), Rule{}, true},
		{"an unknown match in a dispatch chain", "KUBE-SERVICES", one(xtExpr("match", "u32", 0, []byte{1, 2, 3, 4})), Rule{}, true},
		{"an unknown expression in a dispatch chain", "KUBE-FW-A", one(nltest.Expr("lookup", []netlink.Attribute{{Type: unix.NFTA_LOOKUP_SET, Data: nltest.CString("x")}})), Rule{}, true},
		{"an unknown match in an endpoint chain", "KUBE-SEP-AAAAAAAAAAAAAAAA", cat(one(xtExpr("match", "u32", 0, []byte{1, 2, 3, 4})), one(xtExpr("target", "DNAT", 2, natRange2(3, ip, ip, 8080, 8080)))),
			Rule{Jump: "DNAT", DNAT: netip.AddrPortFrom(ip, 8080)}, false},
		{"DNAT revision 0", "KUBE-SEP-AAAAAAAAAAAAAAAA", one(xtExpr("target", "DNAT", 0, []byte{1, 0, 0, 0, 3, 0, 0, 0, 198, 18, 128, 1, 198, 18, 128, 1, 0x1f, 0x90, 0x1f, 0x90, 0, 0, 0, 0})),
			Rule{Jump: "DNAT", DNAT: netip.AddrPortFrom(ip, 8080)}, false},
		{"DNAT with --random", "KUBE-SEP-AAAAAAAAAAAAAAAA", one(xtExpr("target", "DNAT", 2, natRange2(3|nfNATRangeRandom, ip, ip, 8080, 8080))),
			Rule{Jump: "DNAT", DNAT: netip.AddrPortFrom(ip, 8080)}, false},
		{"DNAT to an address range", "KUBE-SEP-AAAAAAAAAAAAAAAA", one(xtExpr("target", "DNAT", 2, natRange2(3, ip, ip.Next(), 8080, 8080))), Rule{}, true},
		{"DNAT without a port", "KUBE-SEP-AAAAAAAAAAAAAAAA", one(xtExpr("target", "DNAT", 2, natRange2(1, ip, ip, 0, 0))), Rule{}, true},
		{"DNAT with a port offset", "KUBE-SEP-AAAAAAAAAAAAAAAA", one(xtExpr("target", "DNAT", 2, natRange2(3|32, ip, ip, 8080, 8080))), Rule{}, true},
		{"a chain the audit does not read is not decoded", "PREROUTING", one(nltest.Expr("garbage", nil)), Rule{}, false},
	} {
		d, err := DecodeNFTRule(iptRuleMsg(v4, tc.chain, tc.exprs...), 4)
		switch {
		case tc.undecodable:
			if !errors.Is(err, ErrUndecodable) {
				t.Errorf("%s: decoded %+v (%v), want undecodable", tc.name, d.Rule, err)
			}
		case err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case d.Rule != tc.want:
			t.Errorf("%s: decoded %+v, want %+v", tc.name, d.Rule, tc.want)
		case string(d.Table) != "nat" || string(d.Chain) != tc.chain:
			t.Errorf("%s: table %q chain %q", tc.name, d.Table, d.Chain)
		}
	}
	// iptables-nft may keep a comment in the rule's user data.
	m := iptRuleMsg(v4, "KUBE-SERVICES", nltest.Verdict(unix.NFT_JUMP, "KUBE-SVC-A"))
	ud := append([]byte{udataTypeComment, byte(len("ns/svc:http") + 1)}, nltest.CString("ns/svc:http")...)
	m = append(m, nltest.Attrs(netlink.Attribute{Type: nftaRuleUserdata, Data: ud})...)
	if d, err := DecodeNFTRule(m, 4); err != nil || d.Rule.Comment != "ns/svc:http" {
		t.Errorf("user data comment: %+v, %v", d.Rule, err)
	}
	if !strings.Contains(fmt.Sprint(ErrUndecodable), "cannot read") {
		t.Error(ErrUndecodable)
	}
}

// Malformed kernel messages never panic, and decoding allocates in
// proportion to the input.
func FuzzIPTNFTDecode(f *testing.F) {
	for _, c := range netlinkCaptures {
		for _, fam := range []string{"ipv4", "ipv6"} {
			path := filepath.Join("testdata", "iptnft", c.file+"."+fam+".msgs")
			data, err := os.ReadFile(path)
			if err != nil {
				continue
			}
			for k := 0; len(data) >= 4 && k < 40; k++ {
				n := int(binary.LittleEndian.Uint32(data))
				if 4+n > len(data) {
					break
				}
				f.Add(data[4:4+n], fam == "ipv6")
				data = data[4+n:]
			}
		}
	}
	f.Fuzz(func(t *testing.T, data []byte, v6 bool) {
		fam := 4
		if v6 {
			fam = 6
		}
		allocs := testing.AllocsPerRun(1, func() {
			DecodeNFTRule(data, fam)
		})
		if limit := 64 + 2*float64(len(data)); allocs > limit {
			t.Fatalf("%d bytes decoded with %.0f allocations (limit %.0f)", len(data), allocs, limit)
		}
	})
}
