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

// process runs one step of j's custody: a handler attempt, or a retry of
// its dead-letter write, and what follows from it. A job that must wait
// before its next step (a retry in place, a dependency outage, a failed
// dead-letter write) is parked: it leaves the worker, and comes back to
// process when its wait ends (see park). process reports whether it parked
// j; the caller must then not touch j, which another worker may already
// run.
func (r *run) process(j *job) (parked bool) {
	if j.ackedEarly {
		// Acked on receipt: it can no longer be given back, even during
		// shutdown, so handling it is its only chance.
		r.processAtMostOnce(j)
		return false
	}
	if run, parked := r.prepare(j); !run {
		return parked
	}
	return r.attemptOnce(j)
}

// prepare settles j, or runs its dead-letter write, when j is not to be
// handled now; it reports whether j's handler should run, and, when not,
// whether j was parked.
func (r *run) prepare(j *job) (run, parked bool) {
	if j.recalled() {
		// The adapter wants it back before it runs again (its Kafka
		// partition is being revoked): given back at once, even at
		// shutdown with WithLeaveUnfinishedOnShutdown, since the adapter
		// waits for it.
		r.settle(j, released(whyRecalled))
		return false, false
	}
	if r.draining.Load() {
		// Not started, or waiting to run again, once shutdown began: give
		// it back at once. A message waiting for a retry keeps its backoff
		// where the broker can hold it back.
		if j.waitsToRetry() {
			r.settle(j, r.givenBack(j, j.fail.retryIn))
			return false, false
		}
		r.settle(j, released(whyShutdown))
		return false, false
	}
	if j.giveBack {
		// Queued behind a lost message of its lane: give it back at once,
		// even with WithLeaveUnfinishedOnShutdown, which is about shutdown.
		// Left to its lease it would hold up the lost message's group (an
		// SQS FIFO group) until that lease ran out.
		r.settle(j, released(whyBehindLost))
		return false, false
	}
	if j.lostCause() != nil {
		// Lost while it waited (a revoked partition, a dead channel):
		// running the handler now would only repeat the new owner's work.
		r.settle(j, verdict{how: settleLost})
		return false, false
	}
	if r.keeper == nil && !time.Now().Before(r.holdEnd(j)) {
		// Held for the maximum processing time without a lease to lose:
		// given back, before the broker's own limit (RabbitMQ's consumer
		// timeout closes the channel) takes every delivery of the channel.
		r.settle(j, released(whyMaxHold))
		return false, false
	}
	if j.deadLettering() {
		return false, r.deadLetter(j)
	}
	if r.c.intake.givingBack() {
		// Paused with GiveBackWaiting: what has not started goes back.
		r.settle(j, released(whyPaused))
		return false, false
	}
	if k := r.kill; k != nil {
		if !k.admit() {
			// The kill switch is open (or its probes are taken): the job
			// waits, its lease kept alive, using up no attempt, until the
			// switch lets it run.
			j.heldBySwitch = true
			r.park(j, k.cfg.Cooldown)
			return false, true
		}
		j.heldBySwitch = false
	}
	return true, false
}

// attemptOnce runs one attempt of j's handler and settles or parks j by its
// outcome.
func (r *run) attemptOnce(j *job) (parked bool) {
	attempt := r.attempt(j)
	return r.afterAttempt(j, attempt, r.call(j, attempt))
}

