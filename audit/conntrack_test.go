package audit

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

func TestJudgeConntrack(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	grace := 30 * time.Second
	ip := netip.MustParseAddr
	dns := func(eps ...SliceEndpoint) *State {
		return &State{Services: []Service{{Namespace: "kube-system", Name: "kube-dns", ClusterIPs: []netip.Addr{ip("198.19.0.10")},
			Ports: []corev1.ServicePort{{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53}, {Name: "dns-tcp", Protocol: corev1.ProtocolTCP, Port: 53}},
			Slices: []Slice{{Family: 4, Ports: []SlicePort{{Name: "dns", Protocol: "UDP", Port: 5353}, {Name: "dns-tcp", Protocol: "TCP", Port: 5353}},
				Endpoints: eps}}}}}
	}
	live := func(a string) SliceEndpoint { return SliceEndpoint{Addr: ip(a), Ready: true, Serving: true} }
	terminating := func(a string) SliceEndpoint { return SliceEndpoint{Addr: ip(a), Terminating: true} }
	h := NewHistory(10 * time.Minute)
	h.Update(dns(live("198.18.77.2"), live("198.18.77.3")), t0)
	// .3 starts terminating (not serving) at t0+1m, and is gone at t0+2m.
	h.Update(dns(live("198.18.77.2"), terminating("198.18.77.3")), t0.Add(time.Minute))
	h.Update(dns(live("198.18.77.2")), t0.Add(2*time.Minute))
	fe := func(proto string) FrontendKey { return FrontendKey{IP: ip("198.19.0.10"), Protocol: proto, Port: 53} }
	udp := func(dest string, n int) ConntrackFlows {
		return ConntrackFlows{Frontend: fe("UDP"), Dest: netip.MustParseAddrPort(dest), UDP: n, Unreplied: n,
			Samples: []netip.AddrPort{netip.MustParseAddrPort("198.18.5.5:40000")}}
	}
	tcp := func(dest, state string) ConntrackFlows {
		return ConntrackFlows{Frontend: fe("TCP"), Dest: netip.MustParseAddrPort(dest), TCP: map[string]int{state: 1}}
	}
	ct := &Conntrack{Flows: []ConntrackFlows{
		udp("198.18.77.2:5353", 4), // live
		udp("198.18.77.3:5353", 2), // not serving since t0+1m
		tcp("198.18.77.3:5353", "ESTABLISHED"),
		tcp("198.18.77.3:5353", "SYN_SENT"),
		udp("198.18.77.9:5353", 1), // never an endpoint in the kept history
		{Frontend: FrontendKey{IP: ip("198.19.9.9"), Protocol: "UDP", Port: 53}, Dest: netip.MustParseAddrPort("198.18.77.3:5353"), UDP: 1}, // no service's
	}}
	judge := func(at time.Duration) []TimedFinding {
		return JudgeConntrack("n1", ct, h, ModeIPTables, t0.Add(at), grace)
	}
	// Within grace of .3 no longer serving (t0+1m): nothing about it; the
	// address no kept version had counts from the oldest kept (t0).
	fs := judge(time.Minute + 10*time.Second)
	if len(fs) != 1 || fs[0].Endpoint != "198.18.77.9:5353" || !fs[0].Since.Equal(t0) {
		t.Fatalf("within grace: %+v", fs)
	}
	// Past grace: the UDP flows to .3 (not serving since t0+1m) are stale;
	// the TCP connect attempt too once .3 is gone (t0+2m), not before;
	// the idle ESTABLISHED entry never.
	fs = judge(time.Minute + 40*time.Second)
	got := map[string]TimedFinding{}
	for _, f := range fs {
		got[f.Protocol+" "+f.Endpoint] = f
		if f.Kind != StaleConntrack || f.Node != "n1" || f.Service != "kube-system/kube-dns" || f.Family != 4 {
			t.Errorf("finding: %+v", f)
		}
	}
	if len(fs) != 2 || got["UDP 198.18.77.3:5353"].Port != "dns" || !got["UDP 198.18.77.3:5353"].Since.Equal(t0.Add(time.Minute)) {
		t.Fatalf("past grace: %+v", fs)
	}
	if d := got["UDP 198.18.77.3:5353"].Detail; !strings.Contains(d, "2 UDP flow(s) through 198.19.0.10:53/UDP still DNATed to 198.18.77.3:5353, which left the service 40s ago; 2 never answered") ||
		!strings.Contains(d, "clients 198.18.5.5:40000") {
		t.Errorf("detail: %s", d)
	}
	fs = judge(3 * time.Minute)
	got = map[string]TimedFinding{}
	for _, f := range fs {
		got[f.Protocol+" "+f.Endpoint] = f
	}
	if len(fs) != 3 || got["TCP 198.18.77.3:5353"].Port != "dns-tcp" || !got["TCP 198.18.77.3:5353"].Since.Equal(t0.Add(2*time.Minute)) {
		t.Fatalf("after the pod is gone: %+v", fs)
	}
	// The service deleted: every flow of it is stale from the deletion.
	h.Update(&State{}, t0.Add(4*time.Minute))
	fs = JudgeConntrack("n1", &Conntrack{Flows: []ConntrackFlows{udp("198.18.77.2:5353", 1)}}, h, ModeIPTables, t0.Add(5*time.Minute), grace)
	if len(fs) != 1 || !fs[0].Since.Equal(t0.Add(4*time.Minute)) || fs[0].Port != "dns" {
		t.Fatalf("service deleted: %+v", fs)
	}
	if JudgeConntrack("n1", nil, h, ModeIPTables, t0, grace) != nil {
		t.Error("no read, findings")
	}
}

