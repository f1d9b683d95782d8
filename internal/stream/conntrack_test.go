package stream

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
)

func TestConntrackWire(t *testing.T) {
	ct := &audit.Conntrack{Families: []int{4}, Entries: 12, Flows: []audit.ConntrackFlows{
		{Frontend: audit.FrontendKey{IP: netip.MustParseAddr("198.19.0.10"), Protocol: "UDP", Port: 53}, Dest: netip.MustParseAddrPort("198.18.77.2:5353"),
			UDP: 9, Unreplied: 2, Oldest: time.Unix(1_800_000_000, 0), Active: time.Unix(1_800_000_100, 0), Samples: []netip.AddrPort{netip.MustParseAddrPort("198.18.5.5:40000")}},
		{Frontend: audit.NodePortKey(6, "TCP", 30080), Dest: netip.MustParseAddrPort("[2001:2::9]:8080"), TCP: map[string]int{"SYN_SENT": 3}},
	}}
	w := FromConntrack(ct)
	back, err := w.Model()
	if err != nil || !reflect.DeepEqual(back, ct) {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	d := w.Digest()
	// Noise (9 -> 12 flows, the same power of two) sends nothing new; a
	// new pair, a doubling, an error do.
	w.Pairs[0].UDP = 12
	w.Pairs[0].Active += 3 // within its ten seconds
	if w.Digest() != d {
		t.Error("a count within its power of two, or a last packet within its ten seconds, changed the digest")
	}
	for name, edit := range map[string]func(c *Conntrack){
		"doubling": func(c *Conntrack) { c.Pairs[0].UDP = 17 },
		"new pair": func(c *Conntrack) {
			c.Pairs = append(c.Pairs, ConntrackPair{Frontend: "198.19.0.10:53/UDP", Dest: "198.18.77.3:5353", UDP: 1})
		},
		"error":               func(c *Conntrack) { c.Error = "EPERM" },
		"unreplied":           func(c *Conntrack) { c.Pairs[0].Unreplied = 5 },
		"tcp state":           func(c *Conntrack) { c.Pairs[1].TCP = map[string]int{"ESTABLISHED": 3} },
		"packets still going": func(c *Conntrack) { c.Pairs[0].Active += 30 },
	} {
		c := FromConntrack(ct)
		edit(c)
		if c.Digest() == d {
			t.Errorf("%s: same digest", name)
		}
	}
}

// A hostile collector's conntrack counts: refused with a reason, never
// taken in part.
func TestConntrackModelRefusesGarbage(t *testing.T) {
	good := func() *Conntrack {
		return &Conntrack{Entries: 1, Pairs: []ConntrackPair{{Frontend: "198.19.0.10:53/UDP", Dest: "198.18.77.2:5353", UDP: 1}}}
	}
	for name, edit := range map[string]func(c *Conntrack){
		"bad key":         func(c *Conntrack) { c.Pairs[0].Frontend = "<script>" },
		"bad destination": func(c *Conntrack) { c.Pairs[0].Dest = "pod-a" },
		"negative":        func(c *Conntrack) { c.Pairs[0].UDP = -1 },
		"unreplied > all": func(c *Conntrack) { c.Pairs[0].Unreplied = 2 },
		"too many states": func(c *Conntrack) {
			c.Pairs[0].TCP = map[string]int{}
			for i := range 20 {
				c.Pairs[0].TCP[strings.Repeat("S", i+1)] = 1
			}
		},
		"too many samples": func(c *Conntrack) { c.Pairs[0].Samples = []string{"1.1.1.1:1", "1.1.1.1:2", "1.1.1.1:3", "1.1.1.1:4"} },
		"bad sample":       func(c *Conntrack) { c.Pairs[0].Samples = []string{"x"} },
		"too many pairs": func(c *Conntrack) {
			c.Pairs = make([]ConntrackPair, MaxConntrackPairs+1)
		},
		"negative entries":     func(c *Conntrack) { c.Entries = -5 },
		"negative last packet": func(c *Conntrack) { c.Pairs[0].Active = -1 },
	} {
		c := good()
		edit(c)
		if m, err := c.Model(); err == nil {
			t.Errorf("%s: taken as %+v", name, m)
		}
	}
	if _, err := good().Model(); err != nil {
		t.Fatal(err)
	}
}