// afterAttempt settles or parks j, whose attempt number attempt ended with
// err.
func (r *run) afterAttempt(j *job, attempt int, err error) (parked bool) {
	if r.kill != nil && (err == nil || j.lostCause() == nil && r.handlerCtx.Err() == nil) {
		r.kill.record(err)
	}
	if err == nil {
		r.settle(j, verdict{how: settleAck})
		return false
	}
	if j.lostCause() != nil {
		r.settle(j, verdict{how: settleLost})
		return false
	}
	if r.handlerCtx.Err() != nil {
		// The shutdown deadline cut the handler short: not the message's
		// fault, so it neither counts as a failure nor waits a backoff.
		r.settle(j, released(whyDeadline))
		return false
	}
	if IsUnavailable(err) {
		// A dependency's fault, not the message's: no attempt is used up,
		// and the message waits here rather than at the broker, whose
		// delivery count a redelivery would raise.
		f := j.failed()
		f.unavailable++
		delay := r.retryDelay(err, f.unavailable)
		r.tel.unavailable.Add(r.settleCtx, 1, r.tel.source...)
		r.logs.log(logUnavailable, slog.String("id", j.d.ID), slog.Int("waits", f.unavailable),
			slog.Duration("retry_in", delay), slog.Any("error", err))
		// Not kept as a failure to give back with its delay at shutdown:
		// the wait's delay can be longer than the lease, and whether the
		// handler returned just before the drain or just after must not
		// decide whether the broker hides the message for it.
		f.err = nil
		r.park(j, delay)
		return true
	}
	if j.fail != nil {
		j.fail.unavailable = 0
	}
	now := time.Now()
	deferred := IsDeferred(err)
	delay := r.retryDelay(err, attempt)
	if IsPermanent(err) || (attempt >= r.cfg.retry.MaxAttempts && !deferred) {
		if done, parked := r.exhausted(j, err, attempt, now, delay); done {
			return parked
		}
		// No dead-letter destination and no way to give the message back:
		// keep trying the handler in place, at the backoff's pace, rather
		// than drop it.
	}
	if r.draining.Load() {
		r.settle(j, r.givenBack(j, delay))
		return false
	}
	byNack := r.retriesByNack(j)
	r.logRetry(j, err, attempt, delay, deferred, byNack)
	if byNack {
		// The broker holds the message for the delay; no worker waits.
		r.settle(j, verdict{how: settleRetry, after: delay})
		return false
	}
	f := j.failed()
	f.noteFirst(now, deferred)
	if !deferred {
		f.retries++
	}
	f.err, f.retryIn = err, delay
	r.park(j, delay)
	return true
}

// retryDelay is the wait before the next attempt after err, retry number n:
// the delay err asks for (RetryAfter, Defer), else the policy's backoff.
// Either is floored at minBackoff: a deferral has no attempt limit, so
// Defer(err, time.Nanosecond) would otherwise come back at once, for ever.
func (r *run) retryDelay(err error, n int) time.Duration {
	d, ok := RetryDelay(err)
	if !ok || d <= 0 {
		d = r.cfg.retry.Backoff.Delay(n)
	}
	return max(d, minBackoff)
}

// exhausted dead-letters j, which failed for good with err on attempt
// number attempt. It reports whether j was settled or parked (done), and
// whether it was parked. Without a dead-letter destination the message is
// given back after retry, the delay of the handler's next attempt (one
// more retry: a RetryAfter holds); not done means the broker cannot take
// it back with a delay, so the caller goes on retrying the handler.
func (r *run) exhausted(j *job, err error, attempt int, now time.Time, retry time.Duration) (done, parked bool) {
	if r.cfg.deadLetter == nil {
		r.logs.log(logNoDeadLetter, slog.String("id", j.d.ID), slog.String("reason", failureReason(err)),
			slog.Int("attempts", attempt), slog.Duration("retry_in", retry), slog.Any("error", err))
		if r.c.caps.NackDelay && j.lane == "" {
			r.settle(j, verdict{how: settleExhausted, after: retry})
			return true, false
		}
		return false, false
	}
	f := j.failed()
	f.noteFirst(now, IsDeferred(err))
	f.deadLettering = true
	f.err, f.failedAttempt, f.last = err, attempt, now
	return true, r.deadLetter(j)
}

