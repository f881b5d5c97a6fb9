package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"runtime/debug"
	"time"

	"github.com/custody-go/custody/adapters"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// process runs j's handler until it succeeds, runs out of attempts, or the
// delivery leaves this consumer, and settles it.
func (r *run) process(j *job) {
	if j.ackedEarly {
		// Acked on receipt: it can no longer be given back, even during
		// shutdown, so handling it is its only chance.
		r.processAtMostOnce(j)
		return
	}
	if j.d.Recalled() {
		// The adapter wants it back before it starts (its Kafka partition
		// is being revoked): given back at once, even at shutdown with
		// WithLeaveUnfinishedOnShutdown, since the adapter waits for it.
		r.releaseNow(j, whyRecalled)
		return
	}
	if r.draining.Load() {
		r.release(j, whyShutdown) // not started before shutdown: give it back at once
		return
	}
	if j.giveBack {
		// Queued behind a lost message of its lane: give it back at once,
		// even with WithLeaveUnfinishedOnShutdown, which is about shutdown.
		// Left to its lease it would hold up the lost message's group (an
		// SQS FIFO group) until that lease ran out.
		r.releaseNow(j, whyBehindLost)
		return
	}
	maxAttempts := r.cfg.retry.MaxAttempts
	for {
		if cause := j.d.LostCause(); cause != nil {
			// Lost while it waited (a revoked partition, a dead channel):
			// running the handler now would only repeat the new owner's work.
			r.lost(j, cause)
			return
		}
		if j.d.Recalled() {
			// Recalled while a retry waited: no handler runs, so it goes
			// back now (see Delivery.Recall).
			r.releaseNow(j, whyRecalled)
			return
		}
		attempt := r.attempt(j)
		err := r.call(j, attempt)
		if err == nil {
			r.ack(j, outcomeAcked)
			return
		}
		if cause := j.d.LostCause(); cause != nil {
			r.lost(j, cause)
			return
		}
		if r.handlerCtx.Err() != nil {
			// The shutdown deadline cut the handler short: not the message's
			// fault, so it neither counts as a failure nor waits a backoff.
			r.release(j, whyDeadline)
			return
		}
		if IsUnavailable(err) {
			// A dependency's fault, not the message's: no attempt is used
			// up, and the message waits here rather than at the broker,
			// whose delivery count a redelivery would raise.
			j.unavailable++
			delay, ok := RetryDelay(err)
			if !ok || delay <= 0 {
				delay = backoffDelay(r.cfg.retry.Backoff, j.unavailable)
			}
			delay = max(delay, minBackoff)
			r.tel.unavailable.Add(r.settleCtx, 1, r.tel.source...)
			r.logs.log(logUnavailable, slog.String("id", j.d.ID), slog.Int("waits", j.unavailable),
				slog.Duration("retry_in", delay), slog.Any("error", err))
			if r.draining.Load() {
				// Given back at once, as a message already waiting out the
				// outage is when the drain begins (see wait): whether the
				// handler returned just before the drain or just after must
				// not decide whether the broker hides the message for the
				// wait's delay, which can be longer than its lease.
				r.release(j, whyShutdown)
				return
			}
			if !r.wait(j, delay) {
				return
			}
			continue
		}
		j.unavailable = 0
		now := time.Now()
		deferred := IsDeferred(err)
		if j.firstFailure.IsZero() && !deferred {
			j.firstFailure = now
		}
		delay, ok := RetryDelay(err)
		if !ok || delay <= 0 {
			// No delay asked for, or none at all: the policy's backoff, so
			// that nothing retries in a hot loop (a deferral never runs out
			// of attempts to stop it).
			delay = backoffDelay(r.cfg.retry.Backoff, attempt)
		}
		// A delay asked for is floored too: a deferral has no attempt limit,
		// so Defer(err, time.Nanosecond) would otherwise come back at once,
		// for ever.
		delay = max(delay, minBackoff)
		if IsPermanent(err) || (attempt >= maxAttempts && !deferred) {
			if r.exhausted(j, err, attempt, now, delay) {
				return
			}
			// No dead-letter destination and no way to give the message
			// back: keep trying the handler in place, at the backoff's
			// pace, rather than drop it.
		}
		if r.draining.Load() {
			r.giveBack(j, delay)
			return
		}
		byNack := r.retriesByNack(j)
		r.logRetry(j, err, attempt, delay, deferred, byNack)
		if byNack {
			// The broker holds the message for the delay; no worker waits.
			r.nack(j, delay, outcomeRetried)
			return
		}
		if !r.wait(j, delay) {
			return
		}
		if !deferred {
			j.retries++
		}
	}
}

