package collector

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// nftSignal watches nf_tables, where both iptables-nft and kube-proxy's
// nftables mode keep their rules: every commit to any table of the network
// namespace bumps the ruleset generation (NFT_MSG_GETGEN), and ends with a
// NEWGEN message to the NFNLGRP_NFTABLES multicast group. The generation
// is exact: unchanged means no table of the namespace changed.
type nftSignal struct {
	mu   sync.Mutex
	conn *netlink.Conn // requests (GETGEN)

	events chan struct{}
	mon    *nfnlSub // the multicast subscription
	done   chan struct{}
	lost   atomic.Uint64
	sink   atomic.Value // NotificationSink: every notification goes there too
}

// Feed hands every notification the subscription receives to sink (the
// netlink readers learn new maps and touched chains from them).
func (s *nftSignal) Feed(sink NotificationSink) {
	s.sink.Store(sink)
	if sub, ok := sink.(interface{ Subscribed(bool) }); ok && s.mon != nil {
		sub.Subscribed(true)
	}
}

var _ ChangeSignal = (*nftSignal)(nil)

// nftGenType is the message type of a generation (request and reply).
const (
	nftGetGen = netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN)
	nftNewGen = netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWGEN)
)

// openNFTSignal opens the generation check and the notification
// subscription, with a receive buffer of that many bytes (0: the
// kernel's default).
func openNFTSignal(buffer int) (ChangeSignal, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("open nf_tables netlink: %w", err)
	}
	s := &nftSignal{conn: conn, events: make(chan struct{}, 1), done: make(chan struct{})}
	if _, err := s.Token(); err != nil {
		conn.Close()
		return nil, err
	}
	// A subscription that cannot be opened leaves the generation check
	// at every interval: slower, never silent.
	// Room for a commit's burst (SO_RCVBUFFORCE with CAP_NET_ADMIN): an
	// overrun is survived, but costs the readers what they would have
	// learnt.
	if mon, err := openNFNLSub(buffer); err == nil {
		s.mon = mon
		go s.watch()
	}
	return s, nil
}

// Token is the ruleset generation.
func (s *nftSignal) Token() (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	msgs, err := s.conn.Execute(netlink.Message{
		Header: netlink.Header{Type: nftGetGen, Flags: netlink.Request},
		Data:   []byte{unix.AF_UNSPEC, unix.NFNETLINK_V0, 0, 0},
	})
	if err != nil {
		return 0, fmt.Errorf("nf_tables generation: %w", err)
	}
	for _, m := range msgs {
		if m.Header.Type != nftNewGen {
			continue
		}
		if id, ok := nl.GenID(m.Data); ok {
			return uint64(id), nil
		}
	}
	return 0, errors.New("nf_tables generation: no NFTA_GEN_ID in the kernel's answer")
}

// Events fires after commits; a lost notification (the socket's buffer
// overran: ENOBUFS) fires too, so the caller checks the generation.
func (s *nftSignal) Events() <-chan struct{} {
	if s.mon == nil {
		return nil
	}
	return s.events
}

func (s *nftSignal) Lost() uint64 { return s.lost.Load() }

// Exact: every commit to any table of the namespace bumps the generation.
func (s *nftSignal) Exact() bool { return true }

func (s *nftSignal) fire() {
	select {
	case s.events <- struct{}{}:
	default:
	}
}

// watch reads the multicast group. Only the message types are looked at
// here: a commit's NEWGEN closes it; an overrun may have hidden one. The
// sink sees every message.
func (s *nftSignal) watch() {
	for {
		gen := false
		// The sink is looked up for each message, not once a receive: a
		// receive that began before Feed would otherwise hand what it
		// returns after Feed to no sink, and no lost notification would
		// say so (seen under -race: a commit's notes never arrived).
		err := s.mon.receive(func(typ, flags uint16, body []byte) {
			if sink, _ := s.sink.Load().(NotificationSink); sink != nil {
				noteSafely(sink, typ, flags, body)
			}
			gen = gen || netlink.HeaderType(typ) == nftNewGen
		})
		sink, _ := s.sink.Load().(NotificationSink)
		select {
		case <-s.done:
			return
		default:
		}
		if gen {
			s.fire()
		}
		if err == nil {
			continue
		}
		if errors.Is(err, unix.ENOBUFS) || errors.Is(err, errTruncated) {
			s.lost.Add(1)
			if sink != nil {
				sink.Lost()
			}
			s.fire()
			continue
		}
		if sink != nil {
			sink.Lost()
			if sub, ok := sink.(interface{ Subscribed(bool) }); ok {
				sub.Subscribed(false)
			}
		}
		// The subscription broke: say so once, through a generation
		// check, and stop (the interval check remains).
		s.fire()
		return
	}
}

