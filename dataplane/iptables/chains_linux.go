package iptables

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
	"unsafe"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// kernelChains checks chains in the kernel itself, on a host without the
// iptables tools: nf_tables over netlink (NFT_MSG_GETCHAIN), the legacy
// backend with IPT_SO_GET_ENTRIES.
type kernelChains struct {
	legacy bool
	fam    int
}

func (k kernelChains) ChainExists(table, chain string) (bool, error) {
	if k.legacy {
		return legacyChainExists(k.fam, table, chain)
	}
	return NFTChainExists(k.fam, table, chain)
}

// KernelChains opens chain checks without a binary.
func KernelChains(legacy, v6 bool) ChainChecker {
	fam := 4
	if v6 {
		fam = 6
	}
	return kernelChains{legacy: legacy, fam: fam}
}

// NFTChainExists asks nf_tables whether table has chain, in family fam.
func NFTChainExists(fam int, table, chain string) (bool, error) {
	c, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return false, fmt.Errorf("open nf_tables netlink: %w", err)
	}
	defer c.Close()
	body, err := netlink.MarshalAttributes([]netlink.Attribute{{Type: unix.NFTA_CHAIN_TABLE, Data: nl.CString(table)}, {Type: unix.NFTA_CHAIN_NAME, Data: nl.CString(chain)}})
	if err != nil {
		return false, err
	}
	_, err = c.Execute(netlink.Message{
		Header: netlink.Header{Type: netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETCHAIN), Flags: netlink.Request},
		Data:   append([]byte{nl.Proto(fam), unix.NFNETLINK_V0, 0, 0}, body...),
	})
	switch {
	case errors.Is(err, unix.ENOENT):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("nf_tables chain %s of table %s %s: %w", chain, nl.FamilyName(fam), table, err)
	}
	return true, nil
}

// legacyChainExists reads a legacy table's entries and looks for the
// chain's head (an ERROR target naming it).
func legacyChainExists(fam int, table, chain string) (bool, error) {
	af, level := unix.AF_INET, unix.SOL_IP
	if fam == 6 {
		af, level = unix.AF_INET6, unix.SOL_IPV6
	}
	fd, err := unix.Socket(af, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return false, fmt.Errorf("open a raw socket for IPT_SO_GET_INFO: %w (the collector needs NET_RAW)", err)
	}
	defer unix.Close(fd)
	for try := 0; try < 10; try++ {
		var info iptGetinfo
		copy(info.Name[:], table)
		size := uint32(unsafe.Sizeof(info))
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetInfo, uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0)
		if errno == syscall.ENOENT {
			return false, nil
		}
		if errno != 0 {
			return false, fmt.Errorf("%s IPT_SO_GET_INFO %s: %w", legacyTool(fam), table, errno)
		}
		buf := make([]byte, getEntriesHead+int(info.Size))
		copy(buf, table)
		binary.NativeEndian.PutUint32(buf[32:], info.Size)
		l := uint32(len(buf))
		_, _, errno = unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), iptSoGetEntries, uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&l)), 0)
		if errno == syscall.EAGAIN {
			continue
		}
		if errno != 0 {
			return false, fmt.Errorf("%s IPT_SO_GET_ENTRIES %s: %w", legacyTool(fam), table, errno)
		}
		return LegacyHasChain(buf[getEntriesHead:], fam, chain)
	}
	return false, fmt.Errorf("%s: the %s table kept changing", legacyTool(fam), table)
}
