// Package aggregator is proxyaudit's aggregator: it watches the API
// through one informer per kind, receives every node's rules from the
// collectors' streams, judges them with the audit core over time, and
// serves the verdict over HTTP. Only the leader judges and accepts
// streams; followers keep their informers warm and send collectors to the
// leader.
package aggregator

import (
	"context"
	"crypto/rand"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/audit"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/auth"
	"github.com/proxyaudit/proxyaudit/internal/aggregator/view"
	"github.com/proxyaudit/proxyaudit/internal/stream"
	"github.com/proxyaudit/proxyaudit/remediate"
)

// Config is what an aggregator needs besides its View.
type Config struct {
	Policy audit.Policy
	Auth   auth.Authenticator
	// Readers, when set, decides who may read the HTTP API's findings
	// (/api/); nil serves them to anyone who reaches the port.
	Readers *auth.ReaderAuth
	// Insecure marks Auth as accepting everyone: every connection is
	// logged with a warning.
	Insecure        bool
	MaxMessageBytes int
	// MaxUnauthenticated bounds the connections not yet past their hello
	// (4096), and MaxUnauthenticatedPerSource those from one address (64):
	// beyond them a connection is closed at once, before anything is read.
	MaxUnauthenticated, MaxUnauthenticatedPerSource int
	// Self is this replica's stream address as collectors reach it: the
	// leader-election identity, and what followers redirect to.
	Self string
	// Peers, when set (namespace/name), is the headless Service the
	// collectors resolve to find the aggregators: its endpoints' addresses
	// are sent to every collector (stream.Peers), which dials them when
	// the Service's name cannot be resolved.
	Peers   string
	Log     *zap.Logger
	Metrics *Metrics
	Clock   clock.WithTicker
	// Remediation, when set, plans and executes repairs after each
	// verdict (dry-run by default).
	Remediation *Remediation
	// Notifier, when set, hears about the aggregator itself (its view of
	// the API going stale and coming back).
	Notifier remediate.Notifier
	// RecoveryGrace: after the view comes back from stale (an API outage),
	// node drift is neither reported nor repaired for this long, since
	// every kube-proxy reconnects with client-go's backoff (up to 30 s,
	// jittered to 60 s). Default 60 s.
	RecoveryGrace time.Duration
	// DecodeBudget bounds the bytes of large reports (full snapshots)
	// decoded and applied at once; more wait. Default 64 MiB: about 20
	// snapshots at 100k endpoints, ~0.5 GiB decoded.
	DecodeBudget int
	// Reports, when set, is offered every verdict the leader publishes
	// (outside a recovery): the OpenReports writer.
	Reports interface {
		Offer(lead context.Context, v *audit.Verdict)
	}
	// Shards, when set, makes this replica one of several that share the
	// fleet's nodes (see Shards); nil: the leader takes every stream.
	Shards *Shards
}

// Aggregator holds every node's stream state and the judge.
//
// Its state is split by owner, each part with its own lock:
//
//   - mu, the fleet's (see fleet): the nodes and their streams' copies,
//     the judge, the last verdict, the shards held (streams, Evaluate,
//     the API's reads);
//   - lead (leadership): whether this replica leads, who does, the term;
//   - health (viewHealth): whether the view of the API is stale, and the
//     recovery after it (Evaluate writes, the API reads);
//   - remedy (remediationState): the storm's start and why repairs are
//     held (the remediation rounds write, the API reads); repair hands
//     verdicts to those rounds;
//   - warmup, unauth, flush and the decode budget guard themselves.
//
// Lock order: mu, then any one of the others. Leadership changes are made
// holding mu too (a new term begins with an empty fleet), so a stream's
// goroutine that holds mu sees leadership as it stands with the nodes.
// Every lock but mu is a leaf: nothing is locked while one is held, and
// no effect (a write, a notice, a call out) is made under any of them.
type Aggregator struct {
	cfg  Config
	view *view.View

	mu sync.Mutex
	// fleet: the nodes this replica judges, their judge and the last
	// verdict (a.mu).
	fleet  fleet
	lead   leadership
	health viewHealth
	remedy remediationState
	// pool shares identical frontends among the nodes' copies: a fleet
	// mostly programs the same rules.
	pool   *stream.Pool
	warmup warmup
	budget *decodeBudget
	unauth pendingGate
	// assessor assesses the nodes' rules (Evaluate's goroutine only).
	assessor assessor
	// journal records the remediation actions for the status page.
	journal *journal
	// flush pairs collectors' answers to flush requests with the waiting
	// requests.
	flush flushes
	// peersMsg: the replicas' addresses last sent to the collectors, for
	// new streams and followers' answers.
	peersMsg atomic.Pointer[stream.Message]
	// leaving: Farewell named the other replicas; the second's tick no
	// longer announces the informer's list (which may still hold this
	// replica and miss its successor).
	leaving atomic.Bool
	// own is this replica's last judgement of its shards' nodes, for the
	// leader itself; partials the same as the other replicas' leader
	// reads it (in changes); gathered the holders' partials as the leader
	// last read them (Evaluate's goroutine only).
	own           atomic.Pointer[PartialResponse]
	partials      *partialLog
	gathered      map[string]gathered
	unheardLogged time.Time
	// concluder makes the fleet's verdict of the shards' partial
	// verdicts (the leader, sharded; Evaluate's goroutine only).
	concluder concluder
	// testHookRegistered, when set, runs once a stream is registered and
	// before its welcome is written (tests widen that window with it).
	testHookRegistered atomic.Pointer[func()]
	// repair hands verdicts to the remediation rounds, which run beside
	// the evaluations (see handOff).
	repair struct {
		sync.Mutex
		next    *audit.Verdict // the newest verdict no round took yet
		running bool
	}
}

