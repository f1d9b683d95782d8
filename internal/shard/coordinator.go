package shard

import (
	"context"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	coordlisters "k8s.io/client-go/listers/coordination/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/utils/ptr"
)

// Labels on the Leases a coordinator writes, so one list reads a set.
const (
	LabelSet   = "proxyaudit.io/shard-set" // Config.Prefix
	LabelKind  = "proxyaudit.io/lease"     // "member" or "shard"
	LabelShard = "proxyaudit.io/shard"     // a shard Lease's shard
)

// Config configures a Coordinator.
type Config struct {
	Client    kubernetes.Interface
	Namespace string
	// Prefix names the Leases: PREFIX-shard-K for shard K, PREFIX-member-HASH
	// for each replica's membership.
	Prefix string
	// Identity is what collectors dial to reach this replica (its address
	// and stream port): followers of a shard redirect to it.
	Identity string
	Shards   int
	// As client-go's leader election: a Lease not seen renewed for
	// LeaseDuration is free; a holder that cannot renew within
	// RenewDeadline stops; RetryPeriod paces campaigns and rounds.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// OnShard runs while this replica holds shard (its own goroutine);
	// ctx ends when the shard is given up, lost, or the coordinator stops.
	OnShard func(ctx context.Context, shard int)
	Log     *zap.Logger
}

// Coordinator holds a balanced share of the shards' Leases: each round it
// renews its membership Lease, reads every Lease of the set, and campaigns
// for or gives up shards as Decide says. Holding a shard is client-go's
// leader election on that shard's Lease, so two replicas never hold one
// shard at once; what this adds is the balance.
type Coordinator struct {
	cfg Config
	// keep leaves the Leases to expire when it stops, as a crashed
	// replica does (tests; set before Run).
	keep bool

	wg sync.WaitGroup // campaigns
	// leases is the set's Leases as one watch keeps them (Run starts it):
	// a round reads them there, not with a list.
	leases    coordlisters.LeaseNamespaceLister
	wrote     time.Time // the last membership renewal written
	rounds    int
	mu        sync.Mutex
	seen      map[string]observed
	campaigns map[int]*campaign
	holders   []string
}

type observed struct {
	holder   string
	renew    time.Time // the Lease's renewTime as written
	duration time.Duration
	at       time.Time // when this record was first seen, on our clock
}

type campaign struct {
	cancel  context.CancelFunc
	leading atomic.Bool
}

// New returns a coordinator; Run starts it.
func New(cfg Config) (*Coordinator, error) {
	if cfg.Shards < 1 || cfg.Identity == "" || cfg.Prefix == "" || cfg.Namespace == "" {
		return nil, fmt.Errorf("shard coordinator: need shards ≥ 1, an identity, a prefix and a namespace (got %d, %q, %q, %q)", cfg.Shards, cfg.Identity, cfg.Prefix, cfg.Namespace)
	}
	if !(cfg.RetryPeriod > 0 && cfg.RetryPeriod < cfg.RenewDeadline && cfg.RenewDeadline < cfg.LeaseDuration) {
		return nil, fmt.Errorf("shard coordinator: want 0 < retry period (%s) < renew deadline (%s) < lease duration (%s)", cfg.RetryPeriod, cfg.RenewDeadline, cfg.LeaseDuration)
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.OnShard == nil {
		cfg.OnShard = func(context.Context, int) {}
	}
	return &Coordinator{cfg: cfg, seen: map[string]observed{}, campaigns: map[int]*campaign{}, holders: make([]string, cfg.Shards)}, nil
}

// ShardLease is the name of shard k's Lease.
func (c *Coordinator) ShardLease(k int) string { return c.cfg.Prefix + "-shard-" + strconv.Itoa(k) }

func (c *Coordinator) memberLease() string {
	h := fnv.New32a()
	h.Write([]byte(c.cfg.Identity))
	return fmt.Sprintf("%s-member-%08x", c.cfg.Prefix, h.Sum32())
}

// Run takes part until ctx ends, then gives up its shards (their Leases
// released, so others take them at once) and its membership.
func (c *Coordinator) Run(ctx context.Context) {
	f := informers.NewSharedInformerFactoryWithOptions(c.cfg.Client, 0, informers.WithNamespace(c.cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = LabelSet + "=" + c.cfg.Prefix }))
	inf := f.Coordination().V1().Leases()
	c.leases = inf.Lister().Leases(c.cfg.Namespace)
	f.Start(ctx.Done())
	defer f.Shutdown()
	for !cache.WaitForCacheSync(ctx.Done(), inf.Informer().HasSynced) {
		if ctx.Err() != nil {
			return
		}
	}
	t := time.NewTicker(c.cfg.RetryPeriod)
	defer t.Stop()
	for {
		c.round(ctx)
		select {
		case <-ctx.Done():
			c.stop()
			return
		case <-t.C:
		}
	}
}

