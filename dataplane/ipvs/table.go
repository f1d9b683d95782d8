// Package ipvs is kube-proxy's IPVS mode: the kernel's IPVS table read over
// generic netlink (Open, Linux only) or from `ipvsadm -Sn`/`-Ln` text
// (Parse), and reduced to the audit's model (Observed).
package ipvs

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"

	"github.com/proxyaudit/proxyaudit/audit"
)

// VirtualServer is one IPVS virtual server as the kernel holds it, from
// `ipvsadm -Sn`/`-Ln` text or a netlink dump (the collector's source):
// both readers build these, and Observed turns them into the model.
type VirtualServer struct {
	Addr     netip.AddrPort
	Protocol string // TCP, UDP or SCTP
	// Scheduler is the IPVS scheduler (rr, wrr, sh, …).
	Scheduler string
	// PersistentSeconds is the persistence timeout (session affinity);
	// 0 when the service is not persistent.
	PersistentSeconds int
	Real              []RealServer
}

// RealServer is one IPVS destination of a virtual server.
type RealServer struct {
	Addr netip.AddrPort
	// Weight 0 means no new connections: kube-proxy's graceful
	// termination of an endpoint that left the service.
	Weight                     int
	ActiveConns, InactiveConns int
}

// Observed builds the observed model of an IPVS table: each virtual server
// becomes a frontend keyed by (VIP, protocol, port) with its real servers
// and weights. IPVS names nothing, so the diff maps virtual servers to
// services through the audit.Service objects (cluster, external and
// load-balancer IPs; node ports per node address). No virtual server at
// all is audit.NoRules (a flushed table). One table holds both families, so the
// model covers both.
func Observed(vs []VirtualServer) *audit.Observed {
	obs := &audit.Observed{Mode: audit.ModeIPVS, Families: []int{4, 6}}
	byKey := map[audit.FrontendKey]int{}
	for _, v := range vs {
		k := audit.FrontendKey{IP: v.Addr.Addr().Unmap(), Protocol: v.Protocol, Port: v.Addr.Port()}
		i, ok := byKey[k]
		if !ok {
			i = len(obs.Frontends)
			byKey[k] = i
			chain := "IPVS " + k.String()
			if v.Scheduler != "" {
				chain += " " + v.Scheduler
			}
			if v.PersistentSeconds > 0 {
				chain += fmt.Sprintf(" persistent %ds", v.PersistentSeconds)
			}
			obs.Frontends = append(obs.Frontends, audit.ObservedFrontend{FrontendKey: k, Chain: chain})
		}
		f := &obs.Frontends[i]
		for _, r := range v.Real {
			f.Endpoints = append(f.Endpoints, audit.Endpoint{Addr: netip.AddrPortFrom(r.Addr.Addr().Unmap(), r.Addr.Port()), Weight: r.Weight,
				ActiveConns: r.ActiveConns, InactiveConns: r.InactiveConns, Chain: f.Chain})
		}
	}
	obs.NoRules = len(obs.Frontends) == 0
	obs.Normalize()
	return obs
}

