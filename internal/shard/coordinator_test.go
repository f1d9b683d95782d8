package shard

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
)

// A replica whose Lease watch has stopped delivering sees every other
// replica's Leases unrenewed, ageing as if expired. It must decide
// nothing then: here another replica holds the only shard and renews it
// all along, and the one with the silent watch never takes it. With the
// watch delivering, the same replica takes the shard once its holder
// stops renewing (the test can fail).
func TestNothingDecidedOnALeaseWatchBehind(t *testing.T) {
	for _, frozen := range []bool{true, false} {
		name := map[bool]string{true: "watch silent, holder alive", false: "watch delivering, holder dead"}[frozen]
		t.Run(name, func(t *testing.T) {
			const ns, prefix = "ns", "p"
			now := metav1.NewMicroTime(time.Now())
			shardLease := &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: prefix + "-shard-0", Labels: map[string]string{LabelSet: prefix, LabelKind: "shard", LabelShard: "0"}},
				Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To("other:1"), LeaseDurationSeconds: ptr.To(int32(1)), RenewTime: &now, AcquireTime: &now},
			}
			client := fake.NewClientset(shardLease)
			if frozen {
				client.PrependWatchReactor("leases", func(k8stesting.Action) (bool, watch.Interface, error) {
					return true, watch.NewFake(), nil // a watch that never says anything
				})
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if frozen {
				// The holder renews every 200 ms, which only the API sees.
				go func() {
					for ctx.Err() == nil {
						l, err := client.CoordinationV1().Leases(ns).Get(ctx, shardLease.Name, metav1.GetOptions{})
						if err == nil && ptr.Deref(l.Spec.HolderIdentity, "") == "other:1" {
							l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(time.Now()))
							client.CoordinationV1().Leases(ns).Update(ctx, l, metav1.UpdateOptions{})
						}
						time.Sleep(200 * time.Millisecond)
					}
				}()
			}
			c, err := New(Config{Client: client, Namespace: ns, Prefix: prefix, Identity: "me:1", Shards: 1,
				LeaseDuration: time.Second, RenewDeadline: 800 * time.Millisecond, RetryPeriod: 100 * time.Millisecond, Log: zaptest.NewLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			c.keep = true
			done := make(chan struct{})
			go func() { c.Run(ctx); close(done) }()
			deadline := time.Now().Add(4 * time.Second)
			for time.Now().Before(deadline) && len(c.Held()) == 0 {
				time.Sleep(50 * time.Millisecond)
			}
			held := c.Held()
			cancel()
			<-done
			l, err := client.CoordinationV1().Leases(ns).Get(context.Background(), shardLease.Name, metav1.GetOptions{})
			if err != nil {
				t.Fatal(err)
			}
			holder := ptr.Deref(l.Spec.HolderIdentity, "")
			switch {
			case frozen && (len(held) > 0 || holder != "other:1"):
				t.Errorf("with its Lease watch silent the replica took the shard of a live holder: held %v, the Lease names %q", held, holder)
			case !frozen && (len(held) != 1 || holder != "me:1"):
				t.Errorf("with the watch delivering, the shard of a dead holder was not taken in 4 s (four Lease durations): held %v, the Lease names %q", held, holder)
			}
		})
	}
}