// exhausted dead-letters j. Should the dead-letter write fail, it keeps the
// original (never acking it) and tries again after a backoff. It reports
// whether j was settled; false means there is no dead-letter destination and
// the broker cannot take the message back with a delay, so the caller goes on
// retrying the handler.
//
// Without a dead-letter destination the message is given back after retry,
// the delay the caller computed for the handler's next attempt: it is one
// more retry, so a delay the handler asked for (RetryAfter) holds as for any
// other.
func (r *run) exhausted(j *job, err error, attempt int, now time.Time, retry time.Duration) bool {
	dl := r.cfg.deadLetter
	if dl == nil {
		r.logs.log(logNoDeadLetter, slog.String("id", j.d.ID), slog.String("reason", failureReason(err)),
			slog.Int("attempts", attempt), slog.Duration("retry_in", retry), slog.Any("error", err))
		if r.c.caps.NackDelay && j.lane == "" {
			r.nack(j, retry, outcomeExhausted)
			return true
		}
		return false
	}
	for try := 1; ; try++ {
		delay := backoffDelay(r.cfg.retry.Backoff, attempt+try-1)
		f := adapters.Failure{
			Err:          err,
			Permanent:    IsPermanent(err),
			Attempts:     attempt,
			FirstFailure: j.firstFailure,
			LastFailure:  now,
			Consumer:     r.cfg.name,
		}
		if attempt > j.retries+1 && !j.d.FirstReceivedAt.IsZero() {
			// Earlier attempts ran before this delivery: the broker's first
			// receive is the best bound on the first failure we have.
			f.FirstFailure = j.d.FirstReceivedAt
		}
		cut, sendErr := r.sendDeadLetter(dl, j, f)
		if sendErr == nil {
			r.logs.log(logDeadLettered, slog.String("id", j.d.ID), slog.String("reason", failureReason(err)),
				slog.Int("attempts", attempt), slog.Any("error", err))
			if j.d.Settled() {
				r.stopLease(j)
				r.settle(j, outcomeDeadLettered)
				r.next(j)
				return true
			}
			r.ack(j, outcomeDeadLettered)
			return true
		}
		// A write the shutdown deadline or the delivery's loss cut short
		// says nothing about the destination: the consumer stopped waiting
		// for it. Counted, it would report a dead-letter outage on every
		// such shutdown.
		if !cut {
			r.tel.dlqFailures.Add(r.settleCtx, 1, r.tel.source...)
		}
		if cause := j.d.LostCause(); cause != nil {
			// Not kept: the delivery is gone (its lease, or a release the
			// failed write had already sent, as SQS's Redrive does), and
			// the broker brings the message back.
			kind := logDeadLetterLost
			if cut {
				kind = logDeadLetterCutLost
			}
			r.logs.log(kind, slog.String("id", j.d.ID), slog.Any("error", sendErr))
			r.lost(j, cause)
			return true
		}
		if cut {
			r.logs.log(logDeadLetterCut, slog.String("id", j.d.ID), slog.Any("error", sendErr))
			r.giveBack(j, delay)
			return true
		}
		r.logs.log(logDeadLetterFailed, slog.String("id", j.d.ID), slog.Any("error", sendErr), slog.Duration("retry_in", delay))
		if r.draining.Load() {
			r.giveBack(j, delay)
			return true
		}
		// The write is tried again in place, the lease kept alive, even
		// where the broker could hold the message back: a redelivery would
		// run the handler again for a message that is done with it, and
		// raise the broker's delivery count. Waiting, the message keeps its
		// place in the in-flight window, so an outage of the destination
		// slows intake instead of cycling messages through the broker.
		if !r.wait(j, delay) {
			return true
		}
	}
}

