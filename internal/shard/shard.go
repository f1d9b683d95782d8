// Package shard splits the fleet's nodes among aggregator replicas (issue
// #41). A node belongs to a shard by a stable hash of its name; a shard
// belongs to the replica holding its coordination.k8s.io Lease. This file
// is the pure part: which shard a node is in, each replica's fair share,
// and what a replica should take or give up given what it reads of the
// Leases. coordinator.go holds the Leases with client-go's leader election.
package shard

import (
	"hash/fnv"
	"slices"
)

// Of returns the shard of node among n shards (0 ≤ Of < n; 0 when n < 2):
// Lamping and Veach's jump consistent hash of the name's FNV-1a, the same
// on every replica and across restarts. Growing n to n+1 moves only the
// nodes that land in the new shard (1/(n+1) of them), none between the old
// ones.
func Of(node string, n int) int {
	if n < 2 {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(node))
	key := h.Sum64()
	b, j := int64(-1), int64(0)
	for j < int64(n) {
		b = j
		key = key*2862933555777941757 + 1
		j = int64(float64(b+1) * (float64(int64(1)<<31) / float64((key>>33)+1)))
	}
	return int(b)
}

// Quota is member's fair share of shards among members (sorted, distinct;
// member among them): shards/len(members), one more for the first
// shards%len(members). The quotas of all members sum to shards, so when
// every member holds exactly its quota no shard is left over. 0 when
// member is not a member.
func Quota(members []string, member string, shards int) int {
	i, ok := slices.BinarySearch(members, member)
	if !ok || len(members) == 0 {
		return 0
	}
	q := shards / len(members)
	if i < shards%len(members) {
		q++
	}
	return q
}

// Decide says what replica me should do this round: the shards to
// campaign for and the shards to give up. members are the live replicas,
// me among them; holders[s] is shard s's live holder ("" when its Lease is
// free or expired: the caller judges expiry as client-go does, by when it
// last saw the Lease renewed, on its own clock).
//
//   - Below its quota, a replica campaigns for free shards, the lowest
//     first, up to its quota. It never contends for a held shard: a shard
//     changes hands only when its holder lets it go or dies.
//   - Above its quota, a replica gives up its highest shards down to its
//     quota, but only while no shard is free: a shard is then never
//     without a holder for longer than the next round of a replica below
//     its quota (which exists: the quotas sum to the shard count).
//
// From any state of the Leases, once the members stay the same and every
// dead holder's Lease has expired, rounds reach every shard held by
// exactly one member and every member holding exactly its quota
// (TestConverges). The Lease itself (its resourceVersion) guarantees that
// two campaigns for one shard cannot both win.
func Decide(me string, members []string, holders []string) (acquire, release []int) {
	quota := Quota(members, me, len(holders))
	var mine, free []int
	for s, h := range holders {
		switch h {
		case me:
			mine = append(mine, s)
		case "":
			free = append(free, s)
		}
	}
	if len(mine) < quota {
		// Members below their quota at once (a start, a replica lost)
		// each begin at a different free shard, so that their campaigns
		// seldom meet on one Lease.
		i, _ := slices.BinarySearch(members, me)
		m := len(members)
		rank := func(s int) int { return ((s-i)%m + m) % m }
		slices.SortStableFunc(free, func(a, b int) int { return rank(a) - rank(b) })
		acquire = free[:min(len(free), quota-len(mine))]
		slices.Sort(acquire)
	}
	if len(mine) > quota && len(free) == 0 {
		release = mine[quota:]
	}
	return acquire, release
}
