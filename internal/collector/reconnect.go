package collector

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"k8s.io/utils/clock"

	"github.com/proxyaudit/proxyaudit/internal/stream"
)

// Session is one connection to the aggregator, as Reconnect runs it: it
// returns the leader's address when the replica it reached redirected it,
// whether the aggregator welcomed it (a stream was up), and the error
// that ended it. preferred is the address to try first ("" for none).
type Session func(ctx context.Context, preferred string) (leader string, welcomed bool, err error)

// Reconnect runs session until ctx ends, as every collector does (and the
// fleet simulation, so its reconnect figures are the collector's): a
// redirect is followed at once, a stream that was up and ended is retried
// within a second, a busy aggregator's slot is kept (with 10 % jitter),
// and anything else backs off with jitter from 1 s to 30 s. A redirect to
// the leader just tried (it was unreachable, and another replica still
// names it: the Lease has not moved yet) waits like a failure, backing
// off to at most 4 s, instead of bouncing between the replicas as fast as
// it can dial until the Lease moves. Until its first welcome, for
// firstContact after it starts, a collector backs off to at most 4 s too:
// at install (or while a node joins) the aggregator is still coming up, a
// refused dial costs it nothing, and a 30 s backoff left one node's
// collector unheard 30–100 s after the rest of the fleet was in sync.
func Reconnect(ctx context.Context, clk clock.Clock, session Session, ended func(err error, wait time.Duration)) {
	backoff := time.Second
	preferred := ""
	started, everWelcomed := clk.Now(), false
	for ctx.Err() == nil {
		leader, welcomed, err := session(ctx, preferred)
		if ctx.Err() != nil {
			return
		}
		if leader != "" && leader != preferred {
			preferred, backoff = leader, time.Second
			continue
		}
		if welcomed {
			// A stream that was up ended (the leader went away): come
			// back quickly, whatever it took to get that stream.
			backoff, everWelcomed = time.Second, true
		}
		if leader != "" {
			err = fmt.Errorf("redirected again to the leader %s, which did not answer: waiting for the Lease to move", leader)
		}
		wait := backoff/2 + time.Duration(rand.Int64N(int64(backoff)/2+1))
		var busy *comeBack
		if errors.As(err, &busy) {
			// The aggregator said when it can take us (it spreads the
			// crowd it refuses over its budget): come back then, to it,
			// with a little jitter, without backing off.
			wait = busy.after + time.Duration(rand.Int64N(int64(busy.after)/10+int64(100*time.Millisecond)))
		} else {
			preferred = ""
			// Waiting for the Lease to move takes seconds, not minutes:
			// keep asking every few (a redirect costs no review).
			ceiling := 30 * time.Second
			if leader != "" || (!everWelcomed && clk.Since(started) < firstContact) {
				ceiling = 4 * time.Second
			}
			backoff = min(2*backoff, ceiling)
		}
		if ended != nil {
			ended(err, wait)
		}
		select {
		case <-ctx.Done():
			return
		case <-clk.After(wait):
		}
	}
}

// firstContact is how long after it starts a collector never welcomed
// keeps retrying every few seconds (a chart install's aggregator pods are
// Ready well within it).
const firstContact = 2 * time.Minute

// HelloOutcome reads the aggregator's answer to a hello: nil for a welcome, the
// leader's address for a redirect, or why it refused (a busy refusal
// carries when to come back, which Reconnect keeps).
func HelloOutcome(reply *stream.Message) (leader string, err error) {
	switch reply.Type {
	case stream.TypeWelcome:
		return "", nil
	case stream.TypeRedirect:
		if reply.Redirect == nil || reply.Redirect.Leader == "" {
			return "", errors.New("redirected without a leader address (no leader elected yet?)")
		}
		return reply.Redirect.Leader, nil
	case stream.TypeReject:
		reason := "no reason given"
		if reply.Reject != nil {
			reason = reply.Reject.Reason
			if after := reply.Reject.RetryAfterSeconds; after > 0 {
				return "", &comeBack{after: time.Duration(min(after, maxComeBack.Seconds()) * float64(time.Second)), reason: reason}
			}
		}
		return "", fmt.Errorf("aggregator rejected this collector: %s", reason)
	default:
		return "", fmt.Errorf("unexpected %q answer to hello", reply.Type)
	}
}

// comeBack is a refusal that says when to retry: the aggregator is busy
// reviewing the tokens of a fleet reconnecting, or no replica leads (holds
// the node's shard) yet.
type comeBack struct {
	after  time.Duration
	reason string
}

func (e *comeBack) Error() string {
	return fmt.Sprintf("aggregator asked to come back in %s: %s", e.after, e.reason)
}

// IsBusy says whether err is an aggregator's refusal that said when to
// come back.
func IsBusy(err error) bool {
	var busy *comeBack
	return errors.As(err, &busy)
}

// maxComeBack bounds how long an aggregator's busy refusal can park a
// collector.
const maxComeBack = time.Minute