// sendDeadLetter writes j's dead-letter copy with a context that ends, with
// the loss as its cause, if the delivery is lost meanwhile (a lease whose
// renewals failed, a revoked Kafka partition, a dead channel), as a
// handler's does: the broker hands the message out again, and a copy
// written after that, by a write stuck behind a slow or unreachable
// destination, would sit beside whatever the new holder does with it.
// It reports whether a failed write was cut short: it failed with its
// context's error, the context having ended (the loss, or the shutdown
// deadline), rather than for a reason of the destination's own.
func (r *run) sendDeadLetter(dl adapters.DeadLetter, j *job, f adapters.Failure) (cut bool, err error) {
	ctx, cancel := context.WithCancelCause(r.handlerCtx)
	defer cancel(nil)
	// The attempt's context, its registration's only other user, ended
	// with the attempt.
	j.d.OnLost(cancel) // at once if the delivery is lost already
	defer j.d.OnLost(nil)
	err = dl.Send(ctx, j.d, f)
	if err == nil || ctx.Err() == nil {
		return false, err
	}
	return errors.Is(err, ctx.Err()) || errors.Is(err, context.Cause(ctx)), err
}

func (r *run) processAtMostOnce(j *job) {
	err := r.call(j, r.attempt(j))
	outcome := outcomeAcked
	if err != nil {
		outcome = outcomeFailed
		r.logs.log(logAtMostOnceFailed, slog.String("id", j.d.ID), slog.Any("error", err))
	}
	r.settle(j, outcome)
	r.next(j)
}

func (r *run) attempt(j *job) int {
	a := j.d.Attempt
	if a < 1 {
		a = 1
	}
	return a + j.retries
}

// call runs one attempt of the handler (see callHandler). An attempt that
// neither returned nor panicked marks j exiting: runtime.Goexit is ending
// the worker, and runLane settles j as it unwinds. Should call return after
// all, the handler's panic(nil) was recovered as nil (GODEBUG panicnil=1):
// a panic like any other, which must not settle j as well.
func (r *run) call(j *job, attempt int) error {
	err := r.callHandler(j, attempt)
	if j.exiting {
		j.exiting = false
		pe := &PanicError{Value: new(runtime.PanicNilError), Stack: debug.Stack()}
		err = pe
		r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
		r.logPanic(j.d, attempt, pe)
	}
	return err
}

// callHandler runs one attempt of the handler with its own context, span
// and panic recovery.
func (r *run) callHandler(j *job, attempt int) (err error) {
	d := j.d
	var (
		m  *Message
		ac *attemptContext
	)
	if j.retries == 0 && j.msg.d == nil {
		m, ac = &j.msg, &j.ctx
		fillMessage(m, d, attempt)
	} else {
		// A handler may still hold the earlier attempt's message and
		// context.
		m = newMessage(d, attempt)
	}
	ctx := r.handlerCtx
	if len(d.Headers) > 0 {
		ctx = r.cfg.propagator.Extract(ctx, headerCarrier(d.Headers))
	}
	var span trace.Span
	if r.tel.spans() {
		ctx, span = r.tel.tracer.Start(ctx, r.spanName, r.tel.spanStartOptions(d, attempt)...)
	}
	ac = startAttempt(ac, ctx, d)
	var hctx context.Context = ac
	if t := r.cfg.handlerTimeout; t > 0 {
		var cancelTimeout context.CancelFunc
		hctx, cancelTimeout = context.WithTimeoutCause(hctx, t, ErrHandlerTimeout)
		defer cancelTimeout()
	}
	// Timed only where the duration can be recorded: two clock reads per
	// attempt are a good part of the cost of a quick handler.
	var start time.Time
	timed := r.tel.timed()
	if timed {
		start = time.Now()
	}
	returned := false
	defer func() {
		p := recover()
		if p != nil {
			pe := &PanicError{Value: p, Stack: debug.Stack()}
			err = pe
			r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
			r.logPanic(d, attempt, pe)
		}
		if p == nil && err != nil {
			var ok bool
			if err, ok = checkedError(err); !ok {
				r.tel.panics.Add(r.settleCtx, 1, r.tel.source...)
				r.logs.log(logErrorPanicked, slog.String("id", d.ID), slog.Int("attempt", attempt), slog.Any("error", err))
			}
		}
		// Neither returned nor panicked: runtime.Goexit is ending this
		// goroutine (or, with GODEBUG panicnil=1, a panic(nil) was
		// recovered as nil: see call).
		exited := p == nil && !returned
		if exited {
			err = ErrHandlerExited
		}
		ac.end()
		// A deferral (consumer.Defer: an overlapping duplicate, say) is no
		// failure of the handler: it is counted and traced apart, so that
		// error rates and error spans show failures only.
		deferred := err != nil && IsDeferred(err)
		unavailable := err != nil && IsUnavailable(err)
		// An attempt the shutdown deadline or its delivery's loss cut
		// short is no failure either (process gives it back, or settles it
		// as lost, without counting one): deploys and rebalances must not
		// show as error rates.
		cut := err != nil && !deferred && (d.LostCause() != nil || r.handlerCtx.Err() != nil)
		res := r.tel.resultOK
		switch {
		case unavailable && !cut:
			res = r.tel.resultUnavailable
		case deferred:
			res = r.tel.resultDeferred
		case cut:
			res = r.tel.resultCancelled
		case err != nil:
			res = r.tel.resultErr
		}
		if timed {
			r.tel.duration.Record(r.settleCtx, time.Since(start).Seconds(), res...)
		}
		if span != nil {
			switch {
			case unavailable && !cut:
				span.AddEvent("unavailable", trace.WithAttributes(attribute.String("custody.reason", err.Error())))
			case deferred:
				span.AddEvent("deferred", trace.WithAttributes(attribute.String("custody.reason", err.Error())))
			case cut:
				span.AddEvent("cancelled", trace.WithAttributes(attribute.String("custody.reason", err.Error())))
			case err != nil:
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			}
			span.End()
		}
		j.exiting = exited
	}()
	err = r.c.handler.Handle(hctx, m)
	returned = true
	return err
}

