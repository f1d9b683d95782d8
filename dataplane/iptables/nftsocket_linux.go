package iptables

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// dump sends one nf_tables dump request of family fam and hands each
// reply's body to fn as it arrives. intr says the kernel flagged the dump
// interrupted by a commit (NLM_F_DUMP_INTR): its parts may not agree.
// The kernel's refusal comes back as its errno (ENOENT: no such table or
// chain).
//
// With maxParts above 0, it stops after that many datagrams and returns
// errDumpStopped: the rest of the dump is still due on the socket.
func (r *NFTReader) dump(ctx context.Context, msg uint16, fam int, attrs []byte, n *int64, maxParts int, fn func([]byte) error) (intr bool, err error) {
	r.seq++
	seq := r.seq
	req := make([]byte, unix.NLMSG_HDRLEN+4, unix.NLMSG_HDRLEN+4+len(attrs))
	req = append(req, attrs...)
	binary.NativeEndian.PutUint32(req, uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.NFNL_SUBSYS_NFTABLES<<8|msg)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], seq)
	req[unix.NLMSG_HDRLEN] = nl.Proto(fam)
	req[unix.NLMSG_HDRLEN+1] = unix.NFNETLINK_V0
	if err := unix.Sendto(r.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("dump request: %w", err)
	}
	var ferr error
	each := func(body []byte) error {
		if ferr != nil {
			return nil // drain the dump; the first error stands
		}
		ferr = fn(body)
		return nil
	}
	for parts := 0; ; {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		if maxParts > 0 && parts >= maxParts {
			return intr, errDumpStopped
		}
		got, err := r.recv()
		switch {
		case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return false, fmt.Errorf("reading the dump: %w", err)
		}
		for _, b := range got {
			parts++
			*n += int64(len(b))
			done, in, err := nl.Messages(b, seq, each)
			intr = intr || in
			if err != nil {
				return false, err
			}
			if done {
				return intr, ferr
			}
		}
	}
}

// recv receives up to two datagrams in one system call (recvmmsg): a
// small chain's dump is its rules and then the kernel's NLMSG_DONE, and a
// read costs a few microseconds of system call on its own.
func (r *NFTReader) recv() ([][]byte, error) {
	if r.bufs[0] == nil {
		r.bufs = [2][]byte{make([]byte, nl.Buffer), make([]byte, nl.Buffer)}
	}
	var iov [2]unix.Iovec
	var msgs [2]unix.Mmsghdr
	var names [2]unix.RawSockaddrNetlink
	for i := range iov {
		iov[i].Base = &r.bufs[i][0]
		iov[i].SetLen(len(r.bufs[i]))
		msgs[i].Hdr.Iov = &iov[i]
		msgs[i].Hdr.SetIovlen(1)
		msgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&names[i]))
		msgs[i].Hdr.Namelen = uint32(unsafe.Sizeof(names[i]))
	}
	got, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(r.fd), uintptr(unsafe.Pointer(&msgs[0])), 2, unix.MSG_WAITFORONE, 0, 0)
	if errno != 0 {
		return nil, errno
	}
	out := r.got[:0]
	for i := range int(got) {
		if names[i].Pid != 0 {
			continue // not the kernel's answer: a process sent it to this socket
		}
		if msgs[i].Hdr.Flags&unix.MSG_TRUNC != 0 {
			return nil, errors.New("a netlink datagram larger than the receive buffer")
		}
		out = append(out, r.bufs[i][:msgs[i].Len])
	}
	r.got = out
	return out, nil
}
