package consumer

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// startBatchWorker starts a worker that gathers jobs into batches and runs
// the batch handler on them, until r.work is closed.
func (r *run) startBatchWorker(wg *sync.WaitGroup) {
	r.startReplaced(wg, func() {
		// The worker gathers every batch into the same array: the runtime
		// keeps no batch's job list past runBatch (the handler gets the
		// batch's own Messages), so only the worker uses it.
		var js []*job
		for {
			var open bool
			js, open = r.gather(js[:0])
			if len(js) > 0 {
				r.runBatch(js)
				clear(js) // keeps no settled job alive
			}
			if !open {
				return
			}
		}
	})
}

// gatherer bounds the batch being gathered.
type gatherer struct {
	jobs  []*job
	bytes int
	size  int
	limit int // bytes; 0: none
}

func (g *gatherer) full() bool {
	return len(g.jobs) >= g.size || (g.limit > 0 && g.bytes >= g.limit)
}

// fits reports whether j may join the batch: it always takes its first job.
func (g *gatherer) fits(j *job) bool {
	return len(g.jobs) == 0 || g.limit <= 0 || g.bytes+len(j.d.Body) <= g.limit
}

func (g *gatherer) add(j *job) {
	g.jobs = append(g.jobs, j)
	g.bytes += len(j.d.Body)
}

// gather waits for a job and gathers a batch: the jobs ready for a worker,
// each with the jobs queued behind it in its lane, up to the batch's size
// and bytes, waiting up to WithBatchLinger for more once it has one. It
// appends them to into, which must be empty. It reports false once r.work
// is closed.
func (r *run) gather(into []*job) ([]*job, bool) {
	j := r.nextJob()
	if j == nil {
		return into, false
	}
	g := gatherer{jobs: into, size: r.cfg.batching.size, limit: r.cfg.batching.bytes}
	var pending *job // a job that did not fit, held for the next batch
	pending = r.take(&g, j)
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	lingered := r.cfg.batching.linger <= 0
	for pending == nil && !g.full() {
		select {
		case j = <-r.work:
			if j == nil {
				return g.jobs, false
			}
			pending = r.take(&g, j)
			continue
		default:
		}
		if lingered {
			break
		}
		if timer == nil {
			timer = time.NewTimer(r.cfg.batching.linger)
		}
		select {
		case j = <-r.work:
			if j == nil {
				return g.jobs, false
			}
			pending = r.take(&g, j)
		case <-timer.C:
			lingered = true
		}
	}
	if pending != nil {
		r.work <- pending // never blocks: it was taken from it
	}
	return g.jobs, true
}

// take adds j to the batch, with the jobs queued behind it in its lane,
// unless j is not to be handled now (prepare settles it). It returns j
// when j does not fit: the caller gives it back to r.work.
func (r *run) take(g *gatherer, j *job) (leftOver *job) {
	if !g.fits(j) {
		return j
	}
	if run, _ := r.prepare(j); !run {
		return nil
	}
	g.add(j)
	if j.lane == "" || g.full() {
		return nil
	}
	// The lane's later jobs join in order, while they fit and may run:
	// one that was recalled, is lost, or is to be given back stays queued
	// for process to settle, and so does every one behind it.
	r.lanesMu.Lock()
	q := r.lanes[j.lane]
	n := 0
	for n < len(q) && !g.full() {
		s := q[n]
		if s.giveBack || s.recalled() || s.lostCause() != nil || s.deadLettering() || !g.fits(s) {
			break
		}
		s.queued = false
		g.add(s)
		n++
	}
	if n > 0 {
		r.queuedLocked(-n)
		r.lanes[j.lane] = popFront(q, n)
	}
	r.lanesMu.Unlock()
	return nil
}

