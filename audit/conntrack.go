package audit

import (
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// Conntrack is what a node's connection-tracking table holds for its
// service frontends: the flows the kernel DNATed, counted per frontend
// (the flow's original destination) and DNAT destination (where its
// packets really go). Rules are half of the dataplane: a flow keeps its
// DNAT decision for as long as it lives, so a UDP client that keeps
// sending stays pinned to a pod IP after the rule and the pod are gone.
type Conntrack struct {
	// Families lists the IP families the read covered (4, 6).
	Families []int
	// Flows are sorted by frontend, then destination.
	Flows []ConntrackFlows
	// Entries is how many DNATed entries the table held; Dropped how many
	// of them fell beyond the reader's bound on distinct (frontend,
	// destination) pairs and are counted nowhere else.
	Entries, Dropped int
	// Timestamps: the kernel stamps each entry's start
	// (net.netfilter.nf_conntrack_timestamp=1), so Oldest is exact; else
	// Oldest is when the collector first saw the pair.
	Timestamps bool
}

// ConntrackFlows counts the flows of one frontend DNATed to one
// destination.
type ConntrackFlows struct {
	Frontend FrontendKey
	Dest     netip.AddrPort
	// UDP, SCTP: flows of those protocols. TCP: by conntrack state
	// (ESTABLISHED, TIME_WAIT, ...).
	UDP, SCTP int
	TCP       map[string]int `json:",omitempty"`
	// Unreplied flows never saw a reply ([UNREPLIED] in conntrack -L): a
	// client sending into a destination that does not answer.
	Unreplied int
	// Oldest is the start of the oldest flow (see Conntrack.Timestamps).
	Oldest time.Time `json:",omitzero"`
	// Active is when the last packet of a judged flow (UDP, a TCP
	// connection attempt) went through, dated by the collector from the
	// entries' remaining timeouts; zero when unknown (an older collector,
	// a dump without timeouts, or a destination the node's own rules
	// still send the frontend to, whose new flows keep coming).
	Active time.Time `json:",omitzero"`
	// Quiet: no packet of a judged flow went through since the reader's
	// previous read (Active is older): the flows only count down to
	// their timeouts. Packets sent through a gone destination during a
	// fault stop when it is healed; their entries live on for minutes.
	Quiet bool `json:",omitempty"`
	// Samples are a few clients (original sources), for people.
	Samples []netip.AddrPort `json:",omitempty"`
}

// ConntrackJudged: the flows JudgeConntrack judges, UDP and TCP
// connection attempts never answered (see there).
func ConntrackJudged(proto, tcpState string) bool {
	return proto == "UDP" || proto == "TCP" && (tcpState == "SYN_SENT" || tcpState == "SYN_SENT2")
}

// Total is every flow counted.
func (f ConntrackFlows) Total() int {
	n := f.UDP + f.SCTP
	for _, c := range f.TCP {
		n += c
	}
	return n
}

// SortConntrack orders flows by frontend, then destination.
func SortConntrack(fs []ConntrackFlows) {
	sort.Slice(fs, func(i, j int) bool {
		if fs[i].Frontend != fs[j].Frontend {
			return fs[i].Frontend.less(fs[j].Frontend)
		}
		return fs[i].Dest.Compare(fs[j].Dest) < 0
	})
}

// StaleConntrack: flows on the node still DNATed to an address that is no
// longer an endpoint of the frontend's service, past grace from when it
// left. The node's rules may be perfect: it is the kernel's memory of old
// decisions (kube-proxy clears such UDP entries itself, when it runs).
const StaleConntrack Kind = "StaleConntrack"

// JudgeConntrack finds a node's stale flows. A destination is live for a
// UDP flow while it is a serving endpoint of the service port (ready, or
// serving while terminating: kube-proxy's cleanup rule); for TCP while the
// service lists it at all, terminating included, so that connections
// draining during graceful termination are normal until the pod is gone.
// A destination no longer live is stale once grace has passed since the
// first version of the service without it (history keeps versions for
// its Keep: one gone before that counts from the oldest version kept).
// A frontend no kept version owns — the service deleted long ago — is
// stale from the oldest time the history can vouch for.
//
// Where the collector dated the flows' last packets (Active), only flows
// that carried a packet later than grace after the destination left, and
// still do (not Quiet), are stale: one that only counts down to its
// timeout is not a blackhole.
func JudgeConntrack(node string, ct *Conntrack, h *History, mode Mode, now time.Time, grace time.Duration) []TimedFinding {
	if ct == nil {
		return nil
	}
	var out []TimedFinding
	for _, f := range ct.Flows {
		owner, ok := h.Owner(f.Frontend, mode)
		if !ok {
			continue // no service ever had it here: not kube-proxy's to judge
		}
		// Judged: UDP flows (an entry lives only while its client sends:
		// 30-120 s idle; the entries kube-proxy's own cleanup deletes, by
		// the same rule, except that it leaves those of a service with no
		// serving endpoint) and TCP clients still trying to connect
		// (SYN_SENT). An idle ESTABLISHED TCP or SCTP association to a
		// gone pod lingers for conntrack's days-long timeout, harms
		// nobody, and would be a false alarm.
		judged := f.UDP + f.TCP["SYN_SENT"] + f.TCP["SYN_SENT2"]
		if judged == 0 {
			continue
		}
		vs := h.Versions(owner)
		left, portName, live := leftAt(vs, &f)
		if live || now.Sub(left) < grace {
			continue
		}
		// A flow is a blackhole only while packets keep going through
		// it. One whose last packet came within grace of the
		// destination's leaving (a request that reached a pod in its
		// last moment, a client that gave up, a lookup answered) only
		// counts down to its timeout: nothing is sent into it any more.
		if !f.Active.IsZero() && f.Active.Before(left.Add(grace)) || f.Quiet {
			continue
		}
		out = append(out, TimedFinding{Finding: Finding{Node: node, Service: owner, Port: portName, Protocol: f.Frontend.Protocol,
			Family: f.Frontend.Family(), Scope: ScopeCluster, Kind: StaleConntrack, Endpoint: f.Dest.String(), Detail: conntrackDetail(&f, left, now, ct.Timestamps), Flows: judged, Frontend: f.Frontend.Wire()}, Since: left})
	}
	return out
}

// leftAt says when dest stopped being live for the frontend's port: the
// Since of the first version after the newest one where it was (the
// oldest kept version's when none was); live when the current version has
// it.
func leftAt(vs []Version, f *ConntrackFlows) (left time.Time, portName string, live bool) {
	if len(vs) == 0 {
		return time.Time{}, "", false
	}
	left = vs[0].Since
	for i := len(vs) - 1; i >= 0; i-- {
		name, ok := liveIn(vs[i].Svc, f)
		if portName == "" {
			portName = name
		}
		if ok {
			if i == len(vs)-1 {
				return time.Time{}, portName, true
			}
			return vs[i+1].Since, portName, false
		}
	}
	return left, portName, false
}

// liveIn says whether svc (one version; nil when deleted) has f's
// destination live behind f's frontend, and names the port.
func liveIn(svc *Service, f *ConntrackFlows) (string, bool) {
	if svc == nil {
		return "", false
	}
	fam := f.Frontend.Family()
	for _, sp := range svc.Ports {
		proto := string(sp.Protocol)
		if proto == "" {
			proto = "TCP"
		}
		if proto != f.Frontend.Protocol || !frontendOf(svc, sp, f.Frontend) {
			continue
		}
		listed, serving, anyServing := false, false, false
		for _, sl := range svc.Slices {
			if sl.Family != fam {
				continue
			}
			for _, p := range sl.Ports {
				if p.Name != sp.Name || p.Protocol != proto {
					continue
				}
				for _, e := range sl.Endpoints {
					up := e.Ready || e.Serving
					anyServing = anyServing || up
					if e.Addr == f.Dest.Addr() && p.Port == f.Dest.Port() {
						listed, serving = true, serving || up
					}
				}
			}
		}
		// TCP: live while listed at all (draining connections). UDP:
		// while serving, as kube-proxy's cleanup has it; and while still
		// listed when the service has no serving endpoint at all (a lone
		// pod not ready: kube-proxy leaves its entries, the pod is there,
		// and the service being down is another problem than this).
		return sp.Name, listed && (proto == "TCP" || serving || !anyServing)
	}
	return "", false
}

// frontendOf says whether k is a frontend of the service port.
func frontendOf(svc *Service, sp corev1.ServicePort, k FrontendKey) bool {
	if k.NodePort {
		return sp.NodePort != 0 && uint16(sp.NodePort) == k.Port
	}
	if uint16(sp.Port) != k.Port {
		return false
	}
	for _, ips := range [][]netip.Addr{svc.ClusterIPs, svc.ExternalIPs, svc.LBIPs} {
		if slices.Contains(ips, k.IP) {
			return true
		}
	}
	return false
}

func conntrackDetail(f *ConntrackFlows, left, now time.Time, stamped bool) string {
	var parts []string
	if f.UDP > 0 {
		parts = append(parts, fmt.Sprintf("%d UDP", f.UDP))
	}
	if f.SCTP > 0 {
		parts = append(parts, fmt.Sprintf("%d SCTP", f.SCTP))
	}
	states := make([]string, 0, len(f.TCP))
	for s := range f.TCP {
		states = append(states, s)
	}
	sort.Strings(states)
	for _, s := range states {
		parts = append(parts, fmt.Sprintf("%d TCP %s", f.TCP[s], s))
	}
	d := fmt.Sprintf("%s flow(s) through %s still DNATed to %s, which left the service %s ago",
		strings.Join(parts, ", "), f.Frontend, f.Dest, now.Sub(left).Round(time.Second))
	if !now.After(left) { // offline (proxyaudit diff): one cluster state, no history
		d = fmt.Sprintf("%s flow(s) through %s still DNATed to %s, which is not an endpoint of the service", strings.Join(parts, ", "), f.Frontend, f.Dest)
	}
	if f.Unreplied > 0 {
		d += fmt.Sprintf("; %d never answered", f.Unreplied)
	}
	if !f.Active.IsZero() && now.After(left) {
		d += fmt.Sprintf("; still carrying packets %s after it left", f.Active.Sub(left).Round(time.Second))
	}
	if !f.Oldest.IsZero() {
		if stamped {
			d += "; oldest began " + f.Oldest.UTC().Format(time.RFC3339)
		} else {
			d += "; oldest seen since " + f.Oldest.UTC().Format(time.RFC3339)
		}
	}
	if len(f.Samples) > 0 {
		var cs []string
		for _, s := range f.Samples {
			cs = append(cs, s.String())
		}
		d += "; clients " + strings.Join(cs, ", ")
	}
	return d + ": their packets go to a pod that is gone; delete the entries (conntrack -D) or restart the clients"
}

// ProtocolName names an IP protocol number kube-proxy serves (TCP, UDP,
// SCTP).
func ProtocolName(p uint8) (string, bool) {
	switch p {
	case 6:
		return "TCP", true
	case 17:
		return "UDP", true
	case 132:
		return "SCTP", true
	}
	return "", false
}
