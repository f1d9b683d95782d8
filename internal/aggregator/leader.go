package aggregator

import (
	"context"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/utils/ptr"
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
