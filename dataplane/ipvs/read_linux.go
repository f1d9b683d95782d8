package ipvs

import (
	"context"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"syscall"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/proxyaudit/proxyaudit/dataplane/nl"
)

// genlIPVS reads the IPVS table over generic netlink (mdlayher/genetlink):
// one services dump, then one destinations dump per virtual server (the
// kernel answers destinations only per service). It decodes only the
// attributes the audit reads, with the allocation-free attribute walker,
// straight into the audit's virtual servers.
type genlIPVS struct {
	c   *genetlink.Conn
	fam genetlink.Family
}

// IPVS generic netlink commands and attributes (linux/ip_vs.h).
const (
	ipvsCmdGetService = 4
	ipvsCmdGetDest    = 8

	ipvsCmdAttrService = 1
	ipvsCmdAttrDest    = 2

	ipvsSvcAttrAF       = 1
	ipvsSvcAttrProtocol = 2
	ipvsSvcAttrAddr     = 3
	ipvsSvcAttrPort     = 4
	ipvsSvcAttrFWMark   = 5
	ipvsSvcAttrSched    = 6
	ipvsSvcAttrFlags    = 7
	ipvsSvcAttrTimeout  = 8

	ipvsDestAttrAddr          = 1
	ipvsDestAttrPort          = 2
	ipvsDestAttrWeight        = 4
	ipvsDestAttrActiveConns   = 7
	ipvsDestAttrInactiveConns = 8
	ipvsDestAttrAF            = 11

	ipvsSvcPersistent = 0x1 // IP_VS_SVC_F_PERSISTENT: session affinity
)

func Open() (Table, error) {
	// Without the module the IPVS family does not exist. A collector image
	// needs no kmod: the table is there or not, and this says so.
	if _, err := os.Stat("/proc/net/ip_vs"); err != nil {
		return nil, fmt.Errorf("open IPVS netlink: this kernel has no IPVS table (%v): is the ip_vs module loaded? kube-proxy in IPVS mode loads it", err)
	}
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("open generic netlink: %w", err)
	}
	fam, err := c.GetFamily("IPVS")
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("IPVS netlink family: %w (is the ip_vs module loaded?)", err)
	}
	return &genlIPVS{c: c, fam: fam}, nil
}

func (g *genlIPVS) Close() { g.c.Close() }

// ipvsService is a virtual server as the dump names it: its key for the
// destinations request, and what the audit reads.
type ipvsService struct {
	af, proto uint16
	addr      []byte
	port      []byte // big-endian, as sent back
	fwmark    uint32
	vs        VirtualServer
	ok        bool
}

func (g *genlIPVS) VirtualServers(ctx context.Context) ([]VirtualServer, error) {
	msgs, err := g.c.Execute(genetlink.Message{Header: genetlink.Header{Command: ipvsCmdGetService, Version: g.fam.Version}},
		g.fam.ID, netlink.Request|netlink.Dump)
	if err != nil {
		return nil, fmt.Errorf("IPVS services: %w", err)
	}
	vs := make([]VirtualServer, 0, len(msgs))
	for _, m := range msgs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		s, err := decodeIPVSService(m.Data)
		if err != nil {
			return nil, fmt.Errorf("IPVS services: %w", err)
		}
		if !s.ok || s.fwmark != 0 {
			continue // kube-proxy programs no firewall-mark services
		}
		if err := g.destinations(&s); err != nil {
			return nil, fmt.Errorf("IPVS real servers of %s: %w", s.vs.Addr, err)
		}
		vs = append(vs, s.vs)
	}
	return vs, nil
}

// AnyVirtualServer peeks at the first part of a services dump.
func (g *genlIPVS) AnyVirtualServer() (bool, error) {
	return nl.PeekDump(unix.NETLINK_GENERIC, g.fam.ID, []byte{ipvsCmdGetService, g.fam.Version, 0, 0})
}

// destinations dumps one virtual server's real servers.
func (g *genlIPVS) destinations(s *ipvsService) error {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(ipvsCmdAttrService, func(nae *netlink.AttributeEncoder) error {
		nae.Uint16(ipvsSvcAttrAF, s.af)
		nae.Uint16(ipvsSvcAttrProtocol, s.proto)
		nae.Bytes(ipvsSvcAttrAddr, s.addr)
		nae.Bytes(ipvsSvcAttrPort, s.port)
		return nil
	})
	req, err := ae.Encode()
	if err != nil {
		return err
	}
	msgs, err := g.c.Execute(genetlink.Message{Header: genetlink.Header{Command: ipvsCmdGetDest, Version: g.fam.Version}, Data: req},
		g.fam.ID, netlink.Request|netlink.Dump)
	if err != nil {
		return err
	}
	s.vs.Real = make([]RealServer, 0, len(msgs))
	for _, m := range msgs {
		rs, ok, err := decodeIPVSDest(m.Data, s.af)
		if err != nil {
			return err
		}
		if ok {
			s.vs.Real = append(s.vs.Real, rs)
		}
	}
	return nil
}

