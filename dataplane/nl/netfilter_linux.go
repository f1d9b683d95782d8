package nl

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// OpenNetfilter opens a netlink socket to nf_tables for requests.
func OpenNetfilter() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return -1, fmt.Errorf("nf_tables netlink socket: %w (the collector needs CAP_NET_ADMIN in the node's network namespace)", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("nf_tables netlink bind: %w", err)
	}
	// A receive that waits a second looks at the context again.
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1})
	return fd, nil
}

// Attr encodes one netlink attribute.
func Attr(typ uint16, v []byte) []byte {
	l := 4 + len(v)
	b := make([]byte, 4, (l+3)&^3)
	binary.NativeEndian.PutUint16(b, uint16(l))
	binary.NativeEndian.PutUint16(b[2:], typ)
	b = append(b, v...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

// Messages hands each nf_tables message of request seq in one datagram
// to fn: done at the dump's end, intr if any was flagged interrupted, the
// kernel's errno if it refused.
func Messages(b []byte, seq uint32, fn func([]byte) error) (done, intr bool, err error) {
	for len(b) > 0 {
		if len(b) < unix.NLMSG_HDRLEN {
			return false, intr, errors.New("truncated netlink header")
		}
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return false, intr, fmt.Errorf("netlink message length %d of %d bytes", l, len(b))
		}
		typ := binary.NativeEndian.Uint16(b[4:])
		flags := binary.NativeEndian.Uint16(b[6:])
		msgSeq := binary.NativeEndian.Uint32(b[8:])
		body := b[unix.NLMSG_HDRLEN:l]
		b = b[min((l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1), len(b)):]
		if msgSeq != seq {
			continue
		}
		intr = intr || flags&unix.NLM_F_DUMP_INTR != 0
		switch typ {
		case unix.NLMSG_DONE:
			return true, intr, nil
		case unix.NLMSG_ERROR:
			if len(body) >= 4 {
				if errno := -int32(binary.NativeEndian.Uint32(body)); errno != 0 {
					return true, intr, os.NewSyscallError("nf_tables", unix.Errno(errno))
				}
			}
			return true, intr, nil
		}
		if typ>>8 == unix.NFNL_SUBSYS_NFTABLES {
			if err := fn(body); err != nil {
				return false, intr, err
			}
		}
	}
	return false, intr, nil
}

func Proto(fam int) byte {
	if fam == 6 {
		return unix.NFPROTO_IPV6
	}
	return unix.NFPROTO_IPV4
}

// Clip shortens a name the kernel gave for an error message.
func Clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}

func CString(s string) []byte { return append([]byte(s), 0) }

// ChainOf reads a NEWCHAIN body's table and chain name.
func ChainOf(data []byte) (table, name string) {
	a, err := Body(data, "chain")
	if err != nil {
		return "", ""
	}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_CHAIN_TABLE:
			table = a.Str()
		case unix.NFTA_CHAIN_NAME:
			name = a.Str()
		}
	}
	return table, name
}

// InterruptedTries is how many interrupted dumps a read tries again.
const InterruptedTries = 3

// MaxChainReads is the most chains a read dumps one by one; more touched
// since the last read (a flush, kube-proxy's full sync) is a whole read.
const MaxChainReads = 4096

// RuleChainOf reads a rule message's table, chain and handle (the
// kernel puts them first, before the expressions).
func RuleChainOf(data []byte) (table, chain []byte, handle uint64) {
	a, err := Body(data, "rule")
	if err != nil {
		return nil, nil, 0
	}
	for a.Next() {
		switch a.Type {
		case unix.NFTA_RULE_TABLE:
			table = CStr(a.Val)
		case unix.NFTA_RULE_CHAIN:
			chain = CStr(a.Val)
		case unix.NFTA_RULE_HANDLE:
			handle = a.U64()
		case unix.NFTA_RULE_EXPRESSIONS:
			return table, chain, handle
		}
	}
	return table, chain, handle
}

// TableName reads NFTA_TABLE_NAME from an NFT_MSG_NEWTABLE or DELTABLE
// body.
func TableName(data []byte) string {
	a, err := Body(data, "table")
	if err != nil {
		return ""
	}
	for a.Next() {
		if a.Type == unix.NFTA_TABLE_NAME {
			return a.Str()
		}
	}
	return ""
}

// GenID reads NFTA_GEN_ID from a NEWGEN message body (nfgenmsg header,
// then attributes).
func GenID(data []byte) (uint32, bool) {
	if len(data) < 4 {
		return 0, false
	}
	ad, err := netlink.NewAttributeDecoder(data[4:])
	if err != nil {
		return 0, false
	}
	ad.ByteOrder = binary.BigEndian
	for ad.Next() {
		if ad.Type() == unix.NFTA_GEN_ID {
			return ad.Uint32(), ad.Err() == nil
		}
	}
	return 0, false
}

// ErrDumpInterrupted: every try of a dump was interrupted by a commit.
var ErrDumpInterrupted = errors.New("every try of the dump was interrupted by a commit")

// Message types newer than golang.org/x/sys knows (Linux 6.3's destroy
// commands; the kernel announces them as deletions, taken as such).
const (
	MsgDestroyTable   = 26
	MsgDestroyChain   = 27
	MsgDestroyRule    = 28
	MsgDestroySet     = 29
	MsgDestroySetElem = 30
)
