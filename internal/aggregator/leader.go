package aggregator

import (
	"context"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
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
			OnStartedLeading: func(context.Context) { a.StartedLeading() },
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
