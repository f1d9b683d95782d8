package nl

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// GenSignal is the change signal of nf_tables (the collector's
// ChangeSignal for iptables-nft and nftables mode). It watches nf_tables, where both iptables-nft and kube-proxy's
// nftables mode keep their rules: every commit to any table of the network
// namespace bumps the ruleset generation (NFT_MSG_GETGEN), and ends with a
// NEWGEN message to the NFNLGRP_NFTABLES multicast group. The generation
// is exact: unchanged means no table of the namespace changed.
type GenSignal struct {
	mu   sync.Mutex
	conn *netlink.Conn // requests (GETGEN)

	events chan struct{}
	mon    *sub // the multicast subscription
	done   chan struct{}
	lost   atomic.Uint64
	sink   atomic.Value // Sink: every notification goes there too
}

// Feed hands every notification the subscription receives to sink (the
// netlink readers learn new maps and touched chains from them).
func (s *GenSignal) Feed(sink Sink) {
	s.sink.Store(sink)
	if sub, ok := sink.(interface{ Subscribed(bool) }); ok && s.mon != nil {
		sub.Subscribed(true)
	}
}

// nftGenType is the message type of a generation (request and reply).
const (
	nftGetGen = netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_GETGEN)
	nftNewGen = netlink.HeaderType(unix.NFNL_SUBSYS_NFTABLES<<8 | unix.NFT_MSG_NEWGEN)
)

// OpenGenSignal opens the generation check and the notification
// subscription, with a receive buffer of that many bytes (0: the
// kernel's default).
func OpenGenSignal(buffer int) (*GenSignal, error) {
	conn, err := netlink.Dial(unix.NETLINK_NETFILTER, nil)
	if err != nil {
		return nil, fmt.Errorf("open nf_tables netlink: %w", err)
	}
	s := &GenSignal{conn: conn, events: make(chan struct{}, 1), done: make(chan struct{})}
	if _, err := s.Token(); err != nil {
		conn.Close()
		return nil, err
	}
	// A subscription that cannot be opened leaves the generation check
	// at every interval: slower, never silent.
	// Room for a commit's burst (SO_RCVBUFFORCE with CAP_NET_ADMIN): an
	// overrun is survived, but costs the readers what they would have
	// learnt.
	if mon, err := openSub(buffer); err == nil {
		s.mon = mon
		go s.watch()
	}
	return s, nil
}

// Token is the ruleset generation.
func (s *GenSignal) Token() (uint64, error) {
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
		if id, ok := GenID(m.Data); ok {
			return uint64(id), nil
		}
	}
	return 0, errors.New("nf_tables generation: no NFTA_GEN_ID in the kernel's answer")
}

// Events fires after commits; a lost notification (the socket's buffer
// overran: ENOBUFS) fires too, so the caller checks the generation.
func (s *GenSignal) Events() <-chan struct{} {
	if s.mon == nil {
		return nil
	}
	return s.events
}

func (s *GenSignal) Lost() uint64 { return s.lost.Load() }

// Exact: every commit to any table of the namespace bumps the generation.
func (s *GenSignal) Exact() bool { return true }

func (s *GenSignal) fire() {
	select {
	case s.events <- struct{}{}:
	default:
	}
}

// watch reads the multicast group. Only the message types are looked at
// here: a commit's NEWGEN closes it; an overrun may have hidden one. The
// sink sees every message.
func (s *GenSignal) watch() {
	for {
		gen := false
		// The sink is looked up for each message, not once a receive: a
		// receive that began before Feed would otherwise hand what it
		// returns after Feed to no sink, and no lost notification would
		// say so (seen under -race: a commit's notes never arrived).
		err := s.mon.receive(func(typ, flags uint16, body []byte) {
			if sink, _ := s.sink.Load().(Sink); sink != nil {
				noteSafely(sink, typ, flags, body)
			}
			gen = gen || netlink.HeaderType(typ) == nftNewGen
		})
		sink, _ := s.sink.Load().(Sink)
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
func noteSafely(sink Sink, typ, flags uint16, body []byte) {
	defer func() {
		if recover() != nil {
			sink.Lost()
		}
	}()
	sink.Note(typ, flags, body)
}

func (s *GenSignal) Close() {
	close(s.done)
	if s.mon != nil {
		s.mon.Close()
	}
	s.conn.Close()
}
