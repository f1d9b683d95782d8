package collector

import (
	"context"
	"net/netip"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/dataplane/conntrack"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Flush acts on the aggregator's request to delete stale conntrack
// entries, deciding for itself what it may delete: a pair is refused when
// the frontend is neither in the node's rules as last read nor one that
// left them lately (ctGone), or when those rules still send it to the
// destination (a live endpoint: an aggregator
// that is wrong or compromised cannot cut flows the node serves). What is
// left is deleted as conntrack.FlushTarget says: UDP, and TCP only for connection
// attempts never answered.
func (c *client) Flush(ctx context.Context, f *stream.Flush) *stream.Flushed {
	if f == nil {
		return &stream.Flushed{Error: "an empty flush request"}
	}
	out := &stream.Flushed{ID: f.ID}
	del, ok := c.cfg.Conntrack.(ConntrackDeleter)
	switch {
	case !c.cfg.ConntrackDelete || !ok:
		out.Error = "conntrack deletion is off on this collector (--conntrack-delete; the chart's remediation.conntrack.enabled)"
	case c.cached == nil:
		out.Error = "no rules read yet on this node: nothing is deleted before they are"
	}
	if err := f.Check(); err != nil && out.Error == "" {
		out.Error = "invalid flush request: " + err.Error()
	}
	if out.Error != "" {
		c.cfg.Log.Warn("conntrack flush refused", zap.String("why", out.Error))
		return out
	}
	out.Results = make([]stream.FlushResult, len(f.Pairs))
	var targets []conntrack.FlushTarget
	var index []int
	var explicit map[audit.FrontendKey]bool // the rules' frontends that are not node ports, for node ports' targets
	for i, p := range f.Pairs {
		fe, _ := stream.ParseKey(p.Frontend) // Check parsed both
		dest, _ := netip.ParseAddrPort(p.Dest)
		if why := c.serves(p.Frontend, dest); why != "" {
			out.Results[i].Refused = why
			continue
		}
		t := conntrack.FlushTarget{Frontend: fe, Dest: dest, TCP: p.TCP}
		if fe.NodePort {
			if explicit == nil {
				explicit = map[audit.FrontendKey]bool{}
				c.cached.ParsedKeys(func(_ string, k audit.FrontendKey) {
					if !k.NodePort {
						explicit[audit.FrontendKey{IP: k.IP.Unmap(), Protocol: k.Protocol, Port: k.Port}] = true
					}
				})
			}
			t.Explicit = explicit
		}
		targets = append(targets, t)
		index = append(index, i)
	}
	if len(targets) > 0 {
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		deleted, err := del.Delete(dctx, targets)
		cancel()
		for j, n := range deleted {
			out.Results[index[j]].Deleted = n
		}
		if err != nil {
			out.Error = err.Error()
		}
		// The counts the aggregator judges change now, not at the next
		// conntrack interval.
		c.ct = nil
	}
	c.cfg.Log.Info("conntrack flush", zap.Uint64("id", f.ID), zap.Any("results", out.Results), zap.String("error", out.Error))
	return out
}

// serves says why the node's rules forbid deleting frontend's flows to
// dest ("" when they do not): the frontend is not one of the node's, or
// its rules still send it there.
func (c *client) serves(frontend string, dest netip.AddrPort) string {
	fe, ok := c.cached.Get(frontend)
	if !ok {
		if k, err := stream.ParseKey(frontend); err == nil {
			if _, gone := c.ctGone[k]; gone || c.ctKeys[k] {
				return "" // left the rules (since the last conntrack read, or before): they send it nowhere
			}
		}
		return "not a frontend of this node's rules, now or in the last " + ctRemember.String()
	}
	for _, e := range fe.Endpoints {
		if ap, err := netip.ParseAddrPort(e); err == nil && ap.Addr().Unmap() == dest.Addr().Unmap() && ap.Port() == dest.Port() {
			return "this node's rules still send " + frontend + " to " + dest.String() + ": a live endpoint, never flushed"
		}
	}
	return ""
}
