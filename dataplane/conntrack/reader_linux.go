package conntrack

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
)

const (
	nfnlSubsysCTNetlink = 1
	ipctnlMsgCTNew      = 0
	ipctnlMsgCTGet      = 1
	// ctBuffer is the one receive buffer a dump is read through: the
	// kernel fills it with as many entries as fit, and the next read
	// continues the dump, so memory does not grow with the table.
	ctBuffer = 64 << 10
	// ctMaxPairs bounds the distinct (frontend, destination) pairs one
	// read keeps; entries beyond it are counted as dropped.
	ctMaxPairs = 20000
)

// Reader reads the kernel's connection-tracking table over
// netlink (ctnetlink), streaming: one dump, asked of the kernel for
// DNATed entries only (CTA_STATUS/CTA_STATUS_MASK, honoured since Linux
// 6.0; earlier kernels send every entry and the reader skips the rest),
// decoded in place from one 64 KiB buffer and counted per frontend and
// destination. A table of a million entries costs the pairs it holds.
type Reader struct {
	// MaxPairs bounds the distinct pairs (default 20,000).
	MaxPairs int
	bytes    atomic.Int64
	buf      []byte // kept between reads (one goroutine reads)
}

// BytesRead is how many bytes of dump the reader has taken from the
// kernel, all reads together.
func (r *Reader) BytesRead() int64 { return r.bytes.Load() }

// Read counts the flows DNATed to the node's frontends (from its rules as
// last read), in both IP families.
func (r *Reader) Read(ctx context.Context, frontends []audit.FrontendKey) (*audit.Conntrack, error) {
	local, err := localAddrs()
	if err != nil {
		return nil, fmt.Errorf("conntrack: the node's addresses (for node ports): %w", err)
	}
	max := r.MaxPairs
	if max <= 0 {
		max = ctMaxPairs
	}
	agg := NewCounter(frontends, func(a netip.Addr) bool { return local[a] }, max)
	to := readCTTimeouts("/proc/sys/net/netfilter")
	if err := r.dump(ctx, countInto(agg, time.Now(), &to)); err != nil {
		return nil, err
	}
	return agg.Result([]int{4, 6}), nil
}

// readCTTimeouts reads the node's conntrack timeouts from dir (the
// sysctls of the collector's network namespace, the node's); one that
// cannot be read keeps the kernel's default.
func readCTTimeouts(dir string) ctTimeouts {
	to := defaultCTTimeouts
	read := func(name string, v *uint32) {
		b, err := os.ReadFile(dir + "/" + name)
		if err != nil {
			return
		}
		var n uint32
		if _, err := fmt.Sscan(string(b), &n); err == nil && n > 0 {
			*v = n
		}
	}
	read("nf_conntrack_udp_timeout", &to.udp)
	read("nf_conntrack_udp_timeout_stream", &to.udpStream)
	for i, st := range tcpStates {
		if st == "NONE" || st == "SYN_SENT2" {
			continue
		}
		read("nf_conntrack_tcp_timeout_"+strings.ToLower(st), &to.tcp[i])
	}
	to.tcp[9] = to.tcp[1] // SYN_SENT2 shares SYN_SENT's
	read("nf_conntrack_tcp_timeout_max_retrans", &to.tcpMaxRetrans)
	read("nf_conntrack_tcp_timeout_unacknowledged", &to.tcpUnack)
	return to
}

func localAddrs() (map[netip.Addr]bool, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, err
	}
	out := map[netip.Addr]bool{}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok {
				out[ip.Unmap()] = true
			}
		}
	}
	return out, nil
}

