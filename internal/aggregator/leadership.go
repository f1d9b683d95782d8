package aggregator

import (
	"context"
	"sync"

	"go.uber.org/zap"

	"github.com/proxyaudit/proxyaudit/remediate/effect"
)

// leadership is whether this replica leads, who does, and the term of
// its leadership. Written with the fleet's lock held too (see
// Aggregator); read alone by the executor before every action, by the
// API and by admission.
type leadership struct {
	mu      sync.Mutex
	leading bool
	leader  string
	// ctx ends when this replica's leadership does; term orders
	// leaderships (see Term): remediation acts only within both.
	ctx  context.Context
	term int64
}

// now returns who leads and whether it is this replica.
func (l *leadership) now() (leader string, leading bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.leader, l.leading
}

// isLeading says whether this replica leads.
func (l *leadership) isLeading() bool {
	_, leading := l.now()
	return leading
}

// SetTerm sets the term of the current leadership once it is known.
func (a *Aggregator) SetTerm(ctx context.Context, term int64) {
	a.lead.mu.Lock()
	defer a.lead.mu.Unlock()
	if a.lead.ctx == ctx {
		a.lead.term = term
	}
}

// Term says whether this replica leads now and in which term: the
// executor asks before every action and stamps every record write with
// it, so a replica that lost the Lease cannot act on, or overwrite, what
// the new leader decided.
func (a *Aggregator) Term() (int64, bool) {
	l := &a.lead
	l.mu.Lock()
	defer l.mu.Unlock()
	ok := l.leading && l.ctx != nil && l.ctx.Err() == nil && (l.term >= 0 || l.term == effect.Unfenced)
	return l.term, ok
}

// leadContext is the current leadership's context (ended when not
// leading).
func (a *Aggregator) leadContext() context.Context {
	l := &a.lead
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.leading || l.ctx == nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		return ctx
	}
	return l.ctx
}

// NewLeader records who leads (this replica or another).
func (a *Aggregator) NewLeader(identity string) {
	a.lead.mu.Lock()
	defer a.lead.mu.Unlock()
	if identity != a.lead.leader {
		a.cfg.Log.Info("leader changed", zap.String("leader", identity))
	}
	a.lead.leader = identity
}

// Leader returns the current leader's identity ("" when unknown) and
// whether it is this replica.
func (a *Aggregator) Leader() (string, bool) { return a.lead.now() }