// Parse reads `ipvsadm -Sn` (save) or `ipvsadm -Ln` (list) output.
// Firewall-mark services are ignored (kube-proxy programs none).
func Parse(r io.Reader) (*audit.Observed, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), audit.MaxLineBytes)
	var vs []VirtualServer
	byAddr := map[string]int{}
	cur := -1
	lineNo := 0
	addVS := func(proto, addr string) (*VirtualServer, error) {
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			return nil, fmt.Errorf("bad virtual server address %q", addr)
		}
		key := proto + " " + ap.String()
		if i, ok := byAddr[key]; ok {
			cur = i
		} else {
			cur = len(vs)
			byAddr[key] = cur
			vs = append(vs, VirtualServer{Addr: ap, Protocol: proto})
		}
		return &vs[cur], nil
	}
	addRS := func(addr string, weight, active, inactive int) error {
		if cur < 0 {
			return fmt.Errorf("real server before any virtual server")
		}
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			return fmt.Errorf("bad real server address %q", addr)
		}
		vs[cur].Real = append(vs[cur].Real, RealServer{Addr: ap, Weight: weight, ActiveConns: active, InactiveConns: inactive})
		return nil
	}
	atoi := func(s, what string) (int, error) {
		n, err := strconv.Atoi(s)
		if err != nil {
			return 0, fmt.Errorf("bad %s %q", what, s)
		}
		return n, nil
	}
	for sc.Scan() {
		lineNo++
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "IP Virtual Server") || strings.HasPrefix(line, "Prot ") || strings.HasPrefix(line, "-> RemoteAddress") {
			continue
		}
		f := strings.Fields(line)
		var err error
		switch {
		case f[0] == "-A" || f[0] == "-a": // save format
			proto, addr, rs, sched := "", "", "", ""
			weight, persist := 1, 0
			for i := 1; i+1 < len(f) && err == nil; i++ {
				switch f[i] {
				case "-t", "--tcp-service":
					proto, addr = "TCP", f[i+1]
				case "-u", "--udp-service":
					proto, addr = "UDP", f[i+1]
				case "--sctp-service":
					proto, addr = "SCTP", f[i+1]
				case "-f", "--fwmark-service":
					proto = "FWM"
				case "-r", "--real-server":
					rs = f[i+1]
				case "-w", "--weight":
					weight, err = atoi(f[i+1], "weight")
				case "-s", "--scheduler":
					sched = f[i+1]
				case "-p", "--persistent":
					persist, err = atoi(f[i+1], "persistence timeout")
				}
			}
			if err != nil {
				break
			}
			if proto == "FWM" {
				cur = -1
				continue
			}
			if proto == "" {
				return nil, fmt.Errorf("line %d: ipvsadm rule without -t, -u or --sctp-service: %q", lineNo, clip(line))
			}
			var v *VirtualServer
			if v, err = addVS(proto, addr); err != nil {
				break
			}
			if f[0] == "-A" {
				v.Scheduler, v.PersistentSeconds = sched, persist
			} else {
				err = addRS(rs, weight, 0, 0)
			}
		case f[0] == "TCP" || f[0] == "UDP" || f[0] == "SCTP": // list format
			if len(f) < 2 {
				return nil, fmt.Errorf("line %d: virtual server without an address", lineNo)
			}
			var v *VirtualServer
			if v, err = addVS(f[0], f[1]); err != nil {
				break
			}
			if len(f) > 2 {
				v.Scheduler = f[2]
			}
			for i := 3; i+1 < len(f); i++ {
				if f[i] == "persistent" {
					v.PersistentSeconds, err = atoi(f[i+1], "persistence timeout")
				}
			}
		case f[0] == "FWM":
			cur = -1
			continue
		case f[0] == "->":
			if len(f) < 4 {
				return nil, fmt.Errorf("line %d: real server line needs address, forward and weight", lineNo)
			}
			if cur < 0 && len(vs) > 0 {
				continue // real servers of a firewall-mark service
			}
			var w, act, inact int
			if w, err = atoi(f[3], "weight"); err != nil {
				break
			}
			if len(f) >= 6 {
				if act, err = atoi(f[4], "active connection count"); err == nil {
					inact, err = atoi(f[5], "inactive connection count")
				}
				if err != nil {
					break
				}
			}
			err = addRS(f[1], w, act, inact)
		default:
			return nil, fmt.Errorf("line %d: expected ipvsadm -Sn or -Ln output, got %q", lineNo, clip(line))
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %v", lineNo, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read ipvsadm output: %w", err)
	}
	return Observed(vs), nil
}

// Table is the kernel's IPVS table, open for reading. It is not safe for
// concurrent use.
type Table interface {
	// VirtualServers reads the table; a context that ends stops the read
	// between two virtual servers.
	VirtualServers(ctx context.Context) ([]VirtualServer, error)
	Close()
}

// clip shortens a line quoted in an error.
func clip(s string) string {
	if len(s) > 80 {
		return s[:80] + "…"
	}
	return s
}
