package shard

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestOfIsStableAndBalanced(t *testing.T) {
	const nodes = 100_000
	for _, n := range []int{1, 4, 16, 64} {
		count := make([]int, n)
		for i := range nodes {
			s := Of(fmt.Sprintf("ip-10-0-%d-%d.ec2.internal", i/256, i%256), n)
			if s < 0 || s >= n {
				t.Fatalf("Of(…, %d) = %d", n, s)
			}
			count[s]++
		}
		lo, hi, want := slices.Min(count), slices.Max(count), nodes/n
		if float64(want-lo) > 0.1*float64(want) || float64(hi-want) > 0.1*float64(want) {
			t.Errorf("%d shards: sizes %d..%d for %d nodes, want each within 10%% of %d", n, lo, hi, nodes, want)
		}
	}
}

// The shard of a node is pinned: replicas of two versions side by side in
// a rolling update must agree, and an upgrade must not move every node.
func TestOfIsPinned(t *testing.T) {
	for _, c := range []struct {
		node       string
		of16, of64 int
	}{
		{"node-a", 5, 20},
		{"ip-10-0-1-17.ec2.internal", 7, 7},
		{"gke-prod-pool-1-abcd", 4, 4},
		{"aks-nodepool1-12345678-vmss000003", 8, 57},
	} {
		if a, b := Of(c.node, 16), Of(c.node, 64); a != c.of16 || b != c.of64 {
			t.Errorf("%s: shard %d of 16 and %d of 64, pinned at %d and %d", c.node, a, b, c.of16, c.of64)
		}
	}
}

// Growing the shard count moves only the nodes that land in the new
// shard.
func TestOfMovesOnlyToTheNewShard(t *testing.T) {
	moved := 0
	for i := range 20_000 {
		node := fmt.Sprintf("node-%d", i)
		a, b := Of(node, 15), Of(node, 16)
		if a != b {
			moved++
			if b != 15 {
				t.Fatalf("%s moved from shard %d to %d on growing to 16 shards", node, a, b)
			}
		}
	}
	if moved < 20_000/16*9/10 || moved > 20_000/16*11/10 {
		t.Errorf("%d of 20000 nodes moved to the new 16th shard, want about %d", moved, 20_000/16)
	}
}

func TestQuotasSumToTheShards(t *testing.T) {
	for m := 1; m <= 17; m++ {
		members := names(m)
		for s := range 70 {
			sum, lo, hi := 0, s, 0
			for _, me := range members {
				q := Quota(members, me, s)
				sum += q
				lo, hi = min(lo, q), max(hi, q)
			}
			if sum != s || hi-lo > 1 {
				t.Fatalf("%d members, %d shards: quotas sum to %d, %d..%d", m, s, sum, lo, hi)
			}
		}
	}
	if Quota(names(3), "stranger", 9) != 0 {
		t.Error("a replica that is not a member has a quota")
	}
}

// sim is a set of shard Leases as the API server keeps them: one holder,
// renewed; a campaign wins only a Lease that is free or expired when it
// writes (the resourceVersion check). Replicas decide on what they read at
// the start of a round, so they act on stale reads as real ones do.
type sim struct {
	now      int
	duration int // rounds a Lease lives without renewal
	holder   []string
	renewed  []int
	member   map[string]int // member Lease renewals
	alive    map[string]bool
	rng      *rand.Rand
	handover int // changes of a shard's holder from one replica to another
	last     []string
}

func newSim(rng *rand.Rand, shards int, pool []string) *sim {
	s := &sim{duration: 8, holder: make([]string, shards), renewed: make([]int, shards), member: map[string]int{}, alive: map[string]bool{}, rng: rng, last: make([]string, shards)}
	// Any state: holders alive or dead, Leases fresh or old.
	for i := range shards {
		if rng.IntN(4) > 0 {
			s.holder[i] = pool[rng.IntN(len(pool))]
		}
		s.renewed[i] = -rng.IntN(2 * s.duration)
		s.last[i] = s.holder[i]
	}
	for _, r := range pool {
		s.alive[r] = rng.IntN(2) == 0
		s.member[r] = -rng.IntN(2 * s.duration)
	}
	return s
}

func (s *sim) live(renewed int) bool { return s.now-renewed < s.duration }

// view is what a replica reads: members whose Lease is live, each
// shard's live holder.
func (s *sim) view() (members, holders []string) {
	for r, at := range s.member {
		if s.live(at) {
			members = append(members, r)
		}
	}
	slices.Sort(members)
	holders = make([]string, len(s.holder))
	for i, h := range s.holder {
		if s.live(s.renewed[i]) {
			holders[i] = h
		}
	}
	return members, holders
}

// round: every live replica renews its membership and its shards, reads,
// decides, and acts, in a random order.
func (s *sim) round() {
	s.now++
	var order []string
	for r, ok := range s.alive {
		if ok {
			order = append(order, r)
			s.member[r] = s.now
		}
	}
	slices.Sort(order)
	s.rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	for i, h := range s.holder {
		if s.alive[h] && s.live(s.renewed[i]) {
			s.renewed[i] = s.now
		}
	}
	members, holders := s.view()
	type act struct {
		r                string
		acquire, release []int
	}
	var acts []act
	for _, r := range order {
		if !slices.Contains(members, r) {
			members = append(members, r) // a replica counts itself
			slices.Sort(members)
		}
		a, rel := Decide(r, members, holders)
		acts = append(acts, act{r, a, rel})
	}
	for _, a := range acts {
		for _, i := range a.release {
			if s.holder[i] == a.r {
				s.holder[i], s.renewed[i] = "", -1<<30
			}
		}
		for _, i := range a.acquire {
			if s.holder[i] == "" || !s.live(s.renewed[i]) {
				s.holder[i], s.renewed[i] = a.r, s.now
			}
		}
	}
	for i, h := range s.holder {
		if s.live(s.renewed[i]) && h != "" {
			if s.last[i] != "" && s.last[i] != h {
				s.handover++
			}
			s.last[i] = h
		}
	}
}