// dump runs one ctnetlink dump of DNATed entries and hands each entry's
// message body to fn as it arrives.
func (r *Reader) dump(ctx context.Context, fn func(body []byte) error) error {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return fmt.Errorf("conntrack: netlink socket: %w (the collector needs CAP_NET_ADMIN in the node's network namespace, as the chart gives it; --conntrack-interval=0 turns conntrack reading off)", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("conntrack: bind: %w", err)
	}
	// A read that waits a second looks at ctx again.
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 1})
	const seq = 1
	req := ctDumpRequest(seq)
	if err := unix.Sendto(fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return fmt.Errorf("conntrack: dump request: %w", err)
	}
	if r.buf == nil {
		r.buf = make([]byte, ctBuffer)
	}
	buf := r.buf
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, _, err := unix.Recvfrom(fd, buf, 0)
		switch {
		case errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.ENOBUFS):
			return errors.New("conntrack: the kernel dropped part of the dump (ENOBUFS); the next read starts again")
		case err != nil:
			return fmt.Errorf("conntrack: reading the dump: %w", err)
		}
		r.bytes.Add(int64(n))
		done, err := ctMessages(buf[:n], seq, fn)
		if err != nil || done {
			return err
		}
	}
}

// ctDumpRequest is IPCTNL_MSG_CT_GET with NLM_F_DUMP for both families,
// filtered by the kernel to entries with IPS_DST_NAT.
func ctDumpRequest(seq uint32) []byte {
	dnat := binary.BigEndian.AppendUint32(nil, ipsDstNAT)
	attrs := append(ctAttr(ctaStatus, dnat), ctAttr(ctaStatusMask, dnat)...)
	return ctMessage(ipctnlMsgCTGet, unix.NLM_F_REQUEST|unix.NLM_F_DUMP, seq, unix.AF_UNSPEC, attrs)
}

// ctMessage is one ctnetlink request: the netlink header, nfgenmsg
// (family, version, resource ID) and the attributes.
func ctMessage(typ, flags uint16, seq uint32, family uint8, attrs []byte) []byte {
	msg := make([]byte, unix.NLMSG_HDRLEN+4, unix.NLMSG_HDRLEN+4+len(attrs))
	msg = append(msg, attrs...)
	binary.NativeEndian.PutUint32(msg, uint32(len(msg)))
	binary.NativeEndian.PutUint16(msg[4:], nfnlSubsysCTNetlink<<8|typ)
	binary.NativeEndian.PutUint16(msg[6:], flags)
	binary.NativeEndian.PutUint32(msg[8:], seq)
	msg[unix.NLMSG_HDRLEN] = family
	msg[unix.NLMSG_HDRLEN+1] = unix.NFNETLINK_V0
	return msg
}

// ctMessages hands each conntrack entry in one datagram to fn; done at
// the dump's end.
func ctMessages(b []byte, seq uint32, fn func([]byte) error) (done bool, err error) {
	for len(b) > 0 {
		if len(b) < unix.NLMSG_HDRLEN {
			return false, errors.New("conntrack: truncated netlink header")
		}
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			return false, fmt.Errorf("conntrack: netlink message length %d of %d bytes", l, len(b))
		}
		typ := binary.NativeEndian.Uint16(b[4:])
		msgSeq := binary.NativeEndian.Uint32(b[8:])
		body := b[unix.NLMSG_HDRLEN:l]
		next := (l + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1)
		if next > len(b) {
			next = len(b)
		}
		b = b[next:]
		if msgSeq != seq {
			continue
		}
		switch typ {
		case unix.NLMSG_DONE:
			return true, nil
		case unix.NLMSG_ERROR:
			if len(body) >= 4 {
				if errno := -int32(binary.NativeEndian.Uint32(body)); errno != 0 {
					return false, fmt.Errorf("conntrack: the kernel refused the dump: %w", os.NewSyscallError("ctnetlink", unix.Errno(errno)))
				}
			}
			return true, nil
		case nfnlSubsysCTNetlink<<8 | ipctnlMsgCTNew:
			if err := fn(body); err != nil {
				return false, err
			}
		}
	}
	return false, nil
}

const (
	ipctnlMsgCTDelete = 2
	// ctMaxDeletes bounds the entries one flush deletes (and remembers
	// between the dump and the deletes: 48 bytes each).
	ctMaxDeletes = 100_000
)

// victim is an entry a flush deletes: what names it to the kernel.
type victim struct {
	family           uint8
	proto            uint8
	origSrc, origDst netip.AddrPort
	id               uint32
	target           int
}

