package iptables

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// LegacySignal watches the legacy (x_tables) nat table through
// IPT_SO_GET_INFO: its size, entry count and hook offsets. It misses a
// rewrite that keeps all of them (one DNAT address replaced by another of
// the same length): the full read every FullReadInterval catches that.
// There are no notifications; a poller checks the info every legacyPoll
// (one getsockopt a family, about a microsecond each).
type LegacySignal struct {
	fd     int
	fd6    int // -1 without IPv6
	mu     sync.Mutex
	events chan struct{}
	done   chan struct{}
}

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

func OpenLegacySignal() (*LegacySignal, error) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return nil, fmt.Errorf("open a raw socket for IPT_SO_GET_INFO: %w (the collector needs NET_RAW)", err)
	}
	s := &LegacySignal{fd: fd, fd6: -1, events: make(chan struct{}, 1), done: make(chan struct{})}
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
func (s *LegacySignal) Token() (uint64, error) {
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

func (s *LegacySignal) Events() <-chan struct{} { return s.events }

func (s *LegacySignal) Lost() uint64 { return 0 }

// Exact: a rewrite that keeps the table's size keeps the token.
func (s *LegacySignal) Exact() bool { return false }

func (s *LegacySignal) Close() {
	close(s.done)
	s.closeFDs()
}

func (s *LegacySignal) closeFDs() {
	unix.Close(s.fd)
	if s.fd6 >= 0 {
		unix.Close(s.fd6)
	}
}