// decodeIPVSService reads one IPVS_CMD_NEW_SERVICE message body. Host-order
// integers, except ports (network order).
func decodeIPVSService(data []byte) (ipvsService, error) {
	var s ipvsService
	a := nl.Walk(data)
	for a.Next() {
		if a.Type != ipvsCmdAttrService {
			continue
		}
		sa := nl.Walk(a.Val)
		var flags, timeout uint32
		for sa.Next() {
			switch sa.Type {
			case ipvsSvcAttrAF:
				s.af = nativeU16(sa.Val)
			case ipvsSvcAttrProtocol:
				s.proto = nativeU16(sa.Val)
			case ipvsSvcAttrAddr:
				s.addr = sa.Val
			case ipvsSvcAttrPort:
				s.port = sa.Val
			case ipvsSvcAttrFWMark:
				s.fwmark = nativeU32(sa.Val)
			case ipvsSvcAttrSched:
				s.vs.Scheduler = sa.Str()
			case ipvsSvcAttrFlags:
				flags = nativeU32(sa.Val)
			case ipvsSvcAttrTimeout:
				timeout = nativeU32(sa.Val)
			}
		}
		if sa.Err != nil {
			return s, sa.Err
		}
		if flags&ipvsSvcPersistent != 0 {
			s.vs.PersistentSeconds = int(timeout)
		}
		ip, ok := ipvsAddr(s.af, s.addr)
		proto, okp := ipvsProto(s.proto)
		if ok && okp && len(s.port) == 2 {
			s.vs.Addr = netip.AddrPortFrom(ip, binary.BigEndian.Uint16(s.port))
			s.vs.Protocol = proto
			s.ok = true
		}
	}
	return s, a.Err
}

// decodeIPVSDest reads one IPVS_CMD_NEW_DEST message body; a real server
// whose family the kernel does not say (before Linux 4.10) has its
// service's.
func decodeIPVSDest(data []byte, svcAF uint16) (RealServer, bool, error) {
	var rs RealServer
	var addr, port []byte
	var af uint16
	a := nl.Walk(data)
	for a.Next() {
		if a.Type != ipvsCmdAttrDest {
			continue
		}
		da := nl.Walk(a.Val)
		for da.Next() {
			switch da.Type {
			case ipvsDestAttrAddr:
				addr = da.Val
			case ipvsDestAttrPort:
				port = da.Val
			case ipvsDestAttrWeight:
				rs.Weight = int(nativeU32(da.Val))
			case ipvsDestAttrActiveConns:
				rs.ActiveConns = int(nativeU32(da.Val))
			case ipvsDestAttrInactiveConns:
				rs.InactiveConns = int(nativeU32(da.Val))
			case ipvsDestAttrAF:
				af = nativeU16(da.Val)
			}
		}
		if da.Err != nil {
			return rs, false, da.Err
		}
	}
	if a.Err != nil {
		return rs, false, a.Err
	}
	if af == 0 {
		af = svcAF
	}
	ip, ok := ipvsAddr(af, addr)
	if !ok || len(port) != 2 {
		return rs, false, nil
	}
	rs.Addr = netip.AddrPortFrom(ip, binary.BigEndian.Uint16(port))
	return rs, true, nil
}

// ipvsAddr reads an address: union nf_inet_addr, 16 bytes, the first 4
// for IPv4.
func ipvsAddr(af uint16, b []byte) (netip.Addr, bool) {
	switch {
	case af == syscall.AF_INET && len(b) >= 4:
		return netip.AddrFrom4([4]byte(b[:4])), true
	case af == syscall.AF_INET6 && len(b) >= 16:
		return netip.AddrFrom16([16]byte(b[:16])).Unmap(), true
	}
	return netip.Addr{}, false
}

func ipvsProto(p uint16) (string, bool) {
	switch p {
	case syscall.IPPROTO_TCP:
		return "TCP", true
	case syscall.IPPROTO_UDP:
		return "UDP", true
	case syscall.IPPROTO_SCTP:
		return "SCTP", true
	}
	return "", false
}

func nativeU16(b []byte) uint16 {
	if len(b) < 2 {
		return 0
	}
	return binary.NativeEndian.Uint16(b)
}

func nativeU32(b []byte) uint32 {
	if len(b) < 4 {
		return 0
	}
	return binary.NativeEndian.Uint32(b)
}