// deadLetter writes j's dead-letter copy and acks the original once the
// destination confirmed it. A failed write parks j, to be tried again after
// a backoff, even where the broker could hold the message back: a
// redelivery would run the handler again and raise the broker's delivery
// count, and a parked job keeps its place in the in-flight window, so an
// outage of the destination slows intake.
func (r *run) deadLetter(j *job) (parked bool) {
	dl := r.cfg.deadLetter
	jf := j.fail // set by exhausted
	err, attempt := jf.err, jf.failedAttempt
	f := adapters.Failure{
		Err:          err,
		Permanent:    IsPermanent(err),
		Attempts:     attempt,
		FirstFailure: jf.first,
		LastFailure:  jf.last,
		Consumer:     r.cfg.name,
	}
	if attempt > jf.retries+1 && !j.d.FirstReceivedAt.IsZero() {
		// Earlier attempts ran before this delivery: the broker's first
		// receive is the best bound on the first failure we have.
		f.FirstFailure = j.d.FirstReceivedAt
	}
	cut, sendErr := r.sendDeadLetter(dl, j, f)
	if sendErr == nil {
		r.deadLettersMin.add(time.Now(), 1)
		r.logs.log(logDeadLettered, slog.String("id", j.d.ID), slog.String("reason", failureReason(err)),
			slog.Int("attempts", attempt), slog.Any("error", err))
		if os, ok := dl.(adapters.OriginalSettler); ok && os.SettlesOriginal(j.d) {
			r.settle(j, verdict{how: settleDisposed})
			return false
		}
		r.settle(j, verdict{how: settleDeadLettered})
		return false
	}
	jf.deadLetterTries++
	delay := backoffDelay(r.cfg.retry.Backoff, attempt+jf.deadLetterTries-1)
	// A write the shutdown deadline or the delivery's loss cut short says
	// nothing about the destination: the consumer stopped waiting for it.
	// Counted, it would report a dead-letter outage on every such shutdown.
	if !cut {
		r.tel.dlqFailures.Add(r.settleCtx, 1, r.tel.source...)
	}
	if j.lostCause() != nil {
		// Not kept: the delivery is gone (its lease, or a release the
		// failed write had already sent, as SQS's redrive does), and the
		// broker brings the message back.
		kind := logDeadLetterLost
		if cut {
			kind = logDeadLetterCutLost
		}
		r.logs.log(kind, slog.String("id", j.d.ID), slog.Any("error", sendErr))
		r.settle(j, verdict{how: settleLost})
		return false
	}
	if cut {
		r.logs.log(logDeadLetterCut, slog.String("id", j.d.ID), slog.Any("error", sendErr))
		r.settle(j, r.givenBack(j, delay))
		return false
	}
	r.logs.log(logDeadLetterFailed, slog.String("id", j.d.ID), slog.Any("error", sendErr), slog.Duration("retry_in", delay))
	jf.retryIn = delay
	r.park(j, delay)
	return true
}

// sendDeadLetter writes j's dead-letter copy with a context that ends, with
// the loss as its cause, if the delivery is lost meanwhile, as a handler's
// does: the broker hands the message out again, and a copy written after
// that would sit beside whatever the new holder does with it. It reports
// whether a failed write was cut short: it failed with its context's error
// (the loss, or the shutdown deadline), not for a reason of the
// destination's own.
func (r *run) sendDeadLetter(dl adapters.DeadLetter, j *job, f adapters.Failure) (cut bool, err error) {
	ctx, cancel := context.WithCancelCause(r.handlerCtx)
	defer cancel(nil)
	// The attempt's context, its registration's only other user, ended
	// with the attempt.
	j.d.Signal.OnLost(cancel) // at once if the delivery is lost already
	defer j.d.Signal.OnLost(nil)
	err = dl.Send(ctx, j.d, f)
	if err == nil || ctx.Err() == nil {
		return false, err
	}
	return errors.Is(err, ctx.Err()) || errors.Is(err, context.Cause(ctx)), err
}

func (r *run) processAtMostOnce(j *job) {
	err := r.call(j, r.attempt(j))
	how := settleHandled
	if err != nil {
		how = settleFailed
		r.logs.log(logAtMostOnceFailed, slog.String("id", j.d.ID), slog.Any("error", err))
	}
	r.settle(j, verdict{how: how})
}

