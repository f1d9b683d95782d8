package audit

import (
	"net/netip"
	"strings"
	"testing"
)

func TestParseIPv4PortAgreesWithNetip(t *testing.T) {
	for _, s := range []string{
		"198.18.0.1:8080", "0.0.0.0:0", "255.255.255.255:65535", "1.2.3.4:80",
		"01.2.3.4:80", "1.2.3.4:080", "256.1.1.1:80", "1.2.3:80", "1.2.3.4", "1.2.3.4:65536",
		"1.2.3.4:", ":80", "1.2.3.4:80x", "1.2.3.4.5:80", "[::1]:80", "1.2.3.4:99999", "1..3.4:1", "",
	} {
		want, err := netip.ParseAddrPort(s)
		got, ok := parseIPv4Port([]byte(s))
		if ok && (err != nil || got != want) {
			t.Errorf("%q: fast path %v, netip %v (%v)", s, got, want, err)
		}
		if !ok && err == nil && want.Addr().Is4() && want.String() == s {
			t.Errorf("%q: fast path refused a canonical IPv4 address netip accepts", s)
		}
	}
}

// Endpoint chains under odd names, two chains whose names share the first
// 64 bits of their hash, and a chain with two DNATs are all read exactly.
func TestParseIPTablesEndpointChainEdges(t *testing.T) {
	in := `*nat
:KUBE-SEP-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-AAAAAAAAAAAABBBB - [0:0]
-A KUBE-SERVICES -d 198.19.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-ONE
-A KUBE-SERVICES -d 198.19.0.11/32 -p udp -m udp --dport 53 -j KUBE-SVC-TWO
-A KUBE-SVC-ONE -m statistic --mode random --probability 0.5 -j KUBE-SEP-AAAAAAAAAAAAAAAA
-A KUBE-SVC-ONE -j KUBE-SEP-AAAAAAAAAAAABBBB
-A KUBE-SVC-TWO -j KUBE-SEP-handmade
-A KUBE-SVC-TWO -j KUBE-SEP-NODNAT
-A KUBE-SEP-AAAAAAAAAAAAAAAA -p tcp -m tcp -j DNAT --to-destination 198.18.1.1:8080
-A KUBE-SEP-AAAAAAAAAAAABBBB -p tcp -m tcp -j DNAT --to-destination 198.18.1.2:8080
-A KUBE-SEP-handmade -s 198.18.1.3/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-handmade -p udp -m udp -j DNAT --to-destination 198.18.1.3:53
-A KUBE-SEP-handmade -p udp -m udp -j DNAT --to-destination 198.18.1.4:53 --persistent
-A KUBE-SEP-ORPHANED -p tcp -m tcp -j DNAT --to-destination 198.18.9.9:80
COMMIT
`
	obs, err := ParseIPTables(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, f := range obs.Frontends {
		var eps []string
		for _, e := range f.Endpoints {
			eps = append(eps, e.Addr.String()+"@"+e.Chain)
		}
		got[f.FrontendKey.String()] = strings.Join(eps, " ")
	}
	want := map[string]string{
		"198.19.0.10:80/TCP": "198.18.1.1:8080@KUBE-SEP-AAAAAAAAAAAAAAAA 198.18.1.2:8080@KUBE-SEP-AAAAAAAAAAAABBBB",
		"198.19.0.11:53/UDP": "198.18.1.3:53@KUBE-SEP-handmade 198.18.1.4:53@KUBE-SEP-handmade",
	}
	if len(got) != len(want) {
		t.Fatalf("frontends %v", got)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: got %q, want %q", k, got[k], v)
		}
	}
}

func TestSEPNameRoundTrip(t *testing.T) {
	p := &iptables{}
	for _, n := range []string{"KUBE-SEP-23FKMLDKFLMQMVL4", "KUBE-SEP-7777777777777777", "KUBE-SEP-AAAAAAAAAAAAAAAA", "KUBE-SEP-lower", "KUBE-SEP-TOOLONGFORAHASH12345"} {
		if got := p.sepName(p.sepIDOf([]byte(n))); got != n {
			t.Errorf("%s came back as %s", n, got)
		}
	}
}

func TestParseNFTablesRejectsHostileJSON(t *testing.T) {
	for name, in := range map[string]string{
		"deep":      `{"nftables": ` + strings.Repeat("[", 100000) + strings.Repeat("]", 100000) + `}`,
		"truncated": `{"nftables": [{"table": {"family": "ip", "name": "kube-proxy"`,
		"trailing":  `{"nftables": []} {"nftables": []}`,
		"no array":  `{"other": 1}`,
		"garbage":   `{"nftables": [tru]}`,
	} {
		if _, err := ParseNFTables(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error", name)
		} else if !strings.Contains(err.Error(), "nft") {
			t.Errorf("%s: error does not say what was expected: %v", name, err)
		}
	}
}

func TestParseIPTablesRejectsTruncatedAndRunaway(t *testing.T) {
	if _, err := ParseIPTables(strings.NewReader("*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -d 1.2.3.4/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X\n")); err == nil || !strings.Contains(err.Error(), "truncated") {
		t.Errorf("truncated dump: %v", err)
	}
	// A reader that never ends, repeating one rule: the parser stops at
	// MaxRules instead of growing without bound.
	r := &repeatReader{head: "*nat\n", line: "-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-AAAAAAAAAAAAAAAA\n"}
	if _, err := ParseIPTables(r); err == nil || !strings.Contains(err.Error(), "more than") {
		t.Errorf("runaway input: %v", err)
	}
}

type repeatReader struct {
	head, line string
	sent       bool
}

func (r *repeatReader) Read(p []byte) (int, error) {
	n := 0
	if !r.sent {
		n = copy(p, r.head)
		r.sent = true
	}
	for n+len(r.line) <= len(p) {
		n += copy(p[n:], r.line)
	}
	return n, nil
}