// New returns an aggregator over view. It leads only after StartedLeading
// (or at once when leader election is off: call StartedLeading yourself).
func New(cfg Config, view *view.View) *Aggregator {
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = stream.DefaultMaxMessageBytes
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	if cfg.Log == nil {
		cfg.Log = zap.NewNop()
	}
	if cfg.Metrics == nil {
		cfg.Metrics = NewMetrics()
	}
	if cfg.DecodeBudget <= 0 {
		cfg.DecodeBudget = 64 << 20
	}
	if cfg.MaxUnauthenticated <= 0 {
		cfg.MaxUnauthenticated = 4096
	}
	if cfg.MaxUnauthenticatedPerSource <= 0 {
		cfg.MaxUnauthenticatedPerSource = 64
	}
	if cfg.RecoveryGrace == 0 {
		cfg.RecoveryGrace = 60 * time.Second
	}
	view.ObserveRebuilds(func(d time.Duration) { cfg.Metrics.Reconcile.WithLabelValues("cluster_state").Observe(d.Seconds()) })
	return &Aggregator{cfg: cfg, view: view, fleet: newFleet(cfg.Policy, shardCount(cfg.Shards)), assessor: assessor{metrics: cfg.Metrics, clock: cfg.Clock}, concluder: concluder{policy: cfg.Policy, shards: shardCount(cfg.Shards)}, partials: newPartialLog(rand.Text()), pool: stream.NewPool(), journal: &journal{now: cfg.Clock.Now},
		budget: newDecodeBudget(cfg.DecodeBudget), unauth: pendingGate{max: cfg.MaxUnauthenticated, perSource: cfg.MaxUnauthenticatedPerSource, bySource: map[string]int{},
			isNode: view.IsNodeAddress}}
}

// Verdict returns the latest verdict, or nil before the first one (or on
// a follower).
func (a *Aggregator) Verdict() *audit.Verdict {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.fleet.verdict
}

// SetTerm sets the term of the current leadership once it is known.
func (a *Aggregator) SetTerm(ctx context.Context, term int64) { a.lead.setTerm(ctx, term) }

// Term says whether this replica leads now and in which term: the
// executor asks before every action and stamps every record write with
// it, so a replica that lost the Lease cannot act on, or overwrite, what
// the new leader decided.
func (a *Aggregator) Term() (int64, bool) { return a.lead.current() }

// NewLeader records who leads (this replica or another).
func (a *Aggregator) NewLeader(identity string) {
	if a.lead.setLeader(identity) {
		a.cfg.Log.Info("leader changed", zap.String("leader", identity))
	}
}

// Leader returns the current leader's identity ("" when unknown) and
// whether it is this replica.
func (a *Aggregator) Leader() (string, bool) { return a.lead.now() }

// Recovering says until when node drift is held back after the view came
// back from stale (zero or past: not recovering).
func (a *Aggregator) Recovering() time.Time { return a.health.until() }

// Stale says since when and why the leader's view is stale (zero: fresh).
func (a *Aggregator) Stale() (time.Time, string) { return a.health.stale() }
