package iptables

import (
	"context"
	"encoding/binary"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// What the recaptures of package iptables_test read, as the readers read
// it (that package needs localcluster, which imports this one).

// DumpNAT hands each rule message of family fam's nat table to fn, as the
// iptables-nft reader dumps it.
func DumpNAT(ctx context.Context, fam int, fn func([]byte) error) error {
	fd, err := nl.OpenNetfilter()
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	r := NewNFTReader(nil)
	r.fd = fd
	var n int64
	_, err = r.dump(ctx, unix.NFT_MSG_GETRULE, fam, nl.Attr(unix.NFTA_RULE_TABLE, nl.CString("nat")), &n, 0, fn)
	return err
}

// LegacyNATEntries returns family fam's legacy nat table as
// IPT_SO_GET_ENTRIES returns it (nil without one).
func LegacyNATEntries(fam int) ([]byte, error) {
	af, level := unix.AF_INET, unix.SOL_IP
	if fam == 6 {
		af, level = unix.AF_INET6, unix.SOL_IPV6
	}
	fd, err := unix.Socket(af, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	info, errno := natInfo(fd, level)
	if errno == unix.ENOENT {
		return nil, nil
	}
	if errno != 0 {
		return nil, errno
	}
	buf := make([]byte, getEntriesHead+int(info.Size))
	copy(buf, "nat")
	binary.NativeEndian.PutUint32(buf[32:], info.Size)
	l := uint32(len(buf))
	if _, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetEntries, uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0); errno != 0 {
		return nil, errno
	}
	return buf[getEntriesHead:], nil
}
