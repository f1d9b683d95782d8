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
	t := &textTable{byAddr: map[string]int{}, cur: -1}
	for lineNo := 1; sc.Scan(); lineNo++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "IP Virtual Server") || strings.HasPrefix(line, "Prot ") || strings.HasPrefix(line, "-> RemoteAddress") {
			continue
		}
		var err error
		switch f := strings.Fields(line); {
		case f[0] == "-A" || f[0] == "-a":
			err = t.saveLine(f, line)
		case f[0] == "TCP" || f[0] == "UDP" || f[0] == "SCTP":
			err = t.listService(f)
		case f[0] == "FWM":
			t.cur = -1
		case f[0] == "->":
			err = t.listReal(f)
		default:
			err = fmt.Errorf("expected ipvsadm -Sn or -Ln output, got %q", clip(line))
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %v", lineNo, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read ipvsadm output: %w", err)
	}
	return Observed(t.vs), nil
}

// textTable is the table as Parse reads it: virtual servers in the order
// first seen, and the one real servers are added to (-1 after a
// firewall-mark service, whose real servers are skipped).
type textTable struct {
	vs     []VirtualServer
	byAddr map[string]int
	cur    int
}

func (t *textTable) addVS(proto, addr string) (*VirtualServer, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("bad virtual server address %q", addr)
	}
	key := proto + " " + ap.String()
	if i, ok := t.byAddr[key]; ok {
		t.cur = i
	} else {
		t.cur = len(t.vs)
		t.byAddr[key] = t.cur
		t.vs = append(t.vs, VirtualServer{Addr: ap, Protocol: proto})
	}
	return &t.vs[t.cur], nil
}

func (t *textTable) addRS(addr string, weight, active, inactive int) error {
	if t.cur < 0 {
		return fmt.Errorf("real server before any virtual server")
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return fmt.Errorf("bad real server address %q", addr)
	}
	t.vs[t.cur].Real = append(t.vs[t.cur].Real, RealServer{Addr: ap, Weight: weight, ActiveConns: active, InactiveConns: inactive})
	return nil
}

// saveLine reads a line of the save format: -A a virtual server, -a one
// of its real servers.
func (t *textTable) saveLine(f []string, line string) error {
	proto, addr, rs, sched := "", "", "", ""
	weight, persist := 1, 0
	var err error
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
	switch {
	case err != nil:
		return err
	case proto == "FWM":
		t.cur = -1
		return nil
	case proto == "":
		return fmt.Errorf("ipvsadm rule without -t, -u or --sctp-service: %q", clip(line))
	}
	v, err := t.addVS(proto, addr)
	if err != nil {
		return err
	}
	if f[0] == "-A" {
		v.Scheduler, v.PersistentSeconds = sched, persist
		return nil
	}
	return t.addRS(rs, weight, 0, 0)
}

// listService reads a virtual server line of the list format.
func (t *textTable) listService(f []string) error {
	if len(f) < 2 {
		return fmt.Errorf("virtual server without an address")
	}
	v, err := t.addVS(f[0], f[1])
	if err != nil {
		return err
	}
	if len(f) > 2 {
		v.Scheduler = f[2]
	}
	for i := 3; i+1 < len(f) && err == nil; i++ {
		if f[i] == "persistent" {
			v.PersistentSeconds, err = atoi(f[i+1], "persistence timeout")
		}
	}
	return err
}

// listReal reads a real server line of the list format (address,
// forward, weight, and the connection counts when given).
func (t *textTable) listReal(f []string) error {
	if len(f) < 4 {
		return fmt.Errorf("real server line needs address, forward and weight")
	}
	if t.cur < 0 && len(t.vs) > 0 {
		return nil // real servers of a firewall-mark service
	}
	w, err := atoi(f[3], "weight")
	if err != nil {
		return err
	}
	var act, inact int
	if len(f) >= 6 {
		if act, err = atoi(f[4], "active connection count"); err == nil {
			inact, err = atoi(f[5], "inactive connection count")
		}
		if err != nil {
			return err
		}
	}
	return t.addRS(f[1], w, act, inact)
}

func atoi(s, what string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil {
		return 0, fmt.Errorf("bad %s %q", what, s)
	}
	return n, nil
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