// A lone endpoint that is not ready (a readiness flap of the only CoreDNS
// pod) is still the service's: its flows are not stale, as kube-proxy
// leaves them; once another endpoint serves, or it is gone, they are.
func TestJudgeConntrackLoneEndpointNotReady(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	ip := netip.MustParseAddr
	dns := func(eps ...SliceEndpoint) *State {
		return &State{Services: []Service{{Namespace: "kube-system", Name: "kube-dns", ClusterIPs: []netip.Addr{ip("198.19.0.10")},
			Ports:  []corev1.ServicePort{{Name: "dns", Protocol: corev1.ProtocolUDP, Port: 53}},
			Slices: []Slice{{Family: 4, Ports: []SlicePort{{Name: "dns", Protocol: "UDP", Port: 53}}, Endpoints: eps}}}}}
	}
	ct := &Conntrack{Flows: []ConntrackFlows{{Frontend: FrontendKey{IP: ip("198.19.0.10"), Protocol: "UDP", Port: 53},
		Dest: netip.MustParseAddrPort("198.18.129.2:53"), UDP: 12}}}
	h := NewHistory(10 * time.Minute)
	h.Update(dns(SliceEndpoint{Addr: ip("198.18.129.2"), Ready: true, Serving: true}), t0)
	h.Update(dns(SliceEndpoint{Addr: ip("198.18.129.2")}), t0.Add(time.Minute)) // not ready
	if fs := JudgeConntrack("n", ct, h, ModeIPTables, t0.Add(5*time.Minute), 10*time.Second); len(fs) != 0 {
		t.Fatalf("a lone pod not ready: %+v", fs)
	}
	h.Update(dns(SliceEndpoint{Addr: ip("198.18.129.2")}, SliceEndpoint{Addr: ip("198.18.129.3"), Ready: true, Serving: true}), t0.Add(6*time.Minute))
	if fs := JudgeConntrack("n", ct, h, ModeIPTables, t0.Add(7*time.Minute), 10*time.Second); len(fs) != 1 || !fs[0].Since.Equal(t0.Add(6*time.Minute)) {
		t.Fatalf("another endpoint serves, the not-ready one's flows are kube-proxy's to clear: %+v", fs)
	}
}

