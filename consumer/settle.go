package consumer

import (
	"errors"
	"log/slog"
	"time"

	"github.com/custody-go/custody/adapters"
)

// settlement is how the runtime's custody of a job ends.
type settlement uint8

const (
	settleAck          settlement = iota // the effect is done: ack
	settleDeadLettered                   // the dead-letter copy is confirmed: ack the original
	settleDisposed                       // the dead-letter destination settled the original itself
	settleRetry                          // give it back, to come back after a delay: a retry at the broker
	settleExhausted                      // give it back after a delay: out of attempts, nowhere to dead-letter it
	settleRelease                        // give it back at once: not run, or cut short
	settleLeave                          // leave it to its lease (WithLeaveUnfinishedOnShutdown)
	settleLost                           // no longer this consumer's: nothing to send
	settleHandled                        // at-most-once: acked on receipt, handled
	settleFailed                         // at-most-once: acked on receipt, its handler failed
)

// settlementOutcomes name the settlements in custody.messages.settled.
var settlementOutcomes = [...]string{
	settleAck:          outcomeAcked,
	settleDeadLettered: outcomeDeadLettered,
	settleDisposed:     outcomeDeadLettered,
	settleRetry:        outcomeRetried,
	settleExhausted:    outcomeExhausted,
	settleRelease:      outcomeReleased,
	settleLeave:        outcomeLeft,
	settleLost:         outcomeLost,
	settleHandled:      outcomeAcked,
	settleFailed:       outcomeFailed,
}

// outcome names s in custody.messages.settled.
func (s settlement) outcome() string { return settlementOutcomes[s] }

// acks reports whether s is sent to the broker as an ack.
func (s settlement) acks() bool { return s == settleAck || s == settleDeadLettered }

// nacks reports whether s gives the message back to the broker.
func (s settlement) nacks() bool {
	return s == settleRetry || s == settleExhausted || s == settleRelease
}

// A verdict is a settlement with what applying it takes.
type verdict struct {
	// after is the redelivery delay of a retry or an exhausted message.
	after time.Duration
	how   settlement
	// why says what gave a message back (settleRelease), for the log.
	why reason
}

// A reason says why a message is given back.
type reason uint8

const (
	whyShutdown   reason = iota + 1 // not started, or failed, once the drain began
	whyDeadline                     // its handler was cut short by the shutdown deadline
	whyRecalled                     // the adapter recalled it (a Kafka partition being revoked)
	whyBehindLost                   // queued behind a lost delivery of its ordering key
	whyExited                       // its handler called runtime.Goexit
	whyPaused                       // not started when the consumer was paused (GiveBackWaiting)
	whyMaxHold                      // held for the maximum processing time, without a lease
)

// reasonNames are the reasons' values of the "reason" log attribute.
var reasonNames = [...]string{
	whyShutdown:   "shutdown",
	whyDeadline:   "shutdown deadline",
	whyRecalled:   "recalled by the adapter",
	whyBehindLost: "behind a lost message",
	whyExited:     "handler called Goexit",
	whyPaused:     "paused",
	whyMaxHold:    "held for the maximum processing time",
}

func (w reason) String() string { return reasonNames[w] }

// atShutdown reports whether w is the drain's doing, which
// WithLeaveUnfinishedOnShutdown turns into leaving the message to its lease.
func (w reason) atShutdown() bool { return w == whyShutdown || w == whyDeadline }

// released is the verdict that gives a message back at once, for why.
func released(why reason) verdict { return verdict{how: settleRelease, why: why} }

// settle applies v to j, the one place where the runtime's custody of a
// delivery ends: it stops the lease (no renewal is sent after it returns),
// passes j's lane on (or, for a lost delivery, marks the jobs queued behind
// it to be given back), queues the ack or nack the verdict calls for, and
// accounts for j once nothing more is to be sent. A delivery lost
// meanwhile is settled as lost: it can be neither given back nor acked,
// but for a lease that merely ran out, whose ack the broker may still
// take, sparing a duplicate.
func (r *run) settle(j *job, v verdict) {
	if j.lease != nil {
		j.lease.Stop()
	}
	if cause := j.lostCause(); cause != nil && v.how != settleLost {
		switch {
		case v.how.acks() && errors.Is(cause, adapters.ErrLeaseLost):
			r.leaseLost(j, cause)
		case v.how.acks() || v.how.nacks() || v.how == settleLeave:
			v = verdict{how: settleLost}
		}
	}
	if v.how == settleRelease {
		switch {
		case j.recalled():
			v.why = whyRecalled // the adapter waits for it: never left
		case v.why.atShutdown() && r.cfg.leaveOnShutdown:
			v = verdict{how: settleLeave}
		}
	}
	switch v.how {
	case settleLost:
		cause := j.lostCause()
		if errors.Is(cause, adapters.ErrLeaseLost) {
			r.leaseLost(j, cause)
		} else {
			r.logs.log(logLost, slog.String("id", j.d.ID), slog.Any("cause", cause))
		}
		if j.lane != "" && !j.queued {
			r.giveBackBehind(j, r.receivedBefore(j, j.lostAt()))
		}
	case settleRelease:
		r.logs.log(logGivenBack, slog.String("id", j.d.ID), slog.String("reason", v.why.String()))
	case settleLeave:
		r.logs.log(logLeft, slog.String("id", j.d.ID))
	}
	if !j.batched {
		r.next(j) // a batch passes a lane on once, for the lane's jobs it settled
	}
	j.settling, j.settleAfter = v.how, v.after
	switch {
	case v.how.acks() && j.batched:
		// The batch adds its acks together, under one lock (settleGroup).
	case v.how.acks():
		r.acks.add(j)
	case v.how.nacks():
		r.nacks.add(j)
	default:
		r.done(j, v.how.outcome())
	}
}

// done ends the runtime's custody of j, counted under outcome.
func (r *run) done(j *job, outcome string) {
	r.tel.settle(r.settleCtx, outcome, 1)
	if r.queuedFree && j.queued {
		r.credit.releaseQueued(1) // settled from its lane's queue (recalled)
	} else {
		r.credit.release(1)
	}
	r.holding.Add(-1)
	r.held.Done()
}

// leaseLost counts and logs j's lost lease, once. It is counted here rather
// than by the lease keeper, which misses a lease the adapter reported lost by
// itself (a stale receipt, a renewal the runtime stopped before its answer
// came back).
func (r *run) leaseLost(j *job, cause error) {
	if j.leaseLostCounted {
		return
	}
	j.leaseLostCounted = true
	r.leasesLostMin.add(time.Now(), 1)
	r.tel.leasesLost.Add(r.settleCtx, 1, r.tel.source...)
	r.logs.log(logLeaseLost, slog.String("id", j.d.ID), slog.Any("cause", cause))
}

// releaseWaiting gives back, at shutdown, the jobs that wait for a worker,
// at once, rather than when a worker frees up, which may be the whole
// shutdown timeout away. A job whose lane is busy waits for the lane's
// running job, so that its key's order holds; it is given back as soon as
// that job ends. Called once receiving has stopped, and never in
// at-most-once mode, where every job was acked on receipt and still runs.
func (r *run) releaseWaiting() {
	for j := r.waitingJob(); j != nil; j = r.waitingJob() {
		if j.lane != "" {
			r.runLane(j) // its lane's queued jobs are given back after it
			continue
		}
		why := whyShutdown
		if j.recalled() {
			why = whyRecalled // the adapter asked for it: never left
		}
		r.settle(j, released(why))
	}
}