func (r *run) attempt(j *job) int {
	a := j.d.Attempt
	if a < 1 {
		a = 1
	}
	return a + j.retries()
}

// call runs one attempt of the handler (see callHandler). An attempt that
// neither returned nor panicked marks j exiting: runtime.Goexit is ending
// the worker, and runLane settles j as it unwinds. Should call return after
// all, the handler's panic(nil) was recovered as nil (GODEBUG panicnil=1):
// a panic like any other, which must not settle j as well.
func (r *run) call(j *job, attempt int) error {
	r.running.Add(1)
	err := r.callHandler(j, attempt)
	r.running.Add(-1)
	if j.exiting {
		j.exiting = false
		err = r.panicked(j.d, attempt, new(runtime.PanicNilError))
	}
	return err
}

// callHandler runs one attempt of the handler with its own context, span
// and panic recovery.
func (r *run) callHandler(j *job, attempt int) (err error) {
	d := j.d
	m, ac := &j.msg, &j.ctx
	if j.retries() > 0 || j.msg.d != nil {
		// A handler may still hold the earlier attempt's message and
		// context.
		m, ac = new(Message), nil
	}
	fillMessage(m, d, attempt)
	ctx := r.handlerCtx
	if len(d.Headers) > 0 {
		ctx = r.cfg.propagator.Extract(ctx, headerCarrier(d.Headers))
	}
	var span trace.Span
	if r.tel.spans() {
		ctx, span = r.tel.tracer.Start(ctx, r.spanName, r.tel.spanStartOptions(d, attempt)...)
	}
	ac = startAttempt(ac, ctx, d)
	hctx, stopTimeout := r.withHandlerTimeout(ac)
	defer stopTimeout()
	start := r.tel.clock()
	returned := false
	defer func() {
		p := recover()
		if p != nil {
			err = r.panicked(d, attempt, p)
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
		// A deferral (consumer.Defer: an overlapping duplicate, say) is
		// recorded as one even when cut short.
		cut := err != nil && (j.lostCause() != nil || r.handlerCtx.Err() != nil) && !IsDeferred(err)
		res := attemptResult(err, cut)
		if !start.IsZero() {
			r.tel.duration.Record(r.settleCtx, time.Since(start).Seconds(), r.tel.results[res]...)
		}
		if span != nil {
			switch res {
			case resultOK:
			case resultError:
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
			default:
				span.AddEvent(resultNames[res], trace.WithAttributes(attribute.String("custody.reason", err.Error())))
			}
			span.End()
		}
		j.exiting = exited
	}()
	err = r.c.handler.Handle(hctx, m)
	returned = true
	return err
}

// withHandlerTimeout bounds ctx by WithHandlerTimeout, if one is set; stop
// must be called once the attempt ends.
func (r *run) withHandlerTimeout(ctx context.Context) (_ context.Context, stop context.CancelFunc) {
	if t := r.cfg.handlerTimeout; t > 0 {
		return context.WithTimeoutCause(ctx, t, ErrHandlerTimeout)
	}
	return ctx, func() {}
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
		r.settle(j, verdict{how: settleFailed})
	} else {
		if j.lane != "" {
			r.giveBackBehind(j, func(*job) bool { return true })
		}
		r.settle(j, released(whyExited))
	}
	if s := j.successor; s != nil {
		j.successor = nil
		r.work <- s // never blocks: see newRun
	}
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

// givenBack is the verdict for a failed message given back during the
// drain: redelivered after its backoff where the broker can delay a
// redelivery and the message is in no lane, given back at once otherwise.
func (r *run) givenBack(j *job, delay time.Duration) verdict {
	if r.c.caps.NackDelay && j.lane == "" {
		if j.lostCause() == nil {
			r.logs.log(logGivenBack, slog.String("id", j.d.ID), slog.String("reason", whyShutdown.String()), slog.Duration("retry_in", delay))
		}
		return verdict{how: settleRetry, after: delay}
	}
	return released(whyShutdown)
}