// settled: every shard held by exactly one live replica, each holding its
// quota.
func (s *sim) settled() error {
	var alive []string
	for r, ok := range s.alive {
		if ok {
			alive = append(alive, r)
		}
	}
	slices.Sort(alive)
	held := map[string]int{}
	for i, h := range s.holder {
		if h == "" || !s.alive[h] || !s.live(s.renewed[i]) {
			return fmt.Errorf("shard %d: holder %q (alive %v, renewed at %d, now %d)", i, h, s.alive[h], s.renewed[i], s.now)
		}
		held[h]++
	}
	for _, r := range alive {
		if q := Quota(alive, r, len(s.holder)); held[r] != q {
			return fmt.Errorf("%s holds %d shards, its quota is %d (holders %v)", r, held[r], q, s.holder)
		}
	}
	return nil
}

func (s *sim) settle(t *testing.T, seed uint64) {
	t.Helper()
	// Dead holders' Leases expire within a Lease duration; then a
	// round per shard at most.
	for range 2*s.duration + len(s.holder) + 4 {
		s.round()
	}
	if err := s.settled(); err != nil {
		t.Fatalf("seed %d: not settled: %v", seed, err)
	}
}

func names(n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("10.0.0.%d:9443", i+1))
	}
	slices.Sort(out) // as members are given
	return out
}

// From any state of the Leases and any replicas coming and going, once the
// replicas stay the same and the dead ones' Leases have expired, each
// shard has exactly one holder, a live replica, and each replica holds
// its quota; then nothing moves.
func TestConverges(t *testing.T) {
	for seed := range uint64(500) {
		rng := rand.New(rand.NewPCG(seed, 41))
		pool := names(1 + rng.IntN(16))
		s := newSim(rng, 1+rng.IntN(64), pool)
		for range rng.IntN(40) {
			r := pool[rng.IntN(len(pool))]
			s.alive[r] = !s.alive[r]
			s.round()
		}
		if !slices.ContainsFunc(pool, func(r string) bool { return s.alive[r] }) {
			s.alive[pool[0]] = true
		}
		s.settle(t, seed)
		before := s.handover
		for range 3 * s.duration {
			s.round()
		}
		if s.handover != before {
			t.Fatalf("seed %d: %d shards changed hands after settling", seed, s.handover-before)
		}
	}
}

// Losing a replica moves only its shards; adding one moves only what it
// takes (its quota), from replicas above their new quota.
func TestMovesOnlyWhatMust(t *testing.T) {
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 7))
		pool := names(2 + rng.IntN(15))
		s := newSim(rng, 1+rng.IntN(64), pool)
		for _, r := range pool {
			s.alive[r] = true
		}
		s.settle(t, seed)

		victim := pool[rng.IntN(len(pool))]
		had := 0
		for _, h := range s.holder {
			if h == victim {
				had++
			}
		}
		before := s.handover
		s.alive[victim] = false
		s.settle(t, seed)
		if moved := s.handover - before; moved != had {
			t.Fatalf("seed %d: losing %s (%d shards) moved %d", seed, victim, had, moved)
		}

		before = s.handover
		s.alive[victim] = true
		s.settle(t, seed)
		if moved, q := s.handover-before, Quota(pool, victim, len(s.holder)); moved != q {
			t.Fatalf("seed %d: %s back (quota %d) moved %d shards", seed, victim, q, moved)
		}
	}
}

func TestDecide(t *testing.T) {
	m := []string{"a", "b", "c"}
	for _, c := range []struct {
		me               string
		holders          []string
		acquire, release []int
	}{
		// A start: each begins at a different free shard.
		{"a", []string{"", "", "", "", "", "", ""}, []int{0, 3, 6}, nil},
		{"b", []string{"", "", "", "", "", "", ""}, []int{1, 4}, nil},
		{"c", []string{"", "", "", "", "", "", ""}, []int{2, 5}, nil},
		// Never contends for a held shard.
		{"c", []string{"a", "a", "a", "b", "b", "b", "a"}, nil, nil},
		// Above quota: gives up the highest, once nothing is free.
		{"a", []string{"a", "a", "a", "b", "b", "a", ""}, nil, nil},
		{"a", []string{"a", "a", "a", "b", "b", "a", "c"}, nil, []int{5}},
		// A holder that is not a member (its Lease not yet expired) is
		// left alone.
		{"b", []string{"x", "x", "x", "x", "x", "x", "x"}, nil, nil},
	} {
		a, r := Decide(c.me, m, c.holders)
		if !slices.Equal(a, c.acquire) || !slices.Equal(r, c.release) {
			t.Errorf("Decide(%s, %v) = acquire %v release %v, want %v %v", c.me, c.holders, a, r, c.acquire, c.release)
		}
	}
}