// checkedError returns err, or a PanicError saying so when err's Error
// method panics, or the Unwrap or As methods the runtime reaches when it
// classifies err (IsPermanent, RetryDelay): it formats and classifies
// handler errors for its logs, spans, retries and dead-letter diagnostics
// outside the handler's recover, where such a panic would crash the
// process. (A typed nil pointer returned as an error, whose methods
// dereference it, is the usual culprit.) Only failed attempts pay for the
// check.
func checkedError(err error) (checked error, ok bool) {
	method := "Error"
	defer func() {
		if p := recover(); p != nil {
			checked, ok = &PanicError{
				Value: fmt.Sprintf("the error it returned (%T) panicked in its %s method: %v", err, method, p),
				Stack: debug.Stack(),
			}, false
		}
	}()
	_ = err.Error()
	method = "Unwrap or As"
	_ = IsPermanent(err)
	_ = IsUnavailable(err)
	_, _ = RetryDelay(err) // IsDeferred walks the same way
	return err, true
}

// handlerExited settles j, whose handler ended its worker with
// runtime.Goexit, as a failed attempt: given back at once (it was acked on
// receipt in at-most-once mode), with the jobs queued behind it in its lane
// given back too, so that the lane keeps its order. The jobs of its lane this
// worker had taken go to another worker; the run replaces the worker itself.
func (r *run) handlerExited(j *job) {
	r.logs.log(logExited, slog.String("id", j.d.ID), slog.Any("error", ErrHandlerExited))
	if j.ackedEarly {
		r.settle(j, outcomeFailed)
		r.next(j)
	} else {
		if j.lane != "" {
			r.giveBackBehind(j, func(*job) bool { return true })
		}
		r.releaseNow(j, whyExited)
	}
	if s := j.successor; s != nil {
		j.successor = nil
		r.work <- s // never blocks: see newRun
	}
}

// wait holds j in place for delay, its lease kept alive. It reports false, and
// settles j, when the wait was cut short by shutdown, a lost lease or a
// recall. A recall ends the wait at once rather than after it: no handler
// runs meanwhile, and the adapter may be waiting for the delivery (a Kafka
// revoke), for as long as a backoff, which can be minutes.
func (r *run) wait(j *job, delay time.Duration) bool {
	t := time.NewTimer(delay)
	defer t.Stop()
	select {
	case <-t.C:
		if !r.draining.Load() {
			return true
		}
		// The drain began as the timer fired, and the select, finding both
		// ready, chose the timer: the retry would start after the drain
		// began, which gives back what has not started.
		r.release(j, whyShutdown)
	case <-j.d.RecallSignal():
		r.releaseNow(j, whyRecalled)
	case <-j.d.Lost():
		r.lost(j, j.d.LostCause())
	case <-r.drainCh:
		r.release(j, whyShutdown)
	case <-r.handlerCtx.Done():
		r.release(j, whyDeadline)
	}
	return false
}