// noteSafely hands a notification to the sink; one the sink cannot take
// (a bug, met with what a hostile process sent) loses the notes (the next
// read is whole) instead of the collector.
func noteSafely(sink NotificationSink, typ, flags uint16, body []byte) {
	defer func() {
		if recover() != nil {
			sink.Lost()
		}
	}()
	sink.Note(typ, flags, body)
}

func (s *nftSignal) Close() {
	close(s.done)
	if s.mon != nil {
		s.mon.Close()
	}
	s.conn.Close()
}

// legacySignal watches the legacy (x_tables) nat table through
// IPT_SO_GET_INFO: its size, entry count and hook offsets. It misses a
// rewrite that keeps all of them (one DNAT address replaced by another of
// the same length): the full read every FullReadInterval catches that.
// There are no notifications; a poller checks the info every legacyPoll
// (one getsockopt a family, about a microsecond each).
type legacySignal struct {
	fd     int
	fd6    int // -1 without IPv6
	mu     sync.Mutex
	events chan struct{}
	done   chan struct{}
}

var _ ChangeSignal = (*legacySignal)(nil)

// iptGetinfo is struct ipt_getinfo.
type iptGetinfo struct {
	Name       [32]byte
	ValidHooks uint32
	HookEntry  [5]uint32
	Underflow  [5]uint32
	NumEntries uint32
	Size       uint32
}

// iptSoGetInfo is IPT_SO_GET_INFO (IPT_BASE_CTL).
const iptSoGetInfo = 64

func openLegacySignal() (ChangeSignal, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, fmt.Errorf("open a raw socket for IPT_SO_GET_INFO: %w (the collector needs NET_RAW)", err)
	}
	s := &legacySignal{fd: fd, fd6: -1, events: make(chan struct{}, 1), done: make(chan struct{})}
	// ip6tables' nat table likewise; a kernel without IPv6 has none.
	if fd6, err := unix.Socket(unix.AF_INET6, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW); err == nil {
		s.fd6 = fd6
	}
	last, err := s.Token()
	if err != nil {
		s.closeFDs()
		return nil, err
	}
	go func() {
		t := time.NewTicker(legacyPoll)
		defer t.Stop()
		for {
			select {
			case <-s.done:
				return
			case <-t.C:
			}
			if tok, err := s.Token(); err != nil || tok != last {
				last = tok
				select {
				case s.events <- struct{}{}:
				default:
				}
			}
		}
	}()
	return s, nil
}

// legacyPoll: a tenth of a second, so that a flush on the legacy backend
// is read and reported within a second even at 10k services (a whole
// read there takes 0.8-0.9 s); polling costs ~20 µs of CPU a second.
const legacyPoll = 100 * time.Millisecond

// Token digests the nat tables' info (IPv4 and IPv6).
func (s *legacySignal) Token() (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	h := fnv.New64a()
	for _, q := range []struct {
		fd, level int
		name      string
	}{{s.fd, unix.SOL_IP, "iptables"}, {s.fd6, unix.SOL_IPV6, "ip6tables"}} {
		if q.fd < 0 {
			continue
		}
		info, errno := natInfo(q.fd, q.level)
		if errno == syscall.ENOENT {
			h.Write([]byte{0}) // no nat table (yet): a token of its own
			continue
		}
		if errno != 0 {
			return 0, fmt.Errorf("%s IPT_SO_GET_INFO nat: %w", q.name, errno)
		}
		binary.Write(h, binary.LittleEndian, [13]uint32{info.ValidHooks, info.HookEntry[0], info.HookEntry[1], info.HookEntry[2],
			info.HookEntry[3], info.HookEntry[4], info.Underflow[0], info.Underflow[1], info.Underflow[2], info.Underflow[3],
			info.Underflow[4], info.NumEntries, info.Size})
	}
	return h.Sum64() | 1, nil
}

func (s *legacySignal) Events() <-chan struct{} { return s.events }

func (s *legacySignal) Lost() uint64 { return 0 }

// Exact: a rewrite that keeps the table's size keeps the token.
func (s *legacySignal) Exact() bool { return false }

func (s *legacySignal) Close() {
	close(s.done)
	s.closeFDs()
}

func (s *legacySignal) closeFDs() {
	unix.Close(s.fd)
	if s.fd6 >= 0 {
		unix.Close(s.fd6)
	}
}

// openSignal opens the change signal of src: nf_tables for iptables-nft
// and nftables mode, IPT_SO_GET_INFO for the legacy backend, none for
// IPVS and Cilium's maps (which have neither a generation nor
// notifications).
func openSignal(src Source, buffer int) (ChangeSignal, error) {
	switch {
	case src.Mode == audit.ModeIPVS, src.Mode == audit.ModeCilium:
		return nil, nil
	case src.Legacy:
		return openLegacySignal()
	default:
		return openNFTSignal(buffer)
	}
}
