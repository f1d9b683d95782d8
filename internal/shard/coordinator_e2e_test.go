package shard

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/proxyaudit/proxyaudit/internal/localcluster"
)

func TestMain(m *testing.M) { localcluster.Main(m) }

// owners counts, per shard, the replicas whose OnShard runs now: the
// replicas' own belief, which must never be two for one shard.
type owners struct {
	mu      sync.Mutex
	now     map[int]map[string]bool
	doubled []string
}

func (o *owners) run(id string) func(context.Context, int) {
	return func(ctx context.Context, k int) {
		o.mu.Lock()
		if o.now[k] == nil {
			o.now[k] = map[string]bool{}
		}
		for other := range o.now[k] {
			o.doubled = append(o.doubled, fmt.Sprintf("shard %d: %s took it while %s held it", k, id, other))
		}
		o.now[k][id] = true
		o.mu.Unlock()
		<-ctx.Done()
		o.mu.Lock()
		delete(o.now[k], id)
		o.mu.Unlock()
	}
}

// byOwner is shard → the one replica holding it, as the replicas believe
// ("" when none; "!" when several).
func (o *owners) byShard(shards int) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]string, shards)
	for k := range shards {
		switch ids := slices.Collect(maps.Keys(o.now[k])); len(ids) {
		case 0:
		case 1:
			out[k] = ids[0]
		default:
			out[k] = "!"
		}
	}
	return out
}

// Replicas sharing shards through Leases on the real API server: balanced
// with none held twice; a replica that crashes (its Leases left to
// expire) loses only its shards, taken over once they expire; two more
// replicas take only their share, from those above it.
func TestE2EShardLeases(t *testing.T) {
	c := localcluster.Shared(t)
	ctx := context.Background()
	const ns, shards = "shard-e2e", 8
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	o := &owners{now: map[int]map[string]bool{}}
	type replica struct {
		c      *Coordinator
		cancel context.CancelFunc
		done   chan struct{}
	}
	replicas := map[string]*replica{}
	// start runs a replica; one that will crash keeps its Leases when it
	// stops (client-go's release on cancel is fixed when a campaign
	// starts), as a killed process does.
	start := func(id string, crashes bool) {
		co, err := New(Config{Client: c.Client, Namespace: ns, Prefix: "proxyaudit", Identity: id, Shards: shards,
			LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 500 * time.Millisecond, OnShard: o.run(id), Log: zaptest.NewLogger(t).With(zap.String("replica", id))})
		if err != nil {
			t.Fatal(err)
		}
		co.keep = crashes
		rctx, cancel := context.WithCancel(ctx)
		r := &replica{c: co, cancel: cancel, done: make(chan struct{})}
		go func() { co.Run(rctx); close(r.done) }()
		replicas[id] = r
	}
	stop := func(id string) {
		r := replicas[id]
		r.cancel()
		<-r.done
		delete(replicas, id)
	}
	t.Cleanup(func() {
		for id := range replicas {
			stop(id)
		}
	})
	// The shards as the API server holds them: each shard Lease's holder.
	leases := func() []string {
		out := make([]string, shards)
		list, err := c.Client.CoordinationV1().Leases(ns).List(ctx, metav1.ListOptions{LabelSelector: LabelKind + "=shard"})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range list.Items {
			for k := range shards {
				if l.Name == fmt.Sprintf("proxyaudit-shard-%d", k) {
					out[k] = ptr.Deref(l.Spec.HolderIdentity, "")
				}
			}
		}
		return out
	}
	// balanced waits until the replicas' beliefs, the Leases and each
	// replica's Held agree, every shard held, each replica its quota.
	balanced := func(what string, d time.Duration) []string {
		t.Helper()
		began := time.Now()
		var ids []string
		for id := range replicas {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		var believed, held []string
		for time.Since(began) < d {
			believed, held = o.byShard(shards), leases()
			ok := slices.Equal(believed, held) && !slices.Contains(held, "")
			for _, id := range ids {
				mine := []int{}
				for k, h := range held {
					if h == id {
						mine = append(mine, k)
					}
				}
				ok = ok && len(mine) == Quota(ids, id, shards) && slices.Equal(replicas[id].c.Held(), mine)
			}
			if ok {
				t.Logf("%s: balanced after %s: %v", what, time.Since(began).Round(100*time.Millisecond), held)
				return held
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("%s: not balanced after %s: the replicas believe %v, the Leases say %v", what, d, believed, held)
		return nil
	}
	moved := func(before, after []string) (n int, to map[string]int) {
		to = map[string]int{}
		for k := range before {
			if before[k] != after[k] {
				n++
				to[before[k]+"→"+after[k]]++
			}
		}
		return n, to
	}

	crashed := "198.18.1.2:9443"
	for _, id := range []string{"198.18.1.1:9443", "198.18.1.2:9443", "198.18.1.3:9443"} {
		start(id, id == crashed)
	}
	first := balanced("three replicas started together", 30*time.Second)

	// A crash: its Leases stay until they expire (4 s); only its shards
	// move.
	had := Quota([]string{"198.18.1.1:9443", "198.18.1.2:9443", "198.18.1.3:9443"}, crashed, shards)
	began := time.Now()
	stop(crashed)
	after := balanced("a replica crashed", 30*time.Second)
	if n, to := moved(first, after); n != had {
		t.Errorf("the crash of a replica holding %d shards moved %d: %v", had, n, to)
	}
	t.Logf("its %d shards taken over %s after the crash (Lease duration 4 s)", had, time.Since(began).Round(100*time.Millisecond))

	// Scale-up to four: the newcomers take their quota from those above
	// theirs, nothing moves between the old ones.
	before := after
	start("198.18.1.4:9443", false)
	start("198.18.1.5:9443", false)
	after = balanced("scaled from 2 to 4 replicas", 30*time.Second)
	n, to := moved(before, after)
	for move := range to {
		if !strings.HasSuffix(move, "→198.18.1.4:9443") && !strings.HasSuffix(move, "→198.18.1.5:9443") {
			t.Errorf("on scale-up a shard moved between old replicas: %v", to)
		}
	}
	t.Logf("scale-up moved %d shards: %v", n, to)

	// A clean stop releases at once: its shards are taken within a round
	// or two, not after the Lease duration.
	began = time.Now()
	stop("198.18.1.4:9443")
	balanced("a replica stopped cleanly", 30*time.Second)
	if took := time.Since(began); took > 4*time.Second {
		t.Errorf("a released shard took %s to be taken over, longer than the Lease duration", took)
	}

	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.doubled) > 0 {
		t.Errorf("a shard held by two replicas at once:\n  %s", strings.Join(o.doubled, "\n  "))
	}
}
