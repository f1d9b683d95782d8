package nl

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// PeekDump asks the kernel for a dump on a socket of its own and reads
// only its first part: whether the dump holds anything at all. The socket
// is closed with the rest unread (the kernel drops the dump), so a peek
// at a table of 10k entries costs one part (~100), not the table. Not for
// nf_tables: closing one of its sockets waits for the kernel to free what
// earlier commits deleted.
// Datagrams not from the kernel are dropped. A refusal comes back as the
// kernel's errno.
func PeekDump(proto int, typ uint16, body []byte) (bool, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return false, fmt.Errorf("netlink socket: %w", err)
	}
	defer unix.Close(fd)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1})
	var s [4]byte
	_, _ = rand.Read(s[:])
	seq := binary.NativeEndian.Uint32(s[:]) | 1
	req := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
	req = append(req, body...)
	binary.NativeEndian.PutUint32(req, uint32(len(req)))
	binary.NativeEndian.PutUint16(req[4:], typ)
	binary.NativeEndian.PutUint16(req[6:], unix.NLM_F_REQUEST|unix.NLM_F_DUMP)
	binary.NativeEndian.PutUint32(req[8:], seq)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return false, fmt.Errorf("netlink request: %w", err)
	}
	buf := make([]byte, Buffer)
	for {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return false, fmt.Errorf("netlink answer: %w", err)
		}
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue // not the kernel's
		}
		any, done, err := firstPart(buf[:n], seq)
		if err != nil || any || done {
			return any, err
		}
	}
}

// firstPart reads one datagram of a dump's answer to request seq: any
// says it holds a message of the dump, done that the dump ended (or was
// refused: err).
func firstPart(b []byte, seq uint32) (any, done bool, err error) {
	for len(b) >= unix.NLMSG_HDRLEN {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return false, true, errors.New("malformed netlink answer")
		}
		typ := binary.NativeEndian.Uint16(b[4:])
		body := b[unix.NLMSG_HDRLEN:l]
		if binary.NativeEndian.Uint32(b[8:]) == seq {
			switch typ {
			case unix.NLMSG_DONE:
				return false, true, nil
			case unix.NLMSG_ERROR:
				if len(body) >= 4 {
					if errno := -int32(binary.NativeEndian.Uint32(body)); errno != 0 {
						return false, true, unix.Errno(errno)
					}
				}
				return false, true, nil
			case unix.NLMSG_NOOP:
			default:
				return true, false, nil
			}
		}
		b = b[min((l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1), len(b)):]
	}
	return false, false, nil
}