// runBatch runs the batch handler on js and settles or parks each job by
// its outcome.
func (r *run) runBatch(js []*job) {
	b := &Batch{Messages: make([]*Message, len(js)), results: make([]outcome, len(js))}
	attempts := make([]int, len(js))
	for i, j := range js {
		attempts[i] = r.attempt(j)
		m := &j.msg
		if j.retries() > 0 || j.msg.d != nil {
			m = new(Message) // a handler may still hold the earlier attempt's
		}
		fillMessage(m, j.d, attempts[i])
		m.batch, m.batchPos = b, int32(i)
		b.Messages[i] = m
	}
	errs, cut := r.callBatchHandler(js, b, attempts)
	r.settleBatch(js, attempts, errs, cut)
}

// callBatchHandler calls the batch handler with its own context, span and panic
// recovery, and returns each job's error: the batch's, when the handler
// failed as a whole (an error, a panic, runtime.Goexit), else the outcome
// it recorded for each message. It reports whether the loss of one of the
// batch's deliveries cut the batch short: the loss of any of them cancels
// the batch's context, with the loss as its cause (see BatchHandler). The
// context is cancelled, too, once the handler returned: a goroutine it left
// running sees that.
func (r *run) callBatchHandler(js []*job, b *Batch, attempts []int) (errs []error, cut bool) {
	ctx := r.handlerCtx
	var span trace.Span
	if r.tel.spans() {
		ctx, span = r.tel.tracer.Start(ctx, r.batchSpanName, r.tel.batchSpanOptions(r.cfg.propagator, js)...)
	}
	ctx, cancelOnLoss := context.WithCancelCause(ctx)
	lossCtx := ctx
	for _, j := range js {
		j.d.Signal.OnLost(cancelOnLoss) // at once if it is lost already
	}
	ctx, stopTimeout := r.withHandlerTimeout(ctx)
	defer stopTimeout()
	start := r.tel.clock()
	r.tel.batchSize.Record(r.settleCtx, int64(len(js)), r.tel.sourceRecord...)
	returned := false
	var err error
	defer func() {
		p := recover()
		for _, j := range js {
			j.d.Signal.OnLost(nil)
		}
		// Cut by a loss, not by the shutdown deadline, which cancels
		// r.handlerCtx, and lossCtx with it.
		cut = lossCtx.Err() != nil && r.handlerCtx.Err() == nil
		cancelOnLoss(nil)
		switch {
		case p != nil:
			err = r.panicked(js[0].d, attempts[0], p)
		case !returned:
			// runtime.Goexit is ending this worker: the batch is settled as
			// it unwinds, and the run replaces the worker.
			err = ErrHandlerExited
			r.logs.log(logExited, slog.String("id", js[0].d.ID), slog.Int("batch", len(js)), slog.Any("error", err))
		case err != nil:
			var ok bool
			if err, ok = checkedError(err); !ok {
				r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
			}
		}
		errs = make([]error, len(js))
		for i := range js {
			switch {
			case err != nil:
				errs[i] = err
			case !b.results[i].set:
				errs[i] = ErrNoOutcome
			case b.results[i].err != nil:
				e, ok := checkedError(b.results[i].err)
				if !ok {
					r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
				}
				errs[i] = e
			}
		}
		r.recordBatch(js, errs, cut, start, span)
		if !returned && p == nil {
			r.settleBatch(js, attempts, errs, cut) // Goexit: nothing after this runs
		}
	}()
	r.running.Add(int64(len(js)))
	defer r.running.Add(-int64(len(js)))
	err = r.c.batchHandler.HandleBatch(ctx, b)
	returned = true
	return errs, cut
}

// recordBatch records the batch's duration under each message's result,
// and ends the batch's span. A message that failed once the batch was cut
// short (by a loss, or the shutdown deadline) is recorded as cancelled.
func (r *run) recordBatch(js []*job, errs []error, batchCut bool, start time.Time, span trace.Span) {
	timed := !start.IsZero()
	var took float64
	if timed {
		took = time.Since(start).Seconds()
	}
	failed := 0
	for i, j := range js {
		res := attemptResult(errs[i], batchCut || j.lostCause() != nil || r.handlerCtx.Err() != nil)
		if res == resultError {
			failed++
		}
		if timed {
			r.tel.duration.Record(r.settleCtx, took, r.tel.results[res]...)
		}
	}
	if span != nil {
		span.SetAttributes(attribute.Int("custody.batch.failed", failed))
		if failed > 0 {
			span.SetStatus(codes.Error, "some messages of the batch failed")
		}
		span.End()
	}
}