// Held is the shards this replica holds now, sorted.
func (c *Coordinator) Held() []int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []int
	for k, cp := range c.campaigns {
		if cp.leading.Load() {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

// Holders is each shard's holder as last read ("" while free): where a
// collector of another replica's shard is redirected.
func (c *Coordinator) Holders() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.holders)
}

func (c *Coordinator) labels(kind string) map[string]string {
	return map[string]string{LabelSet: c.cfg.Prefix, LabelKind: kind}
}

func (c *Coordinator) round(ctx context.Context) {
	if ctx.Err() != nil {
		return
	}
	wrote, err := c.renewMembership(ctx)
	if err != nil {
		// Nothing new is taken or given up blind; held shards keep
		// renewing (or stop, on their own deadline).
		c.cfg.Log.Warn("cannot renew this replica's membership Lease; deciding nothing until it can", zap.String("lease", c.memberLease()), zap.Error(err))
		return
	}
	// The Leases as the watch has them, if it is current: it shows our
	// membership as written a round ago. A watch behind would show every
	// other replica's Leases unrenewed, ageing on our clock as if expired.
	prev := c.wrote
	c.wrote = wrote
	mine, err := c.leases.Get(c.memberLease())
	if !prev.IsZero() && (err != nil || mine.Spec.RenewTime == nil || mine.Spec.RenewTime.Time.Before(prev.Truncate(time.Microsecond))) {
		c.cfg.Log.Info("the Lease watch is behind (it does not show this replica's last membership renewal); deciding nothing this round", zap.Error(err))
		return
	}
	cached, err := c.leases.List(labels.Everything())
	if err != nil {
		c.cfg.Log.Warn("cannot read the shard Leases", zap.Error(err))
		return
	}
	leases := make([]coordinationv1.Lease, 0, len(cached))
	for _, l := range cached {
		leases = append(leases, *l.DeepCopy())
	}
	takeover := c.decide(ctx, leases)
	// A shard whose holder stopped renewing is taken here, on our own
	// observation of its expiry, by an update conditional on the Lease
	// being unchanged since it was read (its resourceVersion): client-go's
	// elector, new to the Lease, would otherwise wait a whole Lease
	// duration more before believing it expired. It then finds the Lease
	// naming us and leads at once.
	var won []int
	for _, l := range takeover {
		now := metav1.NewMicroTime(time.Now())
		prev := ptr.Deref(l.Spec.HolderIdentity, "")
		l.Spec.HolderIdentity = ptr.To(c.cfg.Identity)
		l.Spec.LeaseDurationSeconds = ptr.To(int32(c.cfg.LeaseDuration / time.Second))
		l.Spec.AcquireTime, l.Spec.RenewTime = &now, &now
		l.Spec.LeaseTransitions = ptr.To(ptr.Deref(l.Spec.LeaseTransitions, 0) + 1)
		if _, err := c.cfg.Client.CoordinationV1().Leases(c.cfg.Namespace).Update(ctx, &l, metav1.UpdateOptions{}); err != nil {
			c.cfg.Log.Info("an expired shard Lease changed before it could be taken over", zap.String("lease", l.Name), zap.Error(err))
			continue
		}
		c.cfg.Log.Info("took over a shard whose holder stopped renewing", zap.String("lease", l.Name), zap.String("holder", prev))
		k, _ := strconv.Atoi(l.Labels[LabelShard])
		won = append(won, k)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range won {
		if c.campaigns[k] == nil && ctx.Err() == nil {
			c.campaigns[k] = c.campaign(ctx, k)
		}
	}
}

// decide reads the Leases into the members and each shard's holder,
// gives up and campaigns as Decide says, and returns the expired Leases of
// shards to take over.
func (c *Coordinator) decide(ctx context.Context, leases []coordinationv1.Lease) (takeover []coordinationv1.Lease) {
	now := time.Now()
	members := []string{c.cfg.Identity}
	holders := make([]string, c.cfg.Shards)
	expired := map[int]coordinationv1.Lease{}
	c.mu.Lock()
	defer c.mu.Unlock()
	seen := map[string]observed{}
	for _, l := range leases {
		o := observed{holder: ptr.Deref(l.Spec.HolderIdentity, ""), duration: time.Duration(ptr.Deref(l.Spec.LeaseDurationSeconds, 0)) * time.Second, at: now}
		if l.Spec.RenewTime != nil {
			o.renew = l.Spec.RenewTime.Time
		}
		if prev, ok := c.seen[l.Name]; ok && prev.holder == o.holder && prev.renew.Equal(o.renew) {
			o.at = prev.at // not renewed since: it ages on our clock
		} else if !ok && l.Labels[LabelKind] == "member" && o.renew.Before(now) {
			// A membership first seen ages from when its writer renewed
			// it: a replica that starts after another crashed does not
			// count the dead one for a whole Lease duration (and take too
			// small a share). Membership only sizes the shares; which
			// shard Lease is free stays judged on our own clock.
			o.at = o.renew
		}
		seen[l.Name] = o
		k, err := strconv.Atoi(l.Labels[LabelShard])
		isShard := l.Labels[LabelKind] == "shard" && err == nil && k >= 0 && k < c.cfg.Shards && l.Name == c.ShardLease(k)
		if o.holder == "" || now.Sub(o.at) >= o.duration {
			if isShard && o.holder != "" && o.holder != c.cfg.Identity {
				expired[k] = l
			}
			continue // free, or expired as we see it
		}
		switch {
		case l.Labels[LabelKind] == "member":
			members = append(members, o.holder)
		case isShard:
			holders[k] = o.holder
		}
	}
	c.seen = seen
	slices.Sort(members)
	members = slices.Compact(members)
	// Ours as we know them: a Lease naming us that no campaign of ours
	// leads (left by an earlier run with our identity) is one to take
	// back, which client-go does at once.
	for k, h := range holders {
		if cp := c.campaigns[k]; cp != nil && cp.leading.Load() {
			holders[k] = c.cfg.Identity
		} else if h == c.cfg.Identity {
			holders[k] = ""
		}
	}
	c.holders = holders
	if c.rounds++; c.rounds == 1 {
		// Replicas starting together first see each other's membership
		// (written this round), so that none campaigns for every shard
		// believing it is alone.
		return
	}
	acquire, release := Decide(c.cfg.Identity, members, holders)
	for _, k := range release {
		if cp := c.campaigns[k]; cp != nil {
			c.cfg.Log.Info("giving up a shard to balance the replicas", zap.Int("shard", k), zap.Int("members", len(members)))
			cp.cancel()
			delete(c.campaigns, k)
		}
	}
	for k, cp := range c.campaigns {
		if !cp.leading.Load() && holders[k] != "" && holders[k] != c.cfg.Identity {
			c.cfg.Log.Debug("another replica holds the shard campaigned for", zap.Int("shard", k), zap.String("holder", holders[k]))
			cp.cancel()
			delete(c.campaigns, k)
		}
	}
	for _, k := range acquire {
		if l, ok := expired[k]; ok && c.campaigns[k] == nil {
			takeover = append(takeover, l)
		} else if c.campaigns[k] == nil {
			c.campaigns[k] = c.campaign(ctx, k)
		}
	}
	return takeover
}

// campaign runs client-go's leader election on shard k's Lease until it
// is cancelled or the Lease is lost.
func (c *Coordinator) campaign(ctx context.Context, k int) *campaign {
	c.cfg.Log.Debug("campaigning for a shard", zap.Int("shard", k))
	ctx, cancel := context.WithCancel(ctx)
	cp := &campaign{cancel: cancel}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: c.cfg.Namespace, Name: c.ShardLease(k)},
		Client:     c.cfg.Client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: c.cfg.Identity},
		Labels:     map[string]string{LabelSet: c.cfg.Prefix, LabelKind: "shard", LabelShard: strconv.Itoa(k)},
	}
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   c.cfg.LeaseDuration,
		RenewDeadline:   c.cfg.RenewDeadline,
		RetryPeriod:     c.cfg.RetryPeriod,
		ReleaseOnCancel: !c.keep,
		Name:            lock.LeaseMeta.Name,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(ctx context.Context) {
				cp.leading.Store(true)
				c.cfg.Log.Info("holding a shard", zap.Int("shard", k))
				c.cfg.OnShard(ctx, k)
			},
			OnStoppedLeading: func() {
				if cp.leading.Swap(false) {
					c.cfg.Log.Info("no longer holding a shard", zap.Int("shard", k))
				}
				cancel()
			},
		},
	})
	if err != nil { // the configuration was checked in New
		panic(err)
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		le.Run(ctx)
		c.mu.Lock()
		if c.campaigns[k] == cp {
			delete(c.campaigns, k)
		}
		c.mu.Unlock()
	}()
	return cp
}

