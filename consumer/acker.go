package consumer

import (
	"errors"
	"log/slog"
	"time"

	"github.com/custody-go/custody/adapters"
)

// groupCommitLinger bounds how long a finished message's ack waits for
// others to share its call, for adapters that leave the linger to the
// runtime (Capabilities.AckLinger zero). Acks rarely wait that long: a batch
// is sent as soon as it is full or a worker runs out of work.
const groupCommitLinger = time.Millisecond

// enqueueAck hands j's ack to be sent. Where the adapter leaves the linger to
// the runtime, acks are group-committed by the workers themselves, with no
// goroutine hand-off per message: the pending batch is sent by the worker
// that fills it, by a worker about to wait for work (see flushAcks), or by
// the linger timer, whichever comes first, and while one call is under way
// the next batch gathers. Otherwise the ack loops batch them.
func (r *run) enqueueAck(j *job) {
	if r.c.caps.AckLinger > 0 {
		r.acks <- j
		return
	}
	r.ackMu.Lock()
	r.pendingAcks = append(r.pendingAcks, j)
	if r.flushing {
		r.ackMu.Unlock()
		return
	}
	if len(r.pendingAcks) < r.ackBatch {
		if !r.lingering {
			r.lingering = true
			r.lingerWG.Add(1)
			r.lingerTimer.Reset(groupCommitLinger)
		}
		r.ackMu.Unlock()
		return
	}
	r.flushLocked()
}

// flushAcks sends the pending acks unless a flush is under way (which sends
// them). Workers call it before they wait for work, so a message's ack never
// waits on a worker that has nothing to do.
func (r *run) flushAcks() {
	r.ackMu.Lock()
	if r.flushing || len(r.pendingAcks) == 0 {
		r.ackMu.Unlock()
		return
	}
	r.flushLocked()
}

// lingerExpired runs on the linger timer's goroutine.
func (r *run) lingerExpired() {
	defer r.lingerWG.Done()
	r.ackMu.Lock()
	r.lingering = false
	if r.flushing || len(r.pendingAcks) == 0 {
		r.ackMu.Unlock()
		return
	}
	r.flushLocked()
}

// stopLinger ends the linger timer; after it returns no timer callback runs.
func (r *run) stopLinger() {
	r.ackMu.Lock()
	if r.lingering && r.lingerTimer.Stop() {
		r.lingering = false
		r.lingerWG.Done()
	}
	r.ackMu.Unlock()
	r.lingerWG.Wait()
}

// flushLocked sends pending acks, in calls of at most the adapter's batch
// limit, until none is left. Called with ackMu held; returns with it
// released.
func (r *run) flushLocked() {
	max := r.c.caps.MaxAckBatch
	r.flushing = true
	for len(r.pendingAcks) > 0 {
		batch := r.pendingAcks
		if max > 0 && len(batch) > max {
			batch = batch[:max]
		}
		rest := r.pendingAcks[len(batch):]
		r.pendingAcks = append(r.spareAcks[:0], rest...)
		r.ackMu.Unlock()
		ds := r.ackDeliveries[:0]
		for _, j := range batch {
			ds = append(ds, j.d)
		}
		r.sendAcks(batch, ds)
		clear(ds)
		r.ackDeliveries = ds
		clear(batch)
		r.ackMu.Lock()
		r.spareAcks = batch[:0]
	}
	r.flushing = false
	r.ackMu.Unlock()
}

// ackLoop sends acks in batches. It takes every ack that is ready (up to the
// adapter's batch limit), lingering up to AckLinger to fill a batch, and sends
// them in one call: while one call is on the wire the next batch gathers, so
// batches grow with load and stay at one under light load.
func (r *run) ackLoop() {
	max := r.c.caps.MaxAckBatch
	if max <= 0 {
		max = 256
	}
	linger := r.c.caps.AckLinger
	var timer *time.Timer
	batch := make([]*job, 0, max)
	ds := make([]*adapters.Delivery, 0, max)
	for {
		j, ok := <-r.acks
		if !ok {
			return
		}
		batch = append(batch[:0], j)
		open := true
		// The linger is counted from the batch's first ack, once: restarted
		// for every ack that joins, it let a steady trickle of acks hold the
		// first one until the batch was full.
		armed := false
	fill:
		for len(batch) < max {
			select {
			case j, ok := <-r.acks:
				if !ok {
					open = false
					break fill
				}
				batch = append(batch, j)
				continue
			default:
			}
			if linger <= 0 {
				break
			}
			if !armed {
				if timer == nil {
					timer = time.NewTimer(linger)
				} else {
					timer.Reset(linger)
				}
				armed = true
			}
			select {
			case j, ok := <-r.acks:
				if !ok {
					open = false
					break fill
				}
				batch = append(batch, j)
			case <-timer.C:
				armed = false
				break fill
			}
		}
		if armed {
			// Full or closed before the linger ran out. Since Go 1.23 a
			// stopped timer delivers no stale tick, so the next Reset
			// starts clean without draining timer.C.
			timer.Stop()
		}
		ds = ds[:0]
		for _, j := range batch {
			ds = append(ds, j.d)
		}
		r.sendAcks(batch, ds)
		if !open {
			return
		}
	}
}

func (r *run) sendAcks(batch []*job, ds []*adapters.Delivery) {
	var err error
	for try := 1; try <= 3; try++ {
		// No per-call timeout: adapters bound their own I/O (the contract
		// asks it), and a timer per call would cost more than a small ack.
		err = r.c.src.Ack(r.settleCtx, ds)
		if err == nil || isBatchError(err) {
			break
		}
		time.Sleep(time.Duration(try) * 50 * time.Millisecond)
	}
	// Settle the batch with one metric update per outcome and one credit
	// release, not one of each per message.
	var acked, deadLettered int
	for i, j := range batch {
		outcome := outcomeAcked
		if j.deadLettered {
			outcome = outcomeDeadLettered
		}
		if e := adapters.EntryError(err, i); e != nil {
			r.tel.ackFailures.Add(r.settleCtx, 1, r.tel.source...)
			r.logs.log(logAckFailed, slog.String("id", j.d.ID), slog.Any("error", e))
			if cause := j.d.LostCause(); errors.Is(e, adapters.ErrLeaseLost) || errors.Is(cause, adapters.ErrLeaseLost) {
				// The lease ran out after the handler finished (unless
				// run.ack counted it already).
				if cause == nil {
					cause = e
				}
				r.leaseLost(j, cause)
			}
			if outcome == outcomeAcked {
				outcome = outcomeLost
			}
		}
		switch outcome {
		case outcomeAcked:
			acked++
		case outcomeDeadLettered:
			deadLettered++
		default:
			r.tel.settled.Add(r.settleCtx, 1, r.tel.outcomes[outcome]...)
		}
	}
	if acked > 0 {
		r.tel.settled.Add(r.settleCtx, int64(acked), r.tel.outcomes[outcomeAcked]...)
	}
	if deadLettered > 0 {
		r.tel.settled.Add(r.settleCtx, int64(deadLettered), r.tel.outcomes[outcomeDeadLettered]...)
	}
	n := len(batch)
	r.tel.inFlight.Add(r.settleCtx, -int64(n), r.tel.source...)
	r.credit.release(n)
	r.held.Add(-n)
}

// isBatchError reports whether err says which entries failed (so retrying
// the whole call would repeat the ones that succeeded). Kept out of line: the
// target errors.As needs escapes to the heap, which should cost nothing on
// the path where the ack succeeded.
func isBatchError(err error) bool {
	var be *adapters.BatchError
	return errors.As(err, &be)
}
