package stream

import (
	"encoding/hex"
	"slices"
)

// Sent is what one report moved the other end from and to, kept by the
// sender to answer the wants that follow it.
type Sent struct {
	Seq        uint64
	Prev, Next State
}

// Reply answers a want from the recent reports' states: the names of the
// buckets a report changed, the frontends it changed in the buckets
// asked (by hash, exactly: chain names included), and frontends by hash.
// What is no longer there is left out; the aggregator then asks for a
// full snapshot.
func Reply(w *Want, recent []Sent) *Content {
	ct := &Content{Frontends: []Frontend{}}
	var sent *Sent
	for i := range recent {
		if recent[i].Seq == w.Seq {
			sent = &recent[i]
		}
	}
	if sent != nil && w.Buckets {
		ct.Buckets = encodeBuckets(&sent.Prev, &sent.Next)
	}
	if sent != nil && len(w.Delta) > 0 {
		for _, i := range w.Delta {
			if i < 0 || i >= nBuckets {
				continue
			}
			merge(sent.Prev.buckets[i], sent.Next.buckets[i], func(p, n *entry) {
				switch {
				case n == nil:
					ct.Removed = append(ct.Removed, p.Key)
				case p == nil || p.sum != n.sum:
					ct.Refs = append(ct.Refs, Ref{Key: n.Key, Sum: hex.EncodeToString(n.sum[:])})
				}
			})
		}
	}
	if len(w.Sums) > 0 {
		states := make([]State, len(recent))
		for i := range recent {
			states[i] = recent[i].Next
		}
		ct.Frontends = findSums(w.Sums, states).Frontends
	}
	return ct
}

// Find returns the frontends of the state whose content hashes are among
// sums, by hash, in one walk: the collector answers a Want from what it
// last sent.
func (s *State) Find(sums []string) map[string]Frontend {
	want := make(map[[sumLen]byte]string, len(sums))
	for _, sum := range sums {
		if b, ok := parseSum(sum); ok {
			want[b] = sum
		}
	}
	out := map[string]Frontend{}
	for _, b := range s.buckets {
		if b == nil || len(out) == len(want) {
			continue
		}
		for _, e := range b.entries {
			if sum, ok := want[e.sum]; ok {
				out[sum] = e.Frontend
			}
		}
	}
	return out
}

// findSums finds the frontends with the wanted hashes in the states recent
// reports sent, newest first; one no longer there is left out and the
// aggregator asks for a full snapshot.
func findSums(sums []string, recent []State) *Content {
	ct := &Content{Frontends: []Frontend{}}
	left := slices.Clone(sums)
	for i := len(recent) - 1; i >= 0 && len(left) > 0; i-- {
		found := recent[i].Find(left)
		left = slices.DeleteFunc(left, func(sum string) bool {
			f, ok := found[sum]
			if ok {
				ct.Frontends = append(ct.Frontends, f)
			}
			return ok
		})
	}
	return ct
}