func (r *run) stopLease(j *job) {
	if j.lease != nil {
		j.lease.Stop()
	}
}

// ack stops j's lease and queues its ack; the ack loop settles it.
func (r *run) ack(j *job, outcome string) {
	r.stopLease(j)
	if cause := j.d.LostCause(); errors.Is(cause, adapters.ErrLeaseLost) {
		// The handler finished although its lease was lost meanwhile: the
		// ack is still worth sending (the broker may take it, sparing a
		// duplicate), but the loss happened and is counted.
		r.leaseLost(j, cause)
	} else if cause != nil {
		// Lost for good (a revoked partition, a dead channel, a closed
		// source): the adapter refuses the ack, so sending it would only
		// count an ack failure and warn of a redelivery the loss already
		// explains.
		r.lost(j, cause)
		return
	}
	j.deadLettered = outcome == outcomeDeadLettered
	r.next(j)
	r.enqueueAck(j)
}

// nack stops j's lease and gives it back to be redelivered after delay.
func (r *run) nack(j *job, delay time.Duration, outcome string) {
	r.stopLease(j)
	if err := r.c.src.Nack(r.settleCtx, []*adapters.Delivery{j.d}, delay); err != nil {
		r.nackFailed(j, err)
	}
	r.settle(j, outcome)
	r.next(j)
}

// nackFailed logs a nack that did not reach the broker: nothing is lost, the
// message only waits for the broker to take it back by itself (when its
// lease runs out, or when its channel closes, as on RabbitMQ).
func (r *run) nackFailed(j *job, err error) {
	r.logs.log(logNackFailed, slog.String("id", j.d.ID), slog.Any("error", err))
}

// retriesByNack reports whether j's next attempt should wait at the broker
// (a nack with the delay) rather than in place. It needs delayed redelivery,
// and a delivery count that survives it: without one, the redelivery would
// come back as a first attempt, and a message that always fails would never
// reach MaxAttempts and never leave the stream. Jobs of a lane wait in place,
// so that the lane keeps its order.
func (r *run) retriesByNack(j *job) bool {
	return r.c.caps.NackDelay && r.c.caps.CountsDeliveries && j.lane == ""
}

// giveBack returns a failed delivery during shutdown, keeping its backoff
// where the broker can delay redelivery.
func (r *run) giveBack(j *job, delay time.Duration) {
	if r.c.caps.NackDelay && j.lane == "" {
		if j.d.LostCause() == nil {
			r.logs.log(logGivenBack, slog.String("id", j.d.ID), slog.String("reason", whyShutdown), slog.Duration("retry_in", delay))
		}
		r.nack(j, delay, outcomeRetried)
		return
	}
	r.release(j, whyShutdown)
}

// releaseWaiting gives back, at shutdown, the jobs that wait for a worker,
// at once and in one call, rather than when a worker frees up, which may be
// the whole shutdown timeout away. A job whose lane is busy waits for the
// lane's running job, so that its key's order holds; it is given back as
// soon as that job ends. Called once receiving has stopped, and never in
// at-most-once mode, where every job was acked on receipt and still runs.
func (r *run) releaseWaiting() {
	var waiting []*job
	for {
		var j *job
		select {
		case j = <-r.work:
		default:
		}
		if j == nil {
			break
		}
		if j.lane != "" {
			r.runLane(j) // its lane's queued jobs are given back after it
			continue
		}
		waiting = append(waiting, j)
	}
	if len(waiting) == 0 {
		return
	}
	var give []*job
	for _, j := range waiting {
		switch {
		case j.d.LostCause() != nil:
			r.lost(j, j.d.LostCause())
		case j.d.Recalled():
			r.stopLease(j)
			r.logGivenBack(j, whyRecalled)
			give = append(give, j) // the adapter asked for it: never left
		case r.cfg.leaveOnShutdown:
			r.stopLease(j)
			r.logs.log(logLeft, slog.String("id", j.d.ID))
			r.settle(j, outcomeLeft)
		default:
			r.stopLease(j)
			r.logGivenBack(j, whyShutdown)
			give = append(give, j)
		}
	}
	r.releaseAll(give)
}

