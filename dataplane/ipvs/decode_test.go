//go:build linux

package ipvs

import (
	"encoding/binary"
	"syscall"
	"testing"

	"github.com/mdlayher/netlink"
)

func nested(typ uint16, attrs ...netlink.Attribute) netlink.Attribute {
	return netlink.Attribute{Type: typ | netlink.Nested, Data: mustAttrs(attrs...)}
}

func mustAttrs(a ...netlink.Attribute) []byte {
	b, err := netlink.MarshalAttributes(a)
	if err != nil {
		panic(err)
	}
	return b
}

func ne16(v uint16) []byte { return binary.NativeEndian.AppendUint16(nil, v) }
func ne32(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }

func ipvsServiceMsg(persistent bool) []byte {
	var flags uint32
	if persistent {
		flags = ipvsSvcPersistent
	}
	return mustAttrs(nested(ipvsCmdAttrService,
		netlink.Attribute{Type: ipvsSvcAttrAF, Data: ne16(syscall.AF_INET)},
		netlink.Attribute{Type: ipvsSvcAttrProtocol, Data: ne16(syscall.IPPROTO_UDP)},
		netlink.Attribute{Type: ipvsSvcAttrAddr, Data: append([]byte{198, 19, 0, 10}, make([]byte, 12)...)},
		netlink.Attribute{Type: ipvsSvcAttrPort, Data: []byte{0, 53}},
		netlink.Attribute{Type: ipvsSvcAttrSched, Data: []byte("rr\x00")},
		netlink.Attribute{Type: ipvsSvcAttrFlags, Data: append(ne32(flags), ne32(^uint32(0))...)},
		netlink.Attribute{Type: ipvsSvcAttrTimeout, Data: ne32(10800)},
	))
}

func ipvsDestMsg(last byte, weight uint32, withAF bool) []byte {
	as := []netlink.Attribute{
		{Type: ipvsDestAttrAddr, Data: append([]byte{198, 18, 128, last}, make([]byte, 12)...)},
		{Type: ipvsDestAttrPort, Data: []byte{0, 53}},
		{Type: ipvsDestAttrWeight, Data: ne32(weight)},
		{Type: ipvsDestAttrActiveConns, Data: ne32(3)},
		{Type: ipvsDestAttrInactiveConns, Data: ne32(7)},
	}
	if withAF {
		as = append(as, netlink.Attribute{Type: ipvsDestAttrAF, Data: ne16(syscall.AF_INET)})
	}
	return mustAttrs(nested(ipvsCmdAttrDest, as...))
}

func TestIPVSDecode(t *testing.T) {
	for _, persistent := range []bool{false, true} {
		s, err := decodeIPVSService(ipvsServiceMsg(persistent))
		if err != nil || !s.ok || s.vs.Addr.String() != "198.19.0.10:53" || s.vs.Protocol != "UDP" || s.vs.Scheduler != "rr" {
			t.Fatalf("service %+v, %v", s, err)
		}
		if want := map[bool]int{false: 0, true: 10800}[persistent]; s.vs.PersistentSeconds != want {
			t.Errorf("persistent %v: %d s of affinity", persistent, s.vs.PersistentSeconds)
		}
	}
	// A kernel that does not say the real server's family: the service's.
	for _, withAF := range []bool{true, false} {
		rs, ok, err := decodeIPVSDest(ipvsDestMsg(5, 0, withAF), syscall.AF_INET)
		if err != nil || !ok || rs.Addr.String() != "198.18.128.5:53" || rs.Weight != 0 || rs.ActiveConns != 3 || rs.InactiveConns != 7 {
			t.Fatalf("real server %+v, %v, %v", rs, ok, err)
		}
	}
	if _, err := decodeIPVSService([]byte{8, 0, 1, 0, 1}); err == nil {
		t.Error("a truncated message decoded")
	}
}

func FuzzIPVSDecode(f *testing.F) {
	f.Add(ipvsServiceMsg(true))
	f.Add(ipvsDestMsg(9, 1, true))
	f.Fuzz(func(t *testing.T, data []byte) {
		allocs := testing.AllocsPerRun(1, func() {
			decodeIPVSService(data)
			decodeIPVSDest(data, syscall.AF_INET)
		})
		if limit := 8 + float64(len(data))/8; allocs > limit {
			t.Fatalf("%d bytes decoded with %.0f allocations", len(data), allocs)
		}
	})
}
