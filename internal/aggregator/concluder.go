// The leader's conclusion over the shards' partial verdicts.

package aggregator

import (
	"slices"
	"time"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/shard"
)

// concluder makes the fleet's verdict of the holders' partial verdicts,
// and remembers between them which nodes its verdicts held, so that a
// node that left the fleet is forgotten once, when its shard is heard
// without it. Evaluate's goroutine alone uses it.
type concluder struct {
	policy audit.Policy
	shards int
	// concluded are the nodes of the verdicts made: those of the last
	// one, and those of shards unheard since.
	concluded map[string]bool
}

// conclude makes the verdict of parts (the holders heard) as of now, with
// drift held back while recovering, and returns besides the nodes that
// departed: held by an earlier verdict, in none since, and their shard
// heard (not among unheard), to be forgotten by the repairs.
func (c *concluder) conclude(now time.Time, parts []audit.Partial, unheard []int, recovering bool) (audit.Verdict, []string) {
	v := audit.Conclude(c.policy, parts...)
	v.At = now
	if recovering {
		v = holdBackDrift(v)
	}
	next := make(map[string]bool, len(v.Nodes))
	for _, n := range v.Nodes {
		next[n.Node] = true
	}
	var departed []string
	for n := range c.concluded {
		switch {
		case next[n]:
		case slices.Contains(unheard, shard.Of(n, c.shards)):
			next[n] = true // its shard's holder did not answer: kept
		default:
			departed = append(departed, n)
		}
	}
	c.concluded = next
	slices.Sort(departed)
	return v, departed
}
