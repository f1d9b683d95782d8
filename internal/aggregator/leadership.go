package aggregator

import (
	"context"
	"sync"

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

// setTerm sets the term of the leadership ctx is the context of, if it
// is still the current one.
func (l *leadership) setTerm(ctx context.Context, term int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ctx == ctx {
		l.term = term
	}
}

// current says whether this replica leads now, and in which term.
func (l *leadership) current() (int64, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	ok := l.leading && l.ctx != nil && l.ctx.Err() == nil && (l.term >= 0 || l.term == effect.Unfenced)
	return l.term, ok
}

// context is the current leadership's context (ended when not leading).
func (l *leadership) context() context.Context {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.leading || l.ctx == nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		return ctx
	}
	return l.ctx
}

// setLeader records who leads (this replica or another), and says whether
// that changed.
func (l *leadership) setLeader(identity string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	changed := identity != l.leader
	l.leader = identity
	return changed
}
