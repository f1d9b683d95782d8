// Package nl holds what every netlink reader of the dataplanes shares
// (nf_tables for iptables-nft and nftables, IPVS's generic netlink,
// ctnetlink): a walker over a message's attributes that allocates nothing,
// and a dump peeked at for whether it holds anything. Pure but for
// PeekDump (Linux).
package nl

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
)

// Buffer is the size of a receive buffer dumps are read through: the
// kernel fills a datagram with as many messages as fit (a dump's part is
// at most 32 KiB) and the next read continues the dump.
const Buffer = 64 << 10

// The flags a netlink attribute's type carries beside it
// (NLA_F_NESTED, NLA_F_NET_BYTEORDER).
const typeFlags = 1<<15 | 1<<14

// Attrs walks the netlink attributes in a message: after each Next, Type
// (without the nested and byte-order flags) and Val. Malformed input ends
// the walk with Err set. The bytes come from the kernel, but a bug must
// never crash a reader or make it allocate: nothing here allocates.
type Attrs struct {
	b    []byte
	Type uint16
	Val  []byte
	Err  error
}

// Walk returns a walker over the attributes in b.
func Walk(b []byte) Attrs { return Attrs{b: b} }

// Next moves to the next attribute; false at the end or on malformed
// input (Err).
func (a *Attrs) Next() bool {
	if len(a.b) == 0 || a.Err != nil {
		return false
	}
	if len(a.b) < 4 {
		a.Err = errors.New("truncated attribute header")
		return false
	}
	l := int(binary.NativeEndian.Uint16(a.b))
	if l < 4 || l > len(a.b) {
		a.Err = fmt.Errorf("attribute length %d outside its message (%d bytes left)", l, len(a.b))
		return false
	}
	a.Type = binary.NativeEndian.Uint16(a.b[2:]) &^ typeFlags
	a.Val = a.b[4:l]
	pad := (l + 3) &^ 3
	if pad > len(a.b) {
		pad = len(a.b)
	}
	a.b = a.b[pad:]
	return true
}

// U32 is the attribute as a big-endian 32-bit value.
func (a *Attrs) U32() uint32 {
	if len(a.Val) < 4 {
		a.Err = fmt.Errorf("attribute %d: %d bytes, want 4", a.Type, len(a.Val))
		return 0
	}
	return binary.BigEndian.Uint32(a.Val)
}

// U64 is the attribute as a big-endian 64-bit value.
func (a *Attrs) U64() uint64 {
	if len(a.Val) < 8 {
		a.Err = fmt.Errorf("attribute %d: %d bytes, want 8", a.Type, len(a.Val))
		return 0
	}
	return binary.BigEndian.Uint64(a.Val)
}

// Str is a NUL-terminated string attribute.
func (a *Attrs) Str() string {
	v := a.Val
	for i, c := range v {
		if c == 0 {
			v = v[:i]
			break
		}
	}
	return string(v)
}

// Body skips an nf_tables message's nfgenmsg header; what names the
// message in the error.
func Body(data []byte, what string) (Attrs, error) {
	if len(data) < 4 {
		return Attrs{}, fmt.Errorf("nf_tables %s: message shorter than its header", what)
	}
	return Walk(data[4:]), nil
}

// MaxRuleExprs bounds the expressions of one nf_tables rule a decoder
// reads: kube-proxy (either mode) writes a handful.
const MaxRuleExprs = 64

// AddrLen is the length of an address of family (4 or 6) in an nf_tables
// register or key.
func AddrLen(family int) int {
	if family == 6 {
		return 16
	}
	return 4
}

// CStr is b up to its first NUL (a kernel string attribute or field).
func CStr(b []byte) []byte {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		return b[:i]
	}
	return b
}

// FamilyName is nft's name of IP family fam: ip, ip6.
func FamilyName(fam int) string {
	if fam == 6 {
		return "ip6"
	}
	return "ip"
}
