package aggregator

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"

	"go.uber.org/zap"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// peerIPs returns the addresses of the Config.Peers Service's endpoints
// that are not terminating, sorted (at most stream.MaxPeers): every
// aggregator replica, as the Service's DNS name resolves.
func (a *Aggregator) peerIPs() []string {
	if a.cfg.Peers == "" || a.view == nil {
		return nil
	}
	return replicaIPs(a.view.EndpointSlices(a.cfg.Peers), "")
}

// PeerAddresses are the replicas' addresses as the peers Service's
// endpoints list them (Config.Peers): the sources the internal API's
// reviews favour (auth.PeerAuth.Replicas).
func (a *Aggregator) PeerAddresses() []string { return a.peerIPs() }

// replicaIPs returns the addresses of the endpoints in eps that are not
// terminating, but self's, sorted (at most stream.MaxPeers). Endpoints
// not yet ready count: a replica is worth dialing as soon as it has an
// address (it redirects to the leader, or leads once it holds the Lease).
func replicaIPs(eps []*discoveryv1.EndpointSlice, self string) []string {
	var out []string
	for _, o := range eps {
		for _, e := range o.Endpoints {
			if e.Conditions.Terminating != nil && *e.Conditions.Terminating {
				continue
			}
			for _, s := range e.Addresses {
				if ip, err := netip.ParseAddr(s); err == nil && ip.String() != self {
					out = append(out, ip.String())
				}
			}
		}
	}
	slices.Sort(out)
	out = slices.Compact(out)
	return out[:min(len(out), stream.MaxPeers)]
}

// Farewell tells every collector streaming here the other replicas, read
// now from the API (the informer's copy when the API does not answer),
// and waits until each was told or ctx ends: the replica is going (the
// SIGTERM of a rolling update) and its streams with it. A rollout can
// replace a replica a moment after its successor got an address, before
// the informer's copy and the second's tick would have named it; a
// collector whose DNS is down (it goes through the node's kube-proxy)
// would then know only replicas that are all gone. Call it before the
// streams close.
func (a *Aggregator) Farewell(ctx context.Context, client kubernetes.Interface) {
	if a.cfg.Peers == "" {
		return
	}
	self, _, _ := net.SplitHostPort(a.cfg.Self)
	if ip, err := netip.ParseAddr(self); err == nil {
		self = ip.String()
	}
	var eps []*discoveryv1.EndpointSlice
	ns, name, _ := strings.Cut(a.cfg.Peers, "/")
	list, err := client.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + name})
	if err == nil {
		for i := range list.Items {
			eps = append(eps, &list.Items[i])
		}
	} else if a.view != nil {
		a.cfg.Log.Warn("cannot read the replicas from the API on the way out: telling the collectors those last seen", zap.Error(err))
		eps = a.view.EndpointSlices(a.cfg.Peers)
	}
	ips := replicaIPs(eps, self)
	if len(ips) == 0 {
		return
	}
	a.leaving.Store(true)
	m := &stream.Message{Type: stream.TypePeers, Peers: &stream.Peers{IPs: ips}}
	a.peersMsg.Store(m)
	a.mu.Lock()
	var conns []*conn
	for _, n := range a.fleet.nodes {
		if n.conn != nil {
			conns = append(conns, n.conn)
		}
	}
	a.mu.Unlock()
	if len(conns) == 0 {
		return
	}
	var wg sync.WaitGroup
	for _, c := range conns {
		wg.Go(func() { a.sendPeers(c) })
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		a.cfg.Log.Info("going away: told the collectors the other replicas", zap.Strings("addresses", ips), zap.Int("streams", len(conns)))
	case <-ctx.Done():
		a.cfg.Log.Warn("going away: not every collector could be told the other replicas in time", zap.Strings("addresses", ips), zap.Int("streams", len(conns)))
	}
}

// announcePeers sends the replicas' addresses to every collector
// streaming here when they changed (a rollout replacing the aggregators:
// a collector learns each new replica while it is connected, so that when
// the old ones are gone it finds the new ones without DNS), and keeps the
// message for new streams. Run's goroutine.
func (a *Aggregator) announcePeers() {
	if a.leaving.Load() {
		return // the farewell's list stands: this replica is not in it
	}
	ips := a.peerIPs()
	if known := a.knownPeers(); len(ips) == 0 || (known != nil && slices.Equal(ips, known.IPs)) {
		return
	}
	m := &stream.Message{Type: stream.TypePeers, Peers: &stream.Peers{IPs: ips}}
	a.peersMsg.Store(m)
	a.mu.Lock()
	leading := a.lead.isLeading() || len(a.fleet.held) > 0
	var conns []*conn
	for _, n := range a.fleet.nodes {
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
	a.cfg.Metrics.sent(c.sendNewest(a.peersMsg.Load))
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
