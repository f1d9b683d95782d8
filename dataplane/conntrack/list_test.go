package conntrack

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/proxyaudit/proxyaudit/audit"
)

// Lines as conntrack v1.4.7 prints them (-o extended), from the real-flow
// test's namespace, and plain.
const conntrackListed = `ipv4     2 udp      17 599 src=198.18.77.1 dst=198.19.0.11 sport=53088 dport=53 [UNREPLIED] src=198.18.77.3 dst=198.18.77.1 sport=5353 dport=53088 mark=0 use=2
ipv4     2 udp      17 599 src=198.18.77.1 dst=198.19.0.10 sport=35145 dport=53 src=198.18.77.2 dst=198.18.77.1 sport=5353 dport=35145 mark=0 use=1
ipv4     2 udp      17 599 src=198.18.77.1 dst=198.18.77.1 sport=33294 dport=30053 src=198.18.77.2 dst=198.18.77.1 sport=5353 dport=33294 mark=0 use=1
ipv4     2 tcp      6 119 TIME_WAIT src=198.18.77.1 dst=198.19.0.10 sport=57322 dport=80 src=198.18.77.2 dst=198.18.77.1 sport=8080 dport=57322 [ASSURED] mark=0 use=1
tcp      6 431999 ESTABLISHED src=198.18.5.5 dst=198.19.0.10 sport=1000 dport=80 src=198.18.77.9 dst=198.18.5.5 sport=8080 dport=1000 [ASSURED] mark=0 use=1
udp      17 29 src=198.18.5.5 dst=198.18.0.53 sport=1 dport=53 src=198.18.0.53 dst=198.18.5.5 sport=53 dport=1 mark=0 use=1
ipv6     10 udp      17 30 src=2001:2::5 dst=2001:2:0:ffff::a sport=40000 dport=53 [UNREPLIED] src=2001:2:1::2 dst=2001:2::5 sport=5353 dport=40000 mark=0 use=1
icmp     1 29 src=198.18.5.5 dst=198.19.0.10 type=8 code=0 id=1 src=198.18.77.2 dst=198.18.5.5 type=0 code=0 id=1 mark=0 use=1
conntrack v1.4.7 (conntrack-tools): 8 flow entries have been shown.
`

func TestParseList(t *testing.T) {
	var got []Entry
	n, err := ParseList(strings.NewReader(conntrackListed), func(e *Entry) { got = append(got, *e) })
	if err != nil || n != 7 || len(got) != 7 {
		t.Fatalf("%d entries, %v: %+v", n, err, got)
	}
	if e := got[0]; e.Proto != 17 || e.SeenReply || !e.DstNAT || e.OrigDst != netip.MustParseAddrPort("198.19.0.11:53") || e.ReplySrc != netip.MustParseAddrPort("198.18.77.3:5353") {
		t.Errorf("first: %+v", e)
	}
	if e := got[3]; e.Proto != 6 || e.TCPState != "TIME_WAIT" || !e.SeenReply || !e.DstNAT {
		t.Errorf("TCP: %+v", e)
	}
	if e := got[5]; e.DstNAT {
		t.Errorf("an entry without NAT read as DNATed: %+v", e)
	}
	if e := got[6]; !e.OrigDst.Addr().Is6() || e.ReplySrc != netip.MustParseAddrPort("[2001:2:1::2]:5353") {
		t.Errorf("IPv6: %+v", e)
	}
	// Counted against a node's frontends, as the collector counts a dump.
	c := NewCounter([]audit.FrontendKey{{IP: netip.MustParseAddr("198.19.0.10"), Protocol: "UDP", Port: 53}, {IP: netip.MustParseAddr("198.19.0.10"), Protocol: "TCP", Port: 80},
		audit.NodePortKey(4, "UDP", 30053)}, nil, 100)
	if _, err := ParseList(strings.NewReader(conntrackListed), c.Add); err != nil {
		t.Fatal(err)
	}
	if r := c.Result([]int{4}); r.Entries != 4 || len(r.Flows) != 4 {
		t.Errorf("counted: %+v", r)
	}
	for name, in := range map[string]string{
		"one tuple":   "udp 17 29 src=1.1.1.1 dst=2.2.2.2 sport=1 dport=2\n",
		"bad address": "udp 17 29 src=pod-a dst=2.2.2.2 sport=1 dport=2 src=2.2.2.2 dst=1.1.1.1 sport=2 dport=1\n",
		"bad port":    "udp 17 29 src=1.1.1.1 dst=2.2.2.2 sport=x dport=2 src=2.2.2.2 dst=1.1.1.1 sport=2 dport=1\n",
		"xml":         "<?xml version=\"1.0\"?><conntrack>\n",
		"garbage":     "hello world again\n",
		"iptables":    "*nat\n:PREROUTING ACCEPT [0:0]\n",
	} {
		if _, err := ParseList(strings.NewReader(in), func(*Entry) {}); err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func FuzzParseList(f *testing.F) {
	f.Add(conntrackListed)
	f.Fuzz(func(t *testing.T, in string) {
		c := NewCounter([]audit.FrontendKey{{IP: netip.MustParseAddr("198.19.0.10"), Protocol: "UDP", Port: 53}}, nil, 4)
		n, _ := ParseList(strings.NewReader(in), c.Add)
		r := c.Result([]int{4, 6})
		if r.Entries > n || len(r.Flows) > 4 {
			t.Fatalf("%d entries parsed, %d counted, %d pairs", n, r.Entries, len(r.Flows))
		}
	})
}
