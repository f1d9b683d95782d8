package aggregator

import (
	"net/http"

	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
)

// Shards makes a replica one of several that share the fleet (issue #41):
// a node's stream is taken, and the node judged, by the replica holding
// its shard (HoldShard, run by the shard coordinator), and the leader
// (the fleet Lease) only concludes: it reads every holder's partial
// verdict, applies the mass-divergence guard over all of them, and alone
// remediates, pages, writes reports and serves the findings.
type Shards struct {
	// Count is the number of shards, fixed for the fleet's life (every
	// replica must agree: a node's shard is shard.Of(node, Count)).
	Count int
	// Holders says who holds each shard as last read, "" for a free one
	// (the coordinator's Holders).
	Holders func() []string
	// Port is the port every replica serves its internal API on
	// (InternalHandler): the leader reads the partials there. TLS: over
	// TLS (Client verifies the replicas' certificate), else plain HTTP
	// (--insecure-no-auth, tests).
	Port string
	TLS  bool
	// Client makes this replica's requests to the others, carrying its
	// peers token (auth.NewPeerClient); nil: http.DefaultClient.
	Client *http.Client
	// Auth, when set, admits the internal API's callers: the other
	// replicas. Nil: anyone who reaches the port (--insecure-no-auth).
	Auth *auth.PeerAuth
}

// shardCount is the fleet's number of shards: 0 when not sharded.
func shardCount(s *Shards) int {
	if s == nil {
		return 0
	}
	return max(s.Count, 1)
}
