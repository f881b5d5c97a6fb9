package consumer

import (
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
)

// batchTries bounds the calls made for one entry of an ack or nack batch:
// the first, and the tries again of entries that failed for a reason worth
// another try. retryPause times the try number is the pause before one.
const (
	batchTries = 3
	retryPause = 50 * time.Millisecond
)

// deliveryScratch holds the slices of deliveries the calls pass to the
// adapter, reused across calls: up to MaxCalls calls may be under way.
var deliveryScratch = sync.Pool{New: func() any { return new([]*adapters.Delivery) }}

// ackCall acks batch and settles its jobs.
func (r *run) ackCall(batch []*job) {
	errs := r.callBatch(batch, func(js []*job) error {
		buf := deliveryScratch.Get().(*[]*adapters.Delivery)
		ds := (*buf)[:0]
		for _, j := range js {
			ds = append(ds, j.d)
		}
		err := r.c.src.Ack(r.settleCtx, ds)
		clear(ds)
		*buf = ds[:0]
		deliveryScratch.Put(buf)
		return err
	})
	var settled settledCounts
	for i, j := range batch {
		how := j.settling
		if errs != nil && errs[i] != nil {
			e := errs[i]
			r.tel.ackFailures.Add(r.settleCtx, 1, r.tel.source...)
			r.logs.log(logAckFailed, slog.String("id", j.d.ID), slog.Any("error", e))
			if cause := j.lostCause(); errors.Is(e, adapters.ErrLeaseLost) || errors.Is(cause, adapters.ErrLeaseLost) {
				// The lease ran out after the handler finished (unless
				// settle counted it already).
				if cause == nil {
					cause = e
				}
				r.leaseLost(j, cause)
			}
			if how == settleAck {
				how = settleLost
			}
		}
		settled[how]++
	}
	if settled[settleAck] > 0 {
		storeNow(&r.lastAck)
	}
	r.finishBatch(batch, &settled)
}

// nackCall gives batch back to the broker and settles its jobs. A nack
// that fails loses nothing: the message waits for the broker to take it
// back by itself (its lease runs out, its connection closes).
func (r *run) nackCall(batch []*job) {
	errs := r.callBatch(batch, r.nackJobs)
	var settled settledCounts
	for i, j := range batch {
		if errs != nil && errs[i] != nil {
			r.logs.log(logNackFailed, slog.String("id", j.d.ID), slog.Any("error", errs[i]))
		}
		settled[j.settling]++
	}
	r.finishBatch(batch, &settled)
}

// nackJobs nacks js, each with its own delay.
func (r *run) nackJobs(js []*job) error {
	ns := make([]adapters.Nack, len(js))
	for i, j := range js {
		ns[i] = adapters.Nack{Delivery: j.d, After: j.settleAfter}
	}
	return r.c.src.Nack(r.settleCtx, ns)
}

// settledCounts counts a batch's jobs by settlement.
type settledCounts [len(settlementOutcomes)]int

// finishBatch ends the runtime's custody of a settled batch, counted by
// settlement: one metric update per outcome, one credit release.
func (r *run) finishBatch(batch []*job, settled *settledCounts) {
	for how, n := range settled {
		if n > 0 {
			r.tel.settled.Add(r.settleCtx, int64(n), r.tel.outcomes[settlement(how).outcome()]...)
		}
	}
	n := len(batch)
	r.tel.inFlight.Add(r.settleCtx, -int64(n), r.tel.source...)
	queued := 0
	if r.queuedFree {
		for _, j := range batch {
			if j.queued { // given back from its lane's queue (recalled)
				queued++
			}
		}
	}
	r.credit.release(n - queued)
	r.credit.releaseQueued(queued)
	r.holding.Add(-int64(n))
	r.held.Add(-n)
}

// callBatch calls op for the jobs of batch and returns each one's error, or
// nil when all succeeded. Entries that failed for a reason worth another
// try are tried again, batchTries calls in all, after a pause: those of a
// call that failed whole (the network, throttling), and those the adapter
// reports failed for a transient reason (Retryable). A delivery the broker
// no longer holds for this consumer is never tried again.
func (r *run) callBatch(batch []*job, op func([]*job) error) []error {
	err := op(batch)
	if err == nil {
		return nil
	}
	errs := make([]error, len(batch))
	idx := make([]int, len(batch))
	for i := range idx {
		idx[i] = i
	}
	js := batch
	for try := 1; ; try++ {
		whole := !isBatchError(err)
		var retry []int
		for k, i := range idx {
			e := adapters.EntryError(err, k)
			errs[i] = e
			if e != nil && try < batchTries && r.worthRetrying(e, whole) {
				retry = append(retry, i)
			}
		}
		if len(retry) == 0 || !r.pause(time.Duration(try)*retryPause) {
			return errs
		}
		idx = retry
		js = make([]*job, len(idx))
		for k, i := range idx {
			js[k] = batch[i]
		}
		err = op(js)
		if err == nil {
			for _, i := range idx {
				errs[i] = nil
			}
			return errs
		}
	}
}

// worthRetrying reports whether an entry that failed with e is tried again.
func (r *run) worthRetrying(e error, whole bool) bool {
	for _, final := range []error{adapters.ErrLeaseLost, adapters.ErrConnectionLost, adapters.ErrRevoked, adapters.ErrClosed} {
		if errors.Is(e, final) {
			return false
		}
	}
	if rt, ok := r.c.src.(adapters.Retryable); ok {
		return rt.IsRetryable(e)
	}
	return whole
}

// pause waits d, and reports false if the handlers' context ended first
// (the shutdown deadline): the drain does not wait out retries.
func (r *run) pause(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.handlerCtx.Done():
		return false
	}
}

// isBatchError reports whether err says which entries failed. Kept out of
// line: the target errors.As needs escapes to the heap, which should cost
// nothing on the path where the call succeeded.
func isBatchError(err error) bool {
	var be *adapters.BatchError
	return errors.As(err, &be)
}
