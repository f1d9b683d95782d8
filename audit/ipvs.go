package audit

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"strconv"
	"strings"
)

// ParseIPVS reads `ipvsadm -Sn` (save) or `ipvsadm -Ln` (list) output.
// Virtual servers become frontends keyed by (VIP, protocol, port) with their
// real servers and weights; IPVS names nothing, so the diff maps virtual
// servers to services through the Service objects. Firewall-mark services
// are ignored.
func ParseIPVS(r io.Reader) (*Observed, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), MaxLineBytes)
	obs := &Observed{Mode: ModeIPVS}
	byKey := map[FrontendKey]int{}
	cur := -1
	fams := map[int]bool{}
	lineNo := 0
	addVS := func(proto, addr string) error {
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			return fmt.Errorf("bad virtual server address %q", addr)
		}
		k := FrontendKey{IP: ap.Addr().Unmap(), Protocol: proto, Port: ap.Port()}
		fams[family(k.IP)] = true
		if i, ok := byKey[k]; ok {
			cur = i
			return nil
		}
		byKey[k] = len(obs.Frontends)
		cur = len(obs.Frontends)
		obs.Frontends = append(obs.Frontends, ObservedFrontend{FrontendKey: k, Chain: "IPVS " + k.String()})
		return nil
	}
	addRS := func(addr string, weight int) error {
		if cur < 0 {
			return fmt.Errorf("real server before any virtual server")
		}
		ap, err := netip.ParseAddrPort(addr)
		if err != nil {
			return fmt.Errorf("bad real server address %q", addr)
		}
		f := &obs.Frontends[cur]
		f.Endpoints = append(f.Endpoints, Endpoint{Addr: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), Weight: weight, Chain: f.Chain})
		return nil
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
			proto, addr, rs, weight := "", "", "", 1
			for i := 1; i+1 < len(f); i++ {
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
					if weight, err = strconv.Atoi(f[i+1]); err != nil {
						return nil, fmt.Errorf("line %d: bad weight %q", lineNo, f[i+1])
					}
				}
			}
			if proto == "FWM" {
				cur = -1
				continue
			}
			if proto == "" {
				return nil, fmt.Errorf("line %d: ipvsadm rule without -t, -u or --sctp-service: %q", lineNo, clip([]byte(line)))
			}
			if f[0] == "-A" {
				err = addVS(proto, addr)
			} else {
				if err = addVS(proto, addr); err == nil {
					err = addRS(rs, weight)
				}
			}
		case f[0] == "TCP" || f[0] == "UDP" || f[0] == "SCTP": // list format
			if len(f) < 2 {
				return nil, fmt.Errorf("line %d: virtual server without an address", lineNo)
			}
			err = addVS(f[0], f[1])
		case f[0] == "FWM":
			cur = -1
			continue
		case f[0] == "->":
			if len(f) < 4 {
				return nil, fmt.Errorf("line %d: real server line needs address, forward and weight", lineNo)
			}
			if cur < 0 && len(obs.Frontends) > 0 {
				continue // real servers of a firewall-mark service
			}
			w, werr := strconv.Atoi(f[3])
			if werr != nil {
				return nil, fmt.Errorf("line %d: bad weight %q", lineNo, f[3])
			}
			err = addRS(f[1], w)
		default:
			return nil, fmt.Errorf("line %d: expected ipvsadm -Sn or -Ln output, got %q", lineNo, clip([]byte(line)))
		}
		if err != nil {
			return nil, fmt.Errorf("line %d: %v", lineNo, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read ipvsadm output: %w", err)
	}
	for f := range fams {
		obs.Families = append(obs.Families, f)
	}
	if len(obs.Families) == 0 {
		obs.Families = []int{4}
	}
	obs.NoRules = len(obs.Frontends) == 0
	obs.normalize()
	return obs, nil
}