// renewMembership writes this replica's membership Lease, updating the
// copy the watch holds (a Get only when that is missing or out of date),
// and says the renew time written.
func (c *Coordinator) renewMembership(ctx context.Context) (time.Time, error) {
	leases := c.cfg.Client.CoordinationV1().Leases(c.cfg.Namespace)
	now := metav1.NewMicroTime(time.Now())
	spec := coordinationv1.LeaseSpec{HolderIdentity: ptr.To(c.cfg.Identity), LeaseDurationSeconds: ptr.To(int32(c.cfg.LeaseDuration / time.Second)), RenewTime: &now}
	update := func(l *coordinationv1.Lease) error {
		l = l.DeepCopy()
		l.Spec = spec
		_, err := leases.Update(ctx, l, metav1.UpdateOptions{})
		return err
	}
	if l, err := c.leases.Get(c.memberLease()); err == nil && update(l) == nil {
		return now.Time, nil
	}
	l, err := leases.Get(ctx, c.memberLease(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err = leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: c.memberLease(), Labels: c.labels("member")}, Spec: spec}, metav1.CreateOptions{})
		return now.Time, err
	}
	if err != nil {
		return time.Time{}, err
	}
	return now.Time, update(l)
}

// stop ends every campaign (releasing held Leases unless keep) and, on a
// clean stop, the membership.
func (c *Coordinator) stop() {
	c.mu.Lock()
	for k, cp := range c.campaigns {
		cp.cancel()
		delete(c.campaigns, k)
	}
	c.mu.Unlock()
	c.wg.Wait() // each releases its Lease (within the renew deadline)
	if c.keep {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.RenewDeadline)
	defer cancel()
	err := c.cfg.Client.CoordinationV1().Leases(c.cfg.Namespace).Delete(ctx, c.memberLease(), metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		c.cfg.Log.Warn("cannot delete this replica's membership Lease; it expires", zap.Error(err))
	}
}