// settleBatch applies each job's outcome, lane by lane. A lane's jobs come
// in order; when one of them fails (or is lost), the lane's later jobs of
// the batch are neither acked nor given back: they go back to the front of
// the lane's queue, behind the failed one, and run again after it, whatever
// the handler recorded for them, so that no message of a lane is settled
// ahead of an earlier one. cut says the loss of one of the batch's
// deliveries cut the batch short: see runAgainAfterCut.
func (r *run) settleBatch(js []*job, attempts []int, errs []error, cut bool) {
	acks := make([]*job, 0, len(js))
	for start := 0; start < len(js); {
		end := start + 1
		if lane := js[start].lane; lane != "" {
			for end < len(js) && js[end].lane == lane {
				end++
			}
		}
		acks = r.settleGroup(js[start:end], attempts[start:end], errs[start:end], cut, acks)
		start = end
	}
	r.acks.addAll(acks)
}

// settleGroup settles the jobs of one lane (or one unordered job), and
// appends those to ack to acks.
func (r *run) settleGroup(g []*job, attempts []int, errs []error, cut bool, acks []*job) []*job {
	k := len(g) - 1
	for i, j := range g {
		if breaksLane(j, errs[i]) {
			k = i
			break
		}
	}
	if k < len(g)-1 {
		r.requeueFront(g[k+1:])
	}
	parked := false
	for i := 0; i <= k; i++ {
		j := g[i]
		j.batched = true // the lane is passed on below, once; the acks are sent together
		if cut && errs[i] != nil && j.lostCause() == nil && r.handlerCtx.Err() == nil {
			parked = r.runAgainAfterCut(j)
		} else {
			parked = r.afterAttempt(j, attempts[i], errs[i])
		}
		if !parked {
			if j.settling.acks() {
				acks = append(acks, j)
			}
			j.batched = false
		}
	}
	if !parked && g[k].lane != "" {
		r.next(g[k])
	}
	return acks
}

// runAgainAfterCut parks j, whose attempt failed in a batch that the loss
// of another of its deliveries cut short, to run again at once. The failure
// is taken for the cut's doing, not the message's: it uses up no attempt
// (the message runs again with the same Attempt), counts for no kill
// switch, and never dead-letters the message. It waits in place, not at the
// broker, whose delivery count a redelivery would raise; its lane, if any,
// waits with it. It reports that j was parked.
func (r *run) runAgainAfterCut(j *job) (parked bool) {
	r.logs.log(logBatchCut, slog.String("id", j.d.ID))
	if j.fail != nil {
		j.fail.err = nil // given back at once should the drain begin meanwhile
	}
	r.park(j, minBackoff)
	return true
}

// breaksLane reports whether a lane's later jobs must not be settled ahead
// of j: its attempt failed, or its delivery is gone (a lease that merely ran
// out still takes the ack, as for a single message).
func breaksLane(j *job, err error) bool {
	if err != nil {
		return true
	}
	cause := j.lostCause()
	return cause != nil && !errors.Is(cause, adapters.ErrLeaseLost)
}

// requeueFront puts js, jobs of one lane in order, back at the front of
// their lane's queue.
func (r *run) requeueFront(js []*job) {
	lane := js[0].lane
	r.lanesMu.Lock()
	q := r.lanes[lane]
	nq := make([]*job, 0, len(js)+len(q))
	for _, j := range js {
		j.queued = true
		nq = append(nq, j)
	}
	r.queuedLocked(len(js))
	r.lanes[lane] = append(nq, q...)
	r.lanesMu.Unlock()
}
