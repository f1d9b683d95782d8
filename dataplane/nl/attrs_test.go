package nl_test

import (
	"encoding/binary"
	"testing"

	"github.com/mdlayher/netlink"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

func marshal(t *testing.T, as ...netlink.Attribute) []byte {
	t.Helper()
	b, err := netlink.MarshalAttributes(as)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The walker reads what mdlayher/netlink writes: types without their
// nested and byte-order flags, padded values, strings up to their NUL,
// big-endian numbers.
func TestWalkReadsWhatNetlinkWrites(t *testing.T) {
	b := marshal(t,
		netlink.Attribute{Type: 1, Data: []byte("kube-proxy\x00")},
		netlink.Attribute{Type: 2 | netlink.Nested, Data: marshal(t, netlink.Attribute{Type: 7, Data: binary.BigEndian.AppendUint32(nil, 42)})},
		netlink.Attribute{Type: 3 | netlink.NetByteOrder, Data: binary.BigEndian.AppendUint64(nil, 1<<40)},
		netlink.Attribute{Type: 4, Data: []byte{1}},
	)
	a := nl.Walk(b)
	var got []any
	for a.Next() {
		switch a.Type {
		case 1:
			got = append(got, a.Str())
		case 2:
			in := nl.Walk(a.Val)
			for in.Next() {
				got = append(got, in.Type, in.U32())
			}
		case 3:
			got = append(got, a.U64())
		case 4:
			got = append(got, len(a.Val))
		}
	}
	want := []any{"kube-proxy", uint16(7), uint32(42), uint64(1 << 40), 1}
	if a.Err != nil || len(got) != len(want) {
		t.Fatalf("walked %v (err %v), want %v", got, a.Err, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("walked %v, want %v", got, want)
		}
	}
}

// Malformed input ends the walk with an error, never a panic or a read
// past the message.
func TestWalkStopsAtMalformedInput(t *testing.T) {
	for name, b := range map[string][]byte{
		"truncated header":    {8, 0},
		"length past the end": {200, 0, 1, 0, 0, 0, 0, 0},
		"length below header": {2, 0, 1, 0},
	} {
		a := nl.Walk(b)
		for a.Next() {
		}
		if a.Err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	a := nl.Walk(marshal(t, netlink.Attribute{Type: 1, Data: []byte{1, 2}}))
	if !a.Next() || a.U32() != 0 || a.Err == nil || a.Next() {
		t.Errorf("a 2-byte attribute read as 4: err %v", a.Err)
	}
}

// FuzzWalk: any bytes walk to their end or to an error, allocating
// nothing but that error's message.
func FuzzWalk(f *testing.F) {
	f.Add([]byte{8, 0, 1, 0, 0, 0, 0, 42})
	f.Add([]byte{5, 0, 1, 0, 'x', 0, 0, 0, 4, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		var err error
		allocs := testing.AllocsPerRun(1, func() {
			a := nl.Walk(b)
			for a.Next() {
				_ = a.U32()
			}
			err = a.Err
		})
		if err == nil && allocs > 0 || allocs > 6 { // 6: fmt.Errorf's, once
			t.Fatalf("%d allocations walking %d bytes (error: %v)", int(allocs), len(b), err)
		}
	})
}
