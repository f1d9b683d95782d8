package aggregator

import (
	"errors"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/safetext"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// apply records one report. It returns whether the copy matches the
// collector's root; a reason when the stream must end. The report is
// validated and applied to a copy outside the lock (a full snapshot at the
// anchors takes ~0.1 s): only this stream's goroutine changes its node's
// copy, and a newer stream for the node supersedes it. missing names the
// hashes of refs no node's copy holds: the report is not applied, and
// applied again (resumed) once their content came. now is when the report
// began to arrive (see arrived).
func (a *Aggregator) apply(n *node, c *conn, r *stream.Report, now time.Time, interval time.Duration, resumed bool) (ok bool, reason RejectReason, why string, missing *stream.MissingError) {
	a.mu.Lock()
	if reason, why := a.fleet.received(n, c, a.ownsLocked(n.name), r, resumed); reason != "" {
		a.mu.Unlock()
		return reason != ReasonReplay, reason, why, nil
	}
	hb := audit.Heartbeat{At: now, Interval: interval, Mode: audit.Mode(r.Mode), ReadError: r.ReadError, KubeProxy: kubeProxySignal(r.KubeProxy),
		Cost: a.collectorCost(n, r.Reads)}
	if r.ReadError != "" {
		a.fleet.judge.Heard(n.name, hb)
		a.mu.Unlock()
		return true, "", "", nil
	}
	if !r.Full && !n.complete {
		a.mu.Unlock()
		return false, "", "no full snapshot on this stream yet", nil
	}
	next := *n.state
	a.mu.Unlock()

	match, err := next.Apply(r)

	a.mu.Lock()
	defer a.mu.Unlock()
	if n.conn != c || !a.ownsLocked(n.name) {
		return true, ReasonProtocol, "stream superseded", nil
	}
	if me := (*stream.MissingError)(nil); errors.As(err, &me) {
		return true, "", "", me
	}
	if err != nil {
		return false, ReasonInvalid, "invalid report: " + err.Error(), nil
	}
	why, emptied := a.fleet.applied(n, r, next, match, now, hb)
	if emptied {
		a.cfg.Log.Info("node has no kube-proxy rules (flushed, or kube-proxy not running)", zap.String("node", n.name))
		a.cfg.Metrics.NoRulesSeen.WithLabelValues(n.name).Inc()
	}
	return why == "", "", why, nil
}

func kubeProxySignal(k *stream.KubeProxy) *audit.KubeProxySignal {
	if k == nil {
		return nil
	}
	unix := func(f float64) time.Time {
		if f <= 0 {
			return time.Time{}
		}
		return time.Unix(0, int64(f*1e9)).UTC()
	}
	return &audit.KubeProxySignal{LastSync: unix(k.LastSync), LastQueued: unix(k.LastQueued),
		EndpointChangesPending: int(k.EndpointChangesPending), ServiceChangesPending: int(k.ServiceChangesPending), Error: safetext.Clean(k.Error, maxReadError),
		Version: clip(k.Version)}
}

// collectorCost turns what a collector says its reads cost into the
// node's record and the fleet's metrics (a.mu held): counts are
// cumulative per collector, so the metrics add what grew since its last
// word (a restarted collector starts from zero).
func (a *Aggregator) collectorCost(n *node, rs *stream.ReadStats) *audit.CollectorCost {
	if rs == nil {
		// No new counts (nothing read since the last report): the version
		// alone, which the hello said, so a roll is seen on every node,
		// a quiet or stuck one too.
		if n.collectorVersion == "" {
			return nil
		}
		return &audit.CollectorCost{Version: n.collectorVersion}
	}
	cost := &audit.CollectorCost{Version: n.collectorVersion, Reads: make(map[string]uint64, len(rs.Reads)), LastReadSeconds: rs.LastSeconds,
		LastReadCPUSeconds: rs.LastCPUSeconds, LastReadBytes: rs.LastBytes,
		LastWholeReadSeconds: rs.WholeSeconds, LastWholeReadCPUSeconds: rs.WholeCPUSeconds, LastWholeReadBytes: rs.WholeBytes, FullReadIntervalSeconds: rs.FullReadIntervalSeconds, SignalLost: rs.SignalLost,
		Reader: safetext.Clean(rs.Reader, maxReadError), Fallbacks: rs.Fallbacks, FallbackReason: safetext.Clean(rs.FallbackReason, maxReadError)}
	for _, w := range rs.Warnings {
		cost.Warnings = append(cost.Warnings, safetext.Clean(w, maxReadError))
	}
	if prev := n.fallbacks; rs.Fallbacks > prev {
		a.cfg.Metrics.CollectorFallbacks.Add(float64(rs.Fallbacks - prev))
	}
	n.fallbacks = rs.Fallbacks
	grew := false
	for reason, count := range rs.Reads {
		cost.Reads[string(reason)] = count
		prev := n.reads[reason]
		if count < prev {
			prev = 0
		}
		if count > prev {
			grew = true
			label := string(reason)
			if !slices.Contains(stream.ReadReasons, reason) {
				label = "other" // a newer collector's reason: the label set stays bounded
			}
			a.cfg.Metrics.CollectorReads.WithLabelValues(label).Add(float64(count - prev))
		}
	}
	if grew {
		a.cfg.Metrics.CollectorReadSeconds.Observe(rs.LastSeconds)
		a.cfg.Metrics.CollectorReadBytes.Observe(float64(rs.LastBytes))
	}
	n.reads = rs.Reads
	return cost
}
