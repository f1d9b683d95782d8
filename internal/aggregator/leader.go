package aggregator

import (
	"context"
	"time"

	"go.uber.org/zap"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/utils/ptr"

	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// Election is how replicas agree on a leader: a Lease, renewed by the
// holder. Identity must be what collectors dial (the advertise address and
// stream port), because followers redirect to it.
type Election struct {
	Namespace, Name string
	Identity        string
	LeaseDuration   time.Duration
	RenewDeadline   time.Duration
	RetryPeriod     time.Duration
}

// RunElection campaigns until ctx ends. While leading, the aggregator
// judges; on losing the lease it hands its streams over and campaigns
// again, so a replica that lost a renewal comes back as a follower
// instead of exiting. The lease is released on shutdown, so a rolling
// update hands over at once rather than after LeaseDuration.
func RunElection(ctx context.Context, client kubernetes.Interface, e Election, a *Aggregator) error {
	lock, err := resourcelock.New(resourcelock.LeasesResourceLock, e.Namespace, e.Name,
		client.CoreV1(), client.CoordinationV1(), resourcelock.ResourceLockConfig{Identity: e.Identity})
	if err != nil {
		return err
	}
	cfg := leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   e.LeaseDuration,
		RenewDeadline:   e.RenewDeadline,
		RetryPeriod:     e.RetryPeriod,
		ReleaseOnCancel: true,
		Name:            e.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				a.Lead(ctx, -1)
				a.SetTerm(ctx, leaseTerm(ctx, client, e))
			},
			OnStoppedLeading: a.StoppedLeading,
			OnNewLeader:      a.NewLeader,
		},
	}
	for ctx.Err() == nil {
		le, err := leaderelection.NewLeaderElector(cfg)
		if err != nil {
			return err
		}
		le.Run(ctx)
	}
	return nil
}

// leaseTerm orders leaderships of the Lease just acquired: its creation
// time (a Lease deleted and created anew starts a later lineage, its
// transitions from 0 again) and the transitions client-go counts, which
// grow with every change of holder (up to 2^20 per lineage). It retries
// until it can read the Lease; -1 when the leadership ended first.
func leaseTerm(ctx context.Context, client kubernetes.Interface, e Election) int64 {
	for {
		if lease, err := client.CoordinationV1().Leases(e.Namespace).Get(ctx, e.Name, metav1.GetOptions{}); err == nil {
			transitions := int64(min(max(ptr.Deref(lease.Spec.LeaseTransitions, 0), 0), 1<<20-1))
			return lease.CreationTimestamp.Unix()<<20 | transitions
		}
		select {
		case <-ctx.Done():
			return -1
		case <-time.After(time.Second):
		}
	}
}

// StartedLeading makes this replica judge and accept streams, from a
// clean memory (collectors resend full snapshots on connecting), without
// an election: it leads until the process ends, unfenced (it is the only
// replica).
func (a *Aggregator) StartedLeading() { a.Lead(context.Background(), effect.Unfenced) }

// Lead makes this replica judge and accept streams until ctx ends (the
// elector cancels it when the lease is lost). Its remediation acts only
// while ctx lives and with term (-1: not known yet, no action).
func (a *Aggregator) Lead(ctx context.Context, term int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.lead.mu.Lock()
	a.lead.leading, a.lead.leader = true, a.cfg.Self
	a.lead.ctx, a.lead.term = ctx, term
	a.lead.mu.Unlock()
	a.cfg.Metrics.Leader.Set(1)
	if a.sharded() {
		a.fleet.verdict = nil
		// The streams and nodes are the shards' (HoldShard): leading
		// the fleet only concludes over them and acts.
		a.cfg.Log.Info("leading the fleet: concluding over the shards' partial verdicts", zap.String("self", a.cfg.Self))
		return
	}
	a.fleet.begin()
	a.warmup.reset()
	a.cfg.Log.Info("leading: accepting collector streams", zap.String("self", a.cfg.Self))
}

// StoppedLeading ends every stream (sending collectors to the new leader
// when it is known) and forgets the nodes.
func (a *Aggregator) StoppedLeading() {
	a.mu.Lock()
	a.lead.mu.Lock()
	was, leader := a.lead.leading, a.lead.leader
	a.lead.leading = false
	a.lead.mu.Unlock()
	if !was {
		a.mu.Unlock()
		return
	}
	a.cfg.Metrics.Leader.Set(0)
	// Only the leader judges its view; a follower's stale flag would keep
	// ProxyAuditViewStale firing for a replica that no longer decides.
	a.cfg.Metrics.ViewStale.Set(0)
	if a.sharded() {
		// Its shards' streams stay: only the fleet's decisions move.
		a.fleet.verdict = nil
		a.mu.Unlock()
		a.repair.Lock()
		a.repair.next = nil
		a.repair.Unlock()
		a.cfg.Log.Info("no longer leading the fleet", zap.String("leader", leader))
		return
	}
	open := a.fleet.end()
	a.mu.Unlock()
	a.repair.Lock()
	a.repair.next = nil // judged while leading: not for a later term
	a.repair.Unlock()
	// Writes happen outside the lock: a stuck collector must not hold up
	// the rest (each write has its own deadline).
	for _, c := range open {
		a.redirect(c, leader)
		c.Close()
	}
	a.cfg.Log.Info("no longer leading: streams handed over", zap.String("leader", leader), zap.Int("streams", len(open)))
}