// releaseAll gives back, in one call and for immediate redelivery, jobs
// whose leases are stopped and that are no lane's running job: it does not
// pass their lanes on.
func (r *run) releaseAll(give []*job) {
	if len(give) == 0 {
		return
	}
	ds := make([]*adapters.Delivery, len(give))
	for i, j := range give {
		ds[i] = j.d
	}
	err := r.c.src.Nack(r.settleCtx, ds, 0)
	for i, j := range give {
		if e := adapters.EntryError(err, i); e != nil {
			r.nackFailed(j, e)
		}
		r.settle(j, outcomeReleased)
	}
}

// release gives j back for immediate redelivery (shutdown), or leaves it to
// its lease with WithLeaveUnfinishedOnShutdown. why says what gave it back,
// for the log.
func (r *run) release(j *job, why string) {
	// A recalled delivery is never left: the adapter waits for it.
	if r.cfg.leaveOnShutdown && j.d.LostCause() == nil && !j.d.Recalled() {
		r.stopLease(j)
		r.logs.log(logLeft, slog.String("id", j.d.ID))
		r.settle(j, outcomeLeft)
		r.next(j)
		return
	}
	if j.d.Recalled() {
		why = whyRecalled
	}
	r.releaseNow(j, why)
}

// releaseNow gives j back for immediate redelivery. why says what gave it
// back, for the log.
func (r *run) releaseNow(j *job, why string) {
	if cause := j.d.LostCause(); cause != nil {
		r.lost(j, cause)
		return
	}
	r.logGivenBack(j, why)
	r.nack(j, 0, outcomeReleased)
}

// lost settles a delivery this consumer can no longer ack.
//
// The jobs queued behind it in its lane and received before it was lost are
// given back rather than run: the lost message comes back later, and running
// them first would break the lane's order. (An SQS FIFO group, for one,
// delivers the lost message again only once the later ones this consumer
// holds are settled.) The jobs received after the loss are run: they are
// the lane as the broker delivers it again, the lost message's redelivery
// first (a Kafka partition revoked and assigned back to this member while
// the lost record's handler still ran). Given back too, they came back after
// records fetched later still, which then ran first.
func (r *run) lost(j *job, cause error) {
	r.stopLease(j)
	if errors.Is(cause, adapters.ErrLeaseLost) {
		r.leaseLost(j, cause)
	} else {
		r.logs.log(logLost, slog.String("id", j.d.ID), slog.Any("cause", cause))
	}
	r.settle(j, outcomeLost)
	if j.lane != "" {
		r.giveBackBehind(j, r.receivedBefore(j, j.d.LostAt()))
	}
	r.next(j)
}

// giveBackBehind marks the jobs of j's lane queued behind it for which
// behind holds to be given back instead of run.
func (r *run) giveBackBehind(j *job, behind func(*job) bool) {
	for s := j.successor; s != nil; s = s.successor {
		s.giveBack = s.giveBack || behind(s) // taken with j by this worker (see next)
	}
	r.lanesMu.Lock()
	for _, q := range r.lanes[j.lane] {
		q.giveBack = q.giveBack || behind(q)
	}
	r.lanesMu.Unlock()
}

// receivedBefore reports, for j lost at lostAt, which jobs were received
// before the loss, or with j: a delivery the adapter handed over already
// lost (an SQS message whose visibility ran out while it waited in the
// Source) is behind the others of its batch still. Every job is, when the
// time is unknown.
func (r *run) receivedBefore(j *job, lostAt time.Time) func(*job) bool {
	if lostAt.IsZero() {
		return func(*job) bool { return true }
	}
	cut := max(lostAt.Sub(r.started), j.accepted)
	return func(q *job) bool { return q.accepted <= cut }
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
	r.tel.leasesLost.Add(r.settleCtx, 1, r.tel.source...)
	r.logs.log(logLeaseLost, slog.String("id", j.d.ID), slog.Any("cause", cause))
}
