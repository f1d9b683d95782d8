package nl

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sub is a subscription to the nf_tables notification group
// (NFNLGRP_NFTABLES), read in batches: the kernel sends each notification
// as a datagram of its own, and one kube-proxy sync at 10k services
// announces ~20k of them (its KUBE-SERVICES rewrite), which as one system
// call each cost ~50 ms of CPU here. recvmmsg takes up to subBatch per
// call. The socket is non-blocking under Go's poller, so Close wakes a
// waiting read.
type sub struct {
	f     *os.File
	rc    syscall.RawConn
	bufs  [][]byte
	iov   []unix.Iovec
	msgs  []unix.Mmsghdr
	names []unix.RawSockaddrNetlink
	// forged counts datagrams dropped for not coming from the kernel.
	forged int
}

const (
	subBatch = 64
	// subBuffer is each datagram's buffer: a notification is one message
	// (a rule of a few expressions, a set element), far smaller.
	subBuffer = 16 << 10
)

// openSub subscribes to NFNLGRP_NFTABLES with a receive buffer of
// buffer bytes (0: the kernel's default; SO_RCVBUFFORCE with
// CAP_NET_ADMIN, else SO_RCVBUF).
func openSub(buffer int) (*sub, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("nf_tables notifications: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1 << (unix.NFNLGRP_NFTABLES - 1)}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("nf_tables notifications: bind: %w", err)
	}
	if buffer > 0 {
		if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, buffer) != nil {
			_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, buffer)
		}
	}
	f := os.NewFile(uintptr(fd), "nf_tables notifications")
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	s := &sub{f: f, rc: rc, bufs: make([][]byte, subBatch), iov: make([]unix.Iovec, subBatch), msgs: make([]unix.Mmsghdr, subBatch),
		names: make([]unix.RawSockaddrNetlink, subBatch)}
	for i := range s.bufs {
		s.bufs[i] = make([]byte, subBuffer)
	}
	return s, nil
}

// errTruncated: a notification larger than its buffer (treated as lost).
var errTruncated = errors.New("a notification larger than its buffer")

// receive waits for notifications and hands each message to fn (type,
// flags, body), in the order the kernel sent them. ENOBUFS (the buffer
// overran: notifications were dropped) comes back as an error after the
// messages before it.
func (s *sub) receive(fn func(typ, flags uint16, body []byte)) error {
	var got int
	var errno syscall.Errno
	err := s.rc.Read(func(fd uintptr) bool {
		for i := range s.msgs {
			s.iov[i].Base = &s.bufs[i][0]
			s.iov[i].SetLen(len(s.bufs[i]))
			s.msgs[i] = unix.Mmsghdr{}
			s.msgs[i].Hdr.Iov = &s.iov[i]
			s.msgs[i].Hdr.SetIovlen(1)
			s.names[i] = unix.RawSockaddrNetlink{}
			s.msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&s.names[i]))
			s.msgs[i].Hdr.Namelen = uint32(unsafe.Sizeof(s.names[i]))
		}
		n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&s.msgs[0])), uintptr(len(s.msgs)), unix.MSG_DONTWAIT, 0, 0)
		if e == unix.EAGAIN || e == unix.EINTR {
			return false // wait for the poller
		}
		got, errno = int(n), e
		return true
	})
	if err != nil {
		return err
	}
	if errno != 0 {
		return errno
	}
	for i := range got {
		if s.names[i].Family != unix.AF_NETLINK || s.names[i].Pid != 0 {
			// Not the kernel's: any process that may send to the group
			// (CAP_NET_ADMIN in the namespace) could forge commits.
			s.forged++
			continue
		}
		if s.msgs[i].Hdr.Flags&unix.MSG_TRUNC != 0 {
			return errTruncated
		}
		for b := s.bufs[i][:s.msgs[i].Len]; len(b) >= unix.NLMSG_HDRLEN; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.NLMSG_HDRLEN || l > len(b) {
				break
			}
			fn(binary.NativeEndian.Uint16(b[4:]), binary.NativeEndian.Uint16(b[6:]), b[unix.NLMSG_HDRLEN:l])
			b = b[min((l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1), len(b)):]
		}
	}
	return nil
}

// Close ends the subscription; a receive under way returns an error.
func (s *sub) Close() error { return s.f.Close() }