// Delete deletes the conntrack entries of each target (see FlushTarget)
// and says how many per target. One dump finds them (DNATed entries
// only, through the reader's buffer); each is then deleted by its
// original tuple and its ID, so that a flow that ended meanwhile and a new
// one on the same tuple is left alone. An entry already gone is not
// counted. At most 100,000 entries a call; the rest wait for the next.
func (r *Reader) Delete(ctx context.Context, targets []FlushTarget) ([]int, error) {
	local, err := localAddrs()
	if err != nil {
		return nil, fmt.Errorf("conntrack: the node's addresses (for node ports): %w", err)
	}
	isLocal := func(a netip.Addr) bool { return local[a] }
	var victims []victim
	err = r.dump(ctx, func(body []byte) error {
		var e ctEntry
		if err := decodeCT(body, &e); err != nil {
			return err
		}
		for i := range targets {
			if len(victims) < ctMaxDeletes && targets[i].matches(&e, isLocal) {
				victims = append(victims, victim{family: e.family, proto: e.proto, origSrc: e.origSrc, origDst: e.origDst, id: e.id, target: i})
				break
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	deleted := make([]int, len(targets))
	if len(victims) == 0 {
		return deleted, nil
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return deleted, fmt.Errorf("conntrack: netlink socket: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return deleted, fmt.Errorf("conntrack: bind: %w", err)
	}
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &unix.Timeval{Sec: 5})
	ack := make([]byte, 4096)
	for i, v := range victims {
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		seq := uint32(i + 2)
		if err := unix.Sendto(fd, ctDeleteRequest(seq, &v), 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
			return deleted, fmt.Errorf("conntrack: delete request: %w", err)
		}
		errno, err := ctAck(fd, ack, seq)
		switch {
		case err != nil:
			return deleted, err
		case errno == 0:
			deleted[v.target]++
		case errno == unix.ENOENT:
			// Gone meanwhile (timed out, or kube-proxy deleted it).
		default:
			return deleted, fmt.Errorf("conntrack: the kernel refused a delete: %w", os.NewSyscallError("ctnetlink", errno))
		}
	}
	return deleted, nil
}

// ctDeleteRequest is IPCTNL_MSG_CT_DELETE of one entry: its original
// tuple and its ID, acknowledged.
func ctDeleteRequest(seq uint32, v *victim) []byte {
	src, dst := v.origSrc.Addr(), v.origDst.Addr()
	var ip []byte
	if v.family == unix.AF_INET6 {
		s, d := src.As16(), dst.As16()
		ip = append(ctAttr(ctaIPv6Src, s[:]), ctAttr(ctaIPv6Dst, d[:])...)
	} else {
		s, d := src.Unmap().As4(), dst.Unmap().As4()
		ip = append(ctAttr(ctaIPv4Src, s[:]), ctAttr(ctaIPv4Dst, d[:])...)
	}
	attrs := append(ctNested(ctaTupleOrig,
		ctNested(ctaTupleIP, ip),
		ctNested(ctaTupleProto, ctAttr(ctaProtoNum, []byte{v.proto}), ctAttr(ctaProtoSrcPort, be16(v.origSrc.Port())), ctAttr(ctaProtoDstPort, be16(v.origDst.Port())))),
		ctAttr(ctaID, binary.BigEndian.AppendUint32(nil, v.id))...)
	return ctMessage(ipctnlMsgCTDelete, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq, v.family, attrs)
}

// ctAck reads the acknowledgement of request seq: its errno (0: done).
func ctAck(fd int, buf []byte, seq uint32) (unix.Errno, error) {
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return 0, fmt.Errorf("conntrack: reading the kernel's answer to a delete: %w", err)
		}
		for b := buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.NLMSG_HDRLEN || l > len(b) {
				return 0, fmt.Errorf("conntrack: netlink message length %d of %d bytes", l, len(b))
			}
			typ, s := binary.NativeEndian.Uint16(b[4:]), binary.NativeEndian.Uint32(b[8:])
			if s == seq && typ == unix.NLMSG_ERROR && l >= unix.NLMSG_HDRLEN+4 {
				return unix.Errno(-int32(binary.NativeEndian.Uint32(b[unix.NLMSG_HDRLEN:]))), nil
			}
			b = b[min((l+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1), len(b)):]
		}
	}
}
