package nl_test

import (
	"testing"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
	"github.com/proxyaudit/proxyaudit/dataplane/nl/nltest"
)

// The shared expressions read what the kernel writes: a DNAT's registers,
// an immediate's register and data, a goto's chain.
func TestSharedExpressions(t *testing.T) {
	natData := nltest.Attrs(
		netlink.Attribute{Type: unix.NFTA_NAT_TYPE, Data: nltest.BE32(unix.NFT_NAT_DNAT)},
		netlink.Attribute{Type: unix.NFTA_NAT_REG_ADDR_MIN, Data: nltest.BE32(1)},
		netlink.Attribute{Type: unix.NFTA_NAT_REG_PROTO_MIN, Data: nltest.BE32(2)},
		netlink.Attribute{Type: unix.NFTA_NAT_FLAGS, Data: nltest.BE32(3)},
	)
	n, err := nl.DecodeNAT(natData)
	if err != nil || n != (nl.NAT{Type: unix.NFT_NAT_DNAT, RegAddrMin: 1, RegProtoMin: 2, Flags: 3}) {
		t.Errorf("nat: %+v, %v", n, err)
	}
	imm := nltest.Verdict(unix.NFT_GOTO, "service-X")[1].Data // the expression's data
	dreg, data, err := nl.DecodeImmediate(imm)
	if err != nil || dreg != unix.NFT_REG_VERDICT {
		t.Fatalf("immediate: register %d, %v", dreg, err)
	}
	code, chain, ok, err := nl.DataVerdict(data)
	if err != nil || !ok || code != unix.NFT_GOTO || chain != "service-X" {
		t.Errorf("verdict: %d %q %v %v", code, chain, ok, err)
	}
	if _, _, ok, err := nl.DataVerdict(nltest.Attrs(netlink.Attribute{Type: unix.NFTA_DATA_VALUE, Data: []byte{1, 2}})); ok || err != nil {
		t.Errorf("a value read as a verdict (%v)", err)
	}
}

// Malformed expressions never panic and allocate nothing but an error.
func FuzzSharedExpressions(f *testing.F) {
	f.Add(nltest.Verdict(unix.NFT_JUMP, "x")[1].Data)
	f.Add([]byte{8, 0, 1, 0, 0, 0, 0, 42})
	f.Fuzz(func(t *testing.T, b []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			nl.DecodeNAT(b)
			_, data, _ := nl.DecodeImmediate(b)
			nl.DataVerdict(data)
			nl.DataVerdict(b)
		})
		if allocs > 24 {
			t.Fatalf("%d allocations decoding %d bytes", int(allocs), len(b))
		}
	})
}
