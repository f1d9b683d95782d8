package collector

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// openNetfilter opens a netlink socket to nf_tables for requests.
func openNetfilter() (int, error) {
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

// nlAttr encodes one netlink attribute.
func nlAttr(typ uint16, v []byte) []byte {
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

// dump sends one nf_tables dump request of family fam and hands each
// reply's body to fn as it arrives. intr says the kernel flagged the dump
// interrupted by a commit (NLM_F_DUMP_INTR): its parts may not agree.
// The kernel's refusal comes back as its errno (ENOENT: no such table or
// chain).
//
// With maxParts above 0, it stops after that many datagrams and returns
// errDumpStopped: the rest of the dump is still due on the socket.
func (r *iptNFTReader) dump(ctx context.Context, msg uint16, fam int, attrs []byte, n *int64, maxParts int, fn func([]byte) error) (intr bool, err error) {
	r.seq++
	seq := r.seq
	req := make([]byte, unix.NLMSG_HDRLEN+4, unix.NLMSG_HDRLEN+4+len(attrs))
	req = append(req, attrs...)
	binary.NativeEndian.PutUint32(req, uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], unix.NFNL_SUBSYS_NFTABLES<<8|msg)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], seq)
	req[unix.NLMSG_HDRLEN] = nfproto(fam)
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
			done, in, err := nlMessages(b, seq, each)
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
func (r *iptNFTReader) recv() ([][]byte, error) {
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

// nlMessages hands each nf_tables message of request seq in one datagram
// to fn: done at the dump's end, intr if any was flagged interrupted, the
// kernel's errno if it refused.
func nlMessages(b []byte, seq uint32, fn func([]byte) error) (done, intr bool, err error) {
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

func nfproto(fam int) byte {
	if fam == 6 {
		return unix.NFPROTO_IPV6
	}
	return unix.NFPROTO_IPV4
}

// clip shortens a name the kernel gave for an error message.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
