package collector

import "time"

// readCredit is the read budget as a bucket of CPU time: it fills at
// share of a core up to burst, and each read takes what it cost. A read
// waits only while the bucket is in debt, so reads are spaced by their
// cost under sustained churn (a read that cost c waits c/share), while a
// change after a quiet spell is read at once even if another was read
// moments before: a table flushed right after a drift, or the first
// reads of changes after the whole read a reader makes at the start.
//
// The debt is bounded by what the budget earns in an interval: reads are
// never spaced further apart than that anyway (a node reports what it
// shows at least once an interval), so debt beyond it would only hold the
// first change after a long quiet spell.
type readCredit struct {
	share   float64
	burst   time.Duration
	floor   time.Duration // the most debt kept (negative)
	credit  time.Duration
	at      time.Time
	started bool
}

// DefaultReadBurstWindow: reads may spend at once what the budget earns in
// a minute (3 s of CPU at 5 %: two whole reads at the anchors).
const DefaultReadBurstWindow = time.Minute

func newReadCredit(share float64, burst, interval time.Duration) *readCredit {
	return &readCredit{share: share, burst: burst, credit: burst, floor: -time.Duration(share * float64(max(interval, minReadGap)))}
}

func (b *readCredit) refill(now time.Time) {
	if b.started {
		b.credit = min(b.burst, b.credit+time.Duration(b.share*float64(now.Sub(b.at))))
	}
	b.at, b.started = now, true
}

// spend takes a read's CPU.
func (b *readCredit) spend(now time.Time, cpu time.Duration) {
	b.refill(now)
	b.credit = max(b.floor, b.credit-cpu)
}

// wait is how long until the bucket is out of debt (0: a read may start).
func (b *readCredit) wait(now time.Time) time.Duration {
	b.refill(now)
	if b.credit >= 0 || b.share <= 0 {
		return 0
	}
	return time.Duration(float64(-b.credit) / b.share)
}
