package ipvs

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"syscall"

	mobyipvs "github.com/moby/ipvs"
)

// mobyIPVS reads the IPVS table over generic netlink with moby/ipvs: one
// services dump, then one destinations dump per virtual server. It decodes
// every attribute into fresh objects (4.4 times the allocations of the text
// path at the anchors, docs/benchmarks.md); the collector reads with
// genlIPVS instead, and the benchmark keeps this one beside it. moby/ipvs
// logs through logrus when it runs modprobe (the collector's main routes
// logrus into its own logger).
type mobyIPVS struct{ h *mobyipvs.Handle }

func OpenMoby() (Table, error) {
	// Without the module the netlink family is missing and moby/ipvs
	// would still return a handle. A collector image needs no kmod: the
	// table is there or not, and this says so.
	if _, err := os.Stat("/proc/net/ip_vs"); err != nil {
		return nil, fmt.Errorf("open IPVS netlink: this kernel has no IPVS table (%v): is the ip_vs module loaded? kube-proxy in IPVS mode loads it", err)
	}
	h, err := mobyipvs.New("")
	if err != nil {
		return nil, fmt.Errorf("open IPVS netlink: %w (is the ip_vs module loaded?)", err)
	}
	return mobyIPVS{h}, nil
}

func (m mobyIPVS) Close() { m.h.Close() }

func (m mobyIPVS) VirtualServers(ctx context.Context) ([]VirtualServer, error) {
	svcs, err := m.h.GetServices()
	if err != nil {
		return nil, fmt.Errorf("IPVS services: %w", err)
	}
	vs := make([]VirtualServer, 0, len(svcs))
	for _, s := range svcs {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if s.FWMark != 0 {
			continue // kube-proxy programs no firewall-mark services
		}
		v, ok := virtualServer(s)
		if !ok {
			continue
		}
		dsts, err := m.h.GetDestinations(s)
		if err != nil {
			return nil, fmt.Errorf("IPVS real servers of %s: %w", v.Addr, err)
		}
		for _, d := range dsts {
			a, ok := netip.AddrFromSlice(d.Address)
			if !ok {
				continue
			}
			v.Real = append(v.Real, RealServer{Addr: netip.AddrPortFrom(a.Unmap(), d.Port), Weight: d.Weight,
				ActiveConns: d.ActiveConnections, InactiveConns: d.InactiveConnections})
		}
		vs = append(vs, v)
	}
	return vs, nil
}

func virtualServer(s *mobyipvs.Service) (VirtualServer, bool) {
	a, ok := netip.AddrFromSlice(s.Address)
	if !ok {
		return VirtualServer{}, false
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
		return VirtualServer{}, false
	}
	v := VirtualServer{Addr: netip.AddrPortFrom(a.Unmap(), s.Port), Protocol: proto, Scheduler: s.SchedName}
	const persistent = 0x1 // IP_VS_SVC_F_PERSISTENT: session affinity
	if s.Flags&persistent != 0 {
		v.PersistentSeconds = int(s.Timeout)
	}
	return v, true
}
