package aggregator

import (
	"net/netip"
	"slices"

	"go.uber.org/zap"
	discoveryv1 "k8s.io/api/discovery/v1"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// peerIPs returns the addresses of the Config.Peers Service's endpoints
// that are not terminating, sorted (at most stream.MaxPeers): every
// aggregator replica, as the Service's DNS name resolves.
func (a *Aggregator) peerIPs() []string {
	if a.cfg.Peers == "" || a.view == nil {
		return nil
	}
	objs, err := a.view.sliceIdx.ByIndex(byService, a.cfg.Peers)
	if err != nil {
		return nil
	}
	var out []string
	for _, o := range objs {
		for _, e := range o.(*discoveryv1.EndpointSlice).Endpoints {
			if e.Conditions.Terminating != nil && *e.Conditions.Terminating {
				continue
			}
			for _, s := range e.Addresses {
				if ip, err := netip.ParseAddr(s); err == nil {
					out = append(out, ip.String())
				}
			}
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	return out[:min(len(out), stream.MaxPeers)]
}

// announcePeers sends the replicas' addresses to every collector
// streaming here when they changed (a rollout replacing the aggregators:
// a collector learns each new replica while it is connected, so that when
// the old ones are gone it finds the new ones without DNS), and keeps the
// message for new streams. Run's goroutine.
func (a *Aggregator) announcePeers() {
	ips := a.peerIPs()
	if known := a.knownPeers(); len(ips) == 0 || (known != nil && slices.Equal(ips, known.IPs)) {
		return
	}
	m := &stream.Message{Type: stream.TypePeers, Peers: &stream.Peers{IPs: ips}}
	a.peersMsg.Store(m)
	a.mu.Lock()
	leading := a.lead.isLeading() || len(a.held) > 0
	var conns []*conn
	for _, n := range a.nodes {
		if n.conn != nil {
			conns = append(conns, n.conn)
		}
	}
	a.mu.Unlock()
	if leading {
		a.cfg.Log.Info("aggregator replicas changed: telling the collectors", zap.Strings("addresses", ips), zap.Int("streams", len(conns)))
	}
	// Each on its own: a collector slow to read its socket must not hold
	// up the others (a write may wait out its 10 s deadline).
	for _, c := range conns {
		go a.sendPeers(c)
	}
}

// sendPeers sends the newest peers message to the collector on c (two
// sends racing, a new stream's and a change's, end on the newer).
func (a *Aggregator) sendPeers(c *conn) {
	a.sent(c.sendNewest(a.peersMsg.Load))
	a.cfg.Metrics.StreamMessages.WithLabelValues("out", stream.TypePeers).Inc()
}

// knownPeers is the replicas' addresses as last read, for a follower's
// answers (redirect, no leader yet): a collector bouncing between a
// follower and a leader that is gone, while the Lease has not moved,
// learns the new replicas there before the follower goes too (nil: none
// known).
func (a *Aggregator) knownPeers() *stream.Peers {
	if m := a.peersMsg.Load(); m != nil {
		return m.Peers
	}
	return nil
}