// Flows whose last packet the collector dated: only those still carrying
// packets later than grace after the destination left are stale. A SYN
// that reached a pod in its last moment (the kernel dates an attempt by
// its first SYN), a lookup answered just before, a UDP client that
// stopped: they only count down to their timeout (the rollouts of issue
// #58, 82 % of reports on healthy nodes). A client still sending, and a
// connection attempt begun past grace (rules that still sent there), are
// blackholes.
func TestJudgeConntrackByLastPacket(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	ip := netip.MustParseAddr
	svc := func(eps ...string) *State {
		var es []SliceEndpoint
		for _, a := range eps {
			es = append(es, SliceEndpoint{Addr: ip(a), Ready: true, Serving: true})
		}
		return &State{Services: []Service{{Namespace: "web", Name: "api", ClusterIPs: []netip.Addr{ip("198.19.0.20")},
			Ports:  []corev1.ServicePort{{Name: "u", Protocol: corev1.ProtocolUDP, Port: 53}, {Name: "t", Protocol: corev1.ProtocolTCP, Port: 80}},
			Slices: []Slice{{Family: 4, Ports: []SlicePort{{Name: "u", Protocol: "UDP", Port: 5353}, {Name: "t", Protocol: "TCP", Port: 8080}}, Endpoints: es}}}}}
	}
	h := NewHistory(10 * time.Minute)
	h.Update(svc("198.18.77.2", "198.18.77.3"), t0)
	left := t0.Add(time.Minute) // .3 leaves
	h.Update(svc("198.18.77.2"), left)
	fe := func(proto string, port uint16) FrontendKey {
		return FrontendKey{IP: ip("198.19.0.20"), Protocol: proto, Port: port}
	}
	for _, grace := range []time.Duration{10 * time.Second, 30 * time.Second} {
		for _, c := range []struct {
			name   string
			flows  ConntrackFlows
			active time.Duration // after left; <0: unknown
			stale  bool
		}{
			{"UDP client still sending", ConntrackFlows{Frontend: fe("UDP", 53), UDP: 1, Unreplied: 1}, grace + 5*time.Second, true},
			{"UDP client that stopped", ConntrackFlows{Frontend: fe("UDP", 53), UDP: 1, Unreplied: 1}, 2 * time.Second, false},
			{"lookup answered before it left", ConntrackFlows{Frontend: fe("UDP", 53), UDP: 3}, -time.Second, false},
			{"attempt begun past grace", ConntrackFlows{Frontend: fe("TCP", 80), TCP: map[string]int{"SYN_SENT": 1}, Unreplied: 1}, grace + time.Second, true},
			{"SYN abandoned by its client", ConntrackFlows{Frontend: fe("TCP", 80), TCP: map[string]int{"SYN_SENT": 1, "TIME_WAIT": 1}, Unreplied: 1}, 3 * time.Second, false},
			{"undated (an older collector)", ConntrackFlows{Frontend: fe("UDP", 53), UDP: 1}, -1, true},
			// Packets went through past grace (a fault), then stopped (the
			// fault healed): the collector's next read calls it quiet.
			{"sent past grace, quiet since", ConntrackFlows{Frontend: fe("UDP", 53), UDP: 1, Unreplied: 1, Quiet: true}, grace + 5*time.Second, false},
			{"attempts past grace, quiet since", ConntrackFlows{Frontend: fe("TCP", 80), TCP: map[string]int{"SYN_SENT": 3, "TIME_WAIT": 12}, Unreplied: 3, Quiet: true}, grace + 8*time.Second, false},
		} {
			f := c.flows
			f.Dest = netip.MustParseAddrPort("198.18.77.3:5353")
			if f.Frontend.Protocol == "TCP" {
				f.Dest = netip.MustParseAddrPort("198.18.77.3:8080")
			}
			if c.active != -1 {
				f.Active = left.Add(c.active)
			}
			now := left.Add(grace + 40*time.Second)
			fs := JudgeConntrack("n1", &Conntrack{Flows: []ConntrackFlows{f}}, h, ModeIPTables, now, grace)
			if got := len(fs) == 1; got != c.stale {
				t.Errorf("grace %s, %s: stale %v, want %v (%+v)", grace, c.name, got, c.stale, fs)
			}
			if c.stale && c.active > 0 && !strings.Contains(fs[0].Detail, "still carrying packets") {
				t.Errorf("grace %s, %s: the detail does not say so: %s", grace, c.name, fs[0].Detail)
			}
		}
	}
}
