package collector

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"
	"syscall"

	"github.com/moby/ipvs"
	"github.com/sirupsen/logrus"

	"github.com/proxyaudit/proxyaudit/audit"
)

// ipvsReader holds the one netlink handle the collector reads IPVS with.
// A moby/ipvs Handle is not safe for concurrent use: reads are serialised
// here, and a handle that failed is closed and reopened on the next read.
var ipvsReader struct {
	mu sync.Mutex
	h  *ipvs.Handle
}

// readIPVS dumps the kernel's IPVS table over generic netlink: one
// GetServices dump, then one destinations dump per virtual server. It is
// the table `ipvsadm -Sn` prints, read without forking a tool.
func readIPVS() (*audit.Observed, error) {
	ipvsReader.mu.Lock()
	defer ipvsReader.mu.Unlock()
	if ipvsReader.h == nil {
		// Without the module the netlink family is missing and moby/ipvs
		// would still return a handle (and log through logrus).
		if _, err := os.Stat("/proc/net/ip_vs"); err != nil {
			return nil, fmt.Errorf("open IPVS netlink: this kernel has no IPVS table (%v): is the ip_vs module loaded? kube-proxy in IPVS mode loads it", err)
		}
		// moby/ipvs logs through logrus when it runs modprobe ip_vs (a
		// collector image needs no kmod: the table is there or not, and
		// the Stat above says so); its errors come back as values.
		logrus.SetOutput(io.Discard)
		h, err := ipvs.New("")
		if err != nil {
			return nil, fmt.Errorf("open IPVS netlink: %w (is the ip_vs module loaded?)", err)
		}
		ipvsReader.h = h
	}
	obs, err := dumpIPVS(ipvsReader.h)
	if err != nil {
		ipvsReader.h.Close()
		ipvsReader.h = nil
		return nil, err
	}
	return obs, nil
}

func dumpIPVS(h *ipvs.Handle) (*audit.Observed, error) {
	svcs, err := h.GetServices()
	if err != nil {
		return nil, fmt.Errorf("IPVS services: %w", err)
	}
	vs := make([]audit.VirtualServer, 0, len(svcs))
	for _, s := range svcs {
		if s.FWMark != 0 {
			continue // kube-proxy programs no firewall-mark services
		}
		v, ok := virtualServer(s)
		if !ok {
			continue
		}
		dsts, err := h.GetDestinations(s)
		if err != nil {
			return nil, fmt.Errorf("IPVS real servers of %s: %w", v.Addr, err)
		}
		for _, d := range dsts {
			a, ok := netip.AddrFromSlice(d.Address)
			if !ok {
				continue
			}
			v.Real = append(v.Real, audit.RealServer{Addr: netip.AddrPortFrom(a.Unmap(), d.Port), Weight: d.Weight,
				ActiveConns: d.ActiveConnections, InactiveConns: d.InactiveConnections})
		}
		vs = append(vs, v)
	}
	return audit.FromIPVS(vs), nil
}

func virtualServer(s *ipvs.Service) (audit.VirtualServer, bool) {
	a, ok := netip.AddrFromSlice(s.Address)
	if !ok {
		return audit.VirtualServer{}, false
	}
	var proto string
	switch s.Protocol {
	case syscall.IPPROTO_TCP:
		proto = "TCP"
	case syscall.IPPROTO_UDP:
		proto = "UDP"
	case syscall.IPPROTO_SCTP:
		proto = "SCTP"
	default:
		return audit.VirtualServer{}, false
	}
	v := audit.VirtualServer{Addr: netip.AddrPortFrom(a.Unmap(), s.Port), Protocol: proto, Scheduler: s.SchedName}
	const persistent = 0x1 // IP_VS_SVC_F_PERSISTENT: session affinity
	if s.Flags&persistent != 0 {
		v.PersistentSeconds = int(s.Timeout)
	}
	return v, true
}
