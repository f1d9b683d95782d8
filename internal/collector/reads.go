package collector

import (
	"context"
	"net/netip"
	"slices"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// DefaultFullReadInterval bounds how long a change a signal missed can go
// unseen.
const DefaultFullReadInterval = 5 * time.Minute

// exactBackstop stretches the backstop where the signal is exact (the
// nf_tables generation: nothing to miss): with the default
// FullReadInterval, one read an hour, as kube-proxy's own full resync. At
// the anchors one nftables read costs ~0.5 s of CPU: every 5 minutes that
// was most of a quiet node's cost.
const exactBackstop = 12

// minReadGap is the least time between the starts of two reads that the
// aggregator's read-now requests or announced changes can cause.
const minReadGap = time.Second

// readWait is how long a read that a change or a read-now request causes
// waits: until minReadGap has passed since the last read began and the
// read budget is out of debt, but never beyond the heartbeat interval
// after that read, so a node under churn still reports what it shows at
// least once an interval.
func readWait(sinceLast, budgetWait, interval time.Duration) time.Duration {
	left := max(minReadGap-sinceLast, budgetWait)
	return min(left, max(interval, minReadGap)-sinceLast)
}

// flushPoll is how often a reader without a change signal (IPVS) is
// asked whether the rules were flushed: a peek at the first part of a
// dump, tens of microseconds.
const flushPoll = 250 * time.Millisecond

// probe is the reader's FlushProbe, or nil.
func (c *client) probe() FlushProbe {
	p, _ := c.reader.(FlushProbe)
	return p
}

// Flushed says whether the rules were flushed since the last read (see
// FlushProbe): a read then does not wait for the read budget.
func (c *client) Flushed(ctx context.Context) bool {
	p := c.probe()
	return p != nil && c.cached != nil && p.Flushed(ctx)
}

// settleDelay lets a burst of announced commits (kube-proxy's sync of
// several tables, a partial restore) end before the read.
const settleDelay = 100 * time.Millisecond

// events are the change signal's announcements (nil: none).
func (c *client) events() <-chan struct{} {
	if c.signal == nil {
		return nil
	}
	return c.signal.Events()
}

// Due says why the rules need a read now, or "" when the last read still
// shows them: its token unchanged and younger than FullReadInterval.
// orElse is the reason when there is no last read or no usable signal.
func (c *client) Due(orElse stream.ReadReason) stream.ReadReason {
	if c.cached == nil || c.signal == nil {
		return orElse
	}
	backstop := c.cfg.FullReadInterval
	if c.signal.Exact() {
		backstop *= exactBackstop
	}
	if c.cfg.Clock.Since(c.readAt) >= backstop {
		return stream.ReadBackstop
	}
	tok, err := c.signal.Token()
	if err != nil {
		c.cfg.Log.Warn("cannot check whether the rules changed; reading them", zap.Error(err))
		return orElse
	}
	if tok != c.token {
		return stream.ReadChange
	}
	if c.legacy {
		// The legacy signal does not see a rewrite that keeps the table's
		// size, and kube-proxy replacing one pod by another is such a
		// rewrite: its own last-sync time says it wrote. Without its
		// metrics, every heartbeat reads.
		if c.kp == nil || c.kp.Error != "" || c.kp.LastSync == 0 {
			return orElse
		}
		if c.kp.LastSync != c.kpSyncAtRead {
			return stream.ReadChange
		}
	}
	return ""
}

// Report builds the next report against what was sent: of a new read when
// why is set, else of the last read.
func (c *client) Report(ctx context.Context, sent *stream.State, full bool, why stream.ReadReason, refs bool) *stream.Report {
	c.seq++
	var r *stream.Report
	if why != "" || c.cached == nil {
		if why == "" {
			why = stream.ReadResync
		}
		if err := c.read(ctx, why); err != nil {
			c.cfg.Log.Warn("cannot read kube-proxy's rules", zap.Error(err))
			r = &stream.Report{Seq: c.seq, Root: sent.Root(), Mode: sent.Mode, ReadError: err.Error(), Reads: c.stats()}
		}
	}
	if r == nil {
		r = stream.Delta(sent, c.cached, c.seq, full, refs)
		// A new stream's first report carries them whatever changed: its
		// aggregator (a new leader) has heard none of this collector's.
		if c.statsChanged || full {
			r.Reads, c.statsChanged = c.stats(), false
		}
	}
	if kp := c.kp; kp != nil && (c.lastKP == nil || *kp != *c.lastKP) {
		r.KubeProxy, c.lastKP = kp, kp
	}
	c.conntrack(ctx, r)
	return r
}

// conntrack reads the conntrack table when ConntrackInterval has passed
// since the last read, and puts the counts in r when they differ from
// those last sent on this stream by more than noise.
func (c *client) conntrack(ctx context.Context, r *stream.Report) {
	if c.cfg.Conntrack == nil || c.cached == nil {
		return
	}
	if now := c.cfg.Clock.Now(); c.ct == nil || now.Sub(c.ctAt) >= c.cfg.ConntrackInterval {
		keys := c.conntrackKeys(now)
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ct, err := c.cfg.Conntrack.Read(rctx, keys)
		cancel()
		c.ctAt = now
		if err != nil {
			c.cfg.Log.Warn("cannot read the conntrack table", zap.Error(err))
			c.ct = &stream.Conntrack{Error: err.Error()}
		} else {
			c.ct = stream.FromConntrack(ct)
		}
	}
	ct := c.offTheRules(c.ct)
	if d := ct.Digest(); d != c.ctSent {
		r.Conntrack, c.ctSent = ct, d
	}
}

// offTheRules is ct with the last packets kept only for destinations the
// node's rules, as last read, no longer send the frontend to: there a flow
// that only counts down is no blackhole, and the time moves only while
// one is. Elsewhere new flows keep coming (the rules still send them
// there), and the time of the last would only make every busy node report
// every read. It is worked out at every report, not once a conntrack
// read: when kube-proxy takes a pod out of the rules between two reads,
// the flows' last packets must reach the aggregator with the rules that
// show it (a CoreDNS rollout made StaleConntrack on every node for the
// rest of the conntrack interval, each lookup's entry undated).
//
// Of those it keeps, a pair whose last packet came before the previous
// read (and ten seconds' rounding) is Quiet: packets stopped going
// through it (a fault healed, a client that gave up), and its entries
// only count down to their timeouts, minutes for a TCP attempt: no
// blackhole (the soak met a node's healed fault reported for two minutes
// after its heal).
func (c *client) offTheRules(ct *stream.Conntrack) *stream.Conntrack {
	if len(ct.Pairs) == 0 {
		return ct
	}
	quietBefore := c.ctAt.Add(-c.cfg.ConntrackInterval - 10*time.Second).Unix()
	var out *stream.Conntrack
	for i, p := range ct.Pairs {
		if p.Active == 0 {
			continue
		}
		dest, err := netip.ParseAddrPort(p.Dest)
		served := err != nil || c.serves(p.Frontend, dest) != ""
		if !served && p.Active >= quietBefore {
			continue
		}
		if out == nil {
			cp := *ct
			cp.Pairs = slices.Clone(ct.Pairs)
			out = &cp
		}
		if served {
			out.Pairs[i].Active = 0
		} else {
			out.Pairs[i].Quiet = true
		}
	}
	if out == nil {
		return ct
	}
	return out
}

// ctRemember is how long the flows of a frontend that left the node's
// rules are still counted (a statsd client pinned to a service scaled to
// zero sent into a gone pod for 13 hours: kubernetes#139628), and
// ctMaxGone how many such frontends are remembered.
const (
	ctRemember = 24 * time.Hour
	ctMaxGone  = 50_000
)

// conntrackKeys are the frontends whose flows a conntrack read counts:
// those of the rules as last read (and those the rules reject for having
// no endpoints, where the reader says), and those that left them within
// ctRemember.
func (c *client) conntrackKeys(now time.Time) []audit.FrontendKey {
	cur := map[audit.FrontendKey]bool{}
	c.cached.ParsedKeys(func(_ string, k audit.FrontendKey) { cur[k] = true })
	if ne, ok := c.reader.(NoEndpointReader); ok {
		for _, k := range ne.NoEndpoints() {
			cur[k] = true
		}
	}
	if c.ctGone == nil {
		c.ctGone = map[audit.FrontendKey]time.Time{}
	}
	changed := len(cur) != len(c.ctKeys)
	for k := range c.ctKeys {
		if !cur[k] {
			changed = true
			if len(c.ctGone) < ctMaxGone {
				c.ctGone[k] = now
			}
		}
	}
	keys := make([]audit.FrontendKey, 0, len(cur)+len(c.ctGone))
	for k, at := range c.ctGone {
		if cur[k] || now.Sub(at) > ctRemember {
			delete(c.ctGone, k)
			changed = true
			continue
		}
		keys = append(keys, k)
	}
	for k := range cur {
		keys = append(keys, k)
	}
	c.ctKeys = cur
	if changed || c.ctDirty || !c.ctSaved {
		c.saveConntrack()
		c.ctSaved, c.ctDirty = true, false
	}
	return keys
}

// leftRules remembers the frontends a rules read took out of the rules
// (ctGone), whether a conntrack read saw them or not: a service whose
// pods went seconds after it came (a node port emptied within one
// conntrackInterval: the soak's blackhole on kube-proxy 1.37) was never
// among the frontends of a conntrack read, and its flows, pinned to the
// gone pod, were never counted. Those of the last conntrack read are
// remembered there too (conntrackKeys).
func (c *client) leftRules(prev *stream.State, changes *audit.Changes) {
	if c.cfg.Conntrack == nil || prev == nil {
		return
	}
	now := c.cfg.Clock.Now()
	gone := func(k audit.FrontendKey) {
		if c.ctGone == nil {
			c.ctGone = map[audit.FrontendKey]time.Time{}
		}
		if _, ok := c.ctGone[k]; !ok && len(c.ctGone) < ctMaxGone {
			c.ctGone[k], c.ctDirty = now, true
		}
	}
	if changes != nil {
		for _, k := range changes.Removed {
			gone(k)
		}
		return
	}
	prev.ParsedKeys(func(key string, k audit.FrontendKey) {
		if _, ok := c.cached.Get(key); !ok {
			gone(k)
		}
	})
}

// read reads the rules once, with the token it reflects, and counts it.
func (c *client) read(ctx context.Context, why stream.ReadReason) error {
	if c.reader == nil {
		src, err := c.cfg.Host.Detect(ctx)
		if err != nil {
			return err
		}
		c.cfg.Log.Info("detected kube-proxy mode", zap.Stringer("mode", src))
		if src.Note != "" {
			c.cfg.Log.Warn(src.Note)
		}
		c.reader = c.cfg.Host.Reader(src)
		c.openSignal(src)
	}
	var tok uint64
	var tokErr error
	if c.signal != nil {
		// Before the read: a commit during it moves the token again.
		tok, tokErr = c.signal.Token()
	}
	rctx, cancel := context.WithTimeout(ctx, max(c.cfg.Interval, 30*time.Second))
	defer cancel()
	// kube-proxy's metrics as last scraped (each heartbeat scrapes once:
	// a frozen kube-proxy holds a scrape for its whole timeout): a sync
	// after them moves them again, and the legacy signal reads once more.
	if c.kp == nil {
		c.scrape(ctx)
	}
	var kpSync float64
	if c.kp != nil {
		kpSync = c.kp.LastSync
	}
	c.readAt = c.cfg.Clock.Now()
	before := c.cpu()
	start := time.Now()
	var obs *audit.Observed
	var changes *audit.Changes
	var err error
	if cr, ok := c.reader.(ChangeReader); ok && c.cached != nil {
		// Only what changed since the last read (the reader says when it
		// read everything).
		changes, err = cr.ReadChanges(rctx)
		if err == nil && changes.Whole != nil {
			obs, changes = changes.Whole, nil
		}
	} else {
		obs, err = c.reader.Read(rctx)
	}
	c.cost.Reads[why]++
	c.cost.LastSeconds = time.Since(start).Seconds()
	spent := c.cpu() - before
	c.cost.LastCPUSeconds = spent.Seconds()
	c.credit.spend(c.cfg.Clock.Now(), spent)
	if b, ok := c.reader.(interface{ BytesRead() int64 }); ok {
		c.cost.LastBytes = b.BytesRead()
	}
	c.statsChanged = true
	if f, ok := c.reader.(interface{ Fallbacks() (uint64, string) }); ok {
		if n, why := f.Fallbacks(); n > c.fallbacksSeen {
			c.cfg.Log.Warn("the kernel reader could not decode a rule and read the rules with the text tool instead; this node's reads are slow until that rule goes",
				zap.String("reader", c.reader.String()), zap.String("why", why), zap.Uint64("fallbacks", n))
			c.fallbacksSeen = n
		}
	}
	if err != nil {
		return err
	}
	prev := c.cached
	if changes != nil {
		c.cached = applyChanges(c.cached, changes)
	} else {
		c.cached = stream.FromModel(obs)
		c.cost.WholeSeconds, c.cost.WholeCPUSeconds, c.cost.WholeBytes = c.cost.LastSeconds, c.cost.LastCPUSeconds, c.cost.LastBytes
		c.cost.Warnings = c.cost.Warnings[:0]
		for _, w := range obs.Warnings[:min(len(obs.Warnings), stream.MaxReadWarnings)] {
			c.cost.Warnings = append(c.cost.Warnings, clipText(w))
		}
	}
	c.leftRules(prev, changes)
	c.token, c.kpSyncAtRead = tok, kpSync
	if changes != nil && c.fed {
		// A read of notified changes shows the commits its notes
		// covered (see Changes.Through).
		c.token = changes.Through
	}
	if tokErr != nil {
		c.token = 0 // unknown: the next check reads again
	}
	return nil
}

// applyChanges is the state after a read of changes: the frontends that
// changed put, those gone removed, the rest shared with the state before.
func applyChanges(s *stream.State, ch *audit.Changes) *stream.State {
	removed := make([]string, len(ch.Removed))
	for i, k := range ch.Removed {
		removed[i] = stream.KeyString(k)
	}
	fs := make([]stream.Frontend, len(ch.Frontends))
	for i, f := range ch.Frontends {
		fs[i] = stream.FromObserved(f)
	}
	next := s.With(removed, fs)
	next.Mode, next.NoRules, next.Families = string(ch.Mode), ch.NoRules, slices.Clone(ch.Families)
	return next
}

// openSignal opens the change signal of the detected (or configured)
// source, once. Without one every heartbeat reads.
func (c *client) openSignal(src Source) {
	// Where Cilium replaces kube-proxy there is no kube-proxy to scrape.
	c.noKubeProxy = src.Mode == audit.ModeCilium
	if c.signalTried || c.cfg.Host.OpenSignal == nil {
		return
	}
	c.signalTried = true
	sig, err := c.cfg.Host.OpenSignal(src)
	switch {
	case err != nil:
		c.cfg.Log.Warn("no change signal for these rules: reading them every interval", zap.Stringer("mode", src), zap.Error(err))
	case sig == nil:
		c.cfg.Log.Info("this mode has no change signal: reading the rules every interval", zap.Stringer("mode", src))
	default:
		c.signal, c.legacy = sig, src.Legacy
		// The nftables reader learns new maps from the notifications the
		// signal receives anyway, instead of dumping each.
		if f, ok := sig.(interface{ Feed(NotificationSink) }); ok {
			if sink, ok := c.reader.(NotificationSink); ok {
				f.Feed(sink)
				c.fed = true
			}
		}
	}
}

// stats is the read cost as sent to the aggregator.
func (c *client) stats() *stream.ReadStats {
	rs := &stream.ReadStats{Reads: map[stream.ReadReason]uint64{}, LastSeconds: c.cost.LastSeconds, LastBytes: c.cost.LastBytes,
		LastCPUSeconds: c.cost.LastCPUSeconds, FullReadIntervalSeconds: c.cfg.FullReadInterval.Seconds(),
		WholeSeconds: c.cost.WholeSeconds, WholeCPUSeconds: c.cost.WholeCPUSeconds, WholeBytes: c.cost.WholeBytes}
	if c.signal != nil {
		rs.SignalLost = c.signal.Lost()
	}
	if c.reader != nil {
		rs.Reader = clipText(c.reader.String())
	}
	if f, ok := c.reader.(interface{ Fallbacks() (uint64, string) }); ok {
		n, why := f.Fallbacks()
		rs.Fallbacks, rs.FallbackReason = n, clipText(why)
	}
	for k, v := range c.cost.Reads {
		rs.Reads[k] = v
	}
	rs.Warnings = slices.Clone(c.cost.Warnings)
	return rs
}

// clipText keeps at most 500 bytes of a text the aggregator shows.
func clipText(s string) string {
	if len(s) > 500 {
		return s[:500]
	}
	return s
}

// cpu is what the read budget measures reads by (Config.CPUTime).
func (c *client) cpu() time.Duration {
	if c.cfg.CPUTime != nil {
		return c.cfg.CPUTime()
	}
	return cpuTime()
}

// cpuTime is the CPU this process and the children it waited for used.
func cpuTime() time.Duration {
	var self, kids syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &kids)
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}

// ReadWait is how long a read a change or a read-now request causes waits
// (see readWait); the first read does not.
func (c *client) ReadWait(now time.Time) time.Duration {
	if c.readAt.IsZero() {
		return 0
	}
	return readWait(now.Sub(c.readAt), c.credit.wait(now), c.cfg.Interval)
}
