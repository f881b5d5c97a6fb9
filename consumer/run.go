package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/backoff"
	"github.com/custody-go/custody/lease"
	"go.opentelemetry.io/otel/trace"
)

// run is the state of one Run call.
type run struct {
	c    *Consumer
	cfg  *config
	tel  *telemetry
	logs *logLimiter

	handlerCtx     context.Context // lives until the shutdown deadline
	cancelHandlers context.CancelCauseFunc
	settleCtx      context.Context // for acks and nacks; lives until Run returns

	keeper   *lease.Keeper
	credit   *credit // bounds held deliveries
	held     sync.WaitGroup
	work     chan *job
	acks     *batcher
	nacks    *batcher
	draining atomic.Bool
	// queuedFree is set when the jobs queued behind their lane's running
	// job are kept out of the in-flight window (see credit), for a source
	// whose queued deliveries cost the broker nothing
	// (Capabilities.FreeWhileQueued).
	queuedFree bool

	lanesMu sync.Mutex
	lanes   map[string][]*job // queued behind the running job of each lane
	// spareQueues are emptied lane queues kept for reuse (see popFront).
	spareQueues [][]*job
	parking     parking   // jobs waiting, without a worker, to run again
	started     time.Time // the origin of job.accepted

	spanName      string
	batchSpanName string

	// For Status.
	lastReceive    atomic.Int64 // unix ns
	lastAck        atomic.Int64
	receivingSince atomic.Int64 // unix ns of the oldest Receive under way, 0 if none
	received       atomic.Bool  // a Receive returned without error
	running        atomic.Int64 // handler calls under way
	holding        atomic.Int64 // deliveries held
	leasesLostMin  minuteCount
	deadLettersMin minuteCount
	backlog        atomic.Pointer[backlogReading]
	kill           *killSwitch

	// recalledOnArrival wakes the recall loop (see recall.go); nil when the
	// source reports no recalls.
	recalledOnArrival chan struct{}
}

// job is one held delivery. Jobs are allocated a received batch at a
// time, so every byte here is paid per message: what only a failed attempt
// needs lives in failures, made by the first failure that has to be kept.
type job struct {
	d         *adapters.Delivery
	lease     *lease.Lease   // nil without a lease keeper
	msg       Message        // the first attempt's message, allocated with the job
	ctx       attemptContext // the first attempt's context, likewise
	lane      string
	successor *job          // the lane's next job, once this one is done
	accepted  time.Duration // when it was received, since run.started
	fail      *failures     // nil until an attempt failed and the job was kept
	// settling and settleAfter are the verdict whose broker call is under
	// way (an ack or a nack in a batch), kept apart so that settling packs
	// with the flags below.
	settleAfter time.Duration
	settling    settlement
	ackedEarly  bool // at-most-once mode
	// queued is set while the job waits in its lane's queue (run.lanes),
	// behind the lane's running job; such a job does not hold its lane,
	// and with run.queuedFree it is counted outside the in-flight window.
	queued bool
	// batched is set while a batch settles the job: the batch, not the
	// job's settlement, passes its lane on and queues its ack. Cleared
	// when the batch is done with the job, or parks it.
	batched bool
	// heldBySwitch is set while the job waits for the kill switch to let
	// it run.
	heldBySwitch bool
	// giveBack is set on the jobs queued behind a lost one in its lane:
	// they are given back instead of run (see settle).
	giveBack bool
	// leaseLostCounted is set once the job's lost lease was counted.
	leaseLostCounted bool
	// exiting is set while the job's handler ends its worker with
	// runtime.Goexit (see call).
	exiting bool
}

// failures is what a job keeps of its failed attempts while it waits in
// place (parked) to run or to be dead-lettered again. Only the job's
// current holder reads or writes it, as the job's other fields.
type failures struct {
	retries     int       // in-place retries so far
	unavailable int       // consecutive attempts that found a dependency unavailable
	first       time.Time // the first failed attempt, deferrals aside
	// err is the error of the failed attempt the job waits to retry (or to
	// dead-letter), nil while it waits out an outage; retryIn is its
	// backoff, kept if the drain gives it back.
	err     error
	retryIn time.Duration
	// deadLettering is set once the job failed for good and its
	// dead-letter write is due (again, after deadLetterTries failed ones);
	// failedAttempt and last describe the failure for the copy.
	deadLettering   bool
	deadLetterTries int
	failedAttempt   int
	last            time.Time
}

// noteFirst records now as the first failure, unless one is recorded or
// the attempt was deferred (consumer.Defer), which is no failure of the
// message's.
func (f *failures) noteFirst(now time.Time, deferred bool) {
	if f.first.IsZero() && !deferred {
		f.first = now
	}
}

// failed returns j's failures, made on first use.
func (j *job) failed() *failures {
	if j.fail == nil {
		j.fail = new(failures)
	}
	return j.fail
}

// retries returns the in-place retries j had so far.
func (j *job) retries() int {
	if j.fail == nil {
		return 0
	}
	return j.fail.retries
}

// waitsToRetry reports whether j is parked after a failed attempt, to run
// again (or to be dead-lettered) once its backoff ends.
func (j *job) waitsToRetry() bool { return j.fail != nil && j.fail.err != nil }

// deadLettering reports whether j's dead-letter write is due.
func (j *job) deadLettering() bool { return j.fail != nil && j.fail.deadLettering }

// The delivery's loss and recall, as its adapter, or the runtime, reports
// them (see giveSignals).
func (j *job) lostCause() error  { return j.d.Signal.LostCause() }
func (j *job) lostAt() time.Time { return j.d.Signal.LostAt() }
func (j *job) recalled() bool    { return j.d.Signal.Recalled() }

func newRun(c *Consumer, ctx context.Context) *run {
	base := context.WithoutCancel(ctx)
	// Handlers start from Run's context without its span context: Run's
	// context lives as long as the consumer, and a span in it, local or
	// remote (a batch job continuing the trace it was started in), would
	// otherwise parent every message that carries no trace context of its
	// own. Such a message starts a trace of its own.
	hctx, cancel := context.WithCancelCause(trace.ContextWithSpanContext(base, trace.SpanContext{}))
	r := &run{
		c:              c,
		cfg:            &c.cfg,
		tel:            c.tel,
		logs:           newLogLimiter(base, c.cfg.logger, c.cfg.name),
		handlerCtx:     hctx,
		cancelHandlers: cancel,
		settleCtx:      base,
		credit:         newCredit(c.cfg.maxInFlight, queuedBound(c.caps), c.batch),
		queuedFree:     c.caps.FreeWhileQueued,
		// Never full: it holds jobs without a lane and at most one job per
		// busy lane. A lane becomes busy only with a job the receiver took
		// room in the window for, and stays busy only while one of its
		// jobs is in the window (a queued job re-enters it when it is taken
		// to run), so there are never more of both than maxInFlight. The
		// slack absorbs an adapter that returns more deliveries than
		// asked, so a worker handing on its lane's next job never blocks.
		work:          make(chan *job, 2*c.cfg.maxInFlight),
		lanes:         make(map[string][]*job),
		started:       time.Now(),
		spanName:      "process " + c.cfg.name,
		batchSpanName: "process batch " + c.cfg.name,
	}
	// An ack batch is at most a receive batch: a full one frees room for
	// the receiver's next Receive (see credit), so the two overlap.
	ack := c.caps.Ack
	ack.MaxEntries = boundedBatch(ack.MaxEntries, c.batch)
	r.acks = newBatcher(ack, r.ackCall)
	nack := c.caps.Nack
	nack.MaxEntries = boundedBatch(nack.MaxEntries, c.batch)
	r.nacks = newBatcher(nack, r.nackCall)
	if k := c.cfg.killSwitch; k != nil {
		r.kill = newKillSwitch(*k, r)
	}
	return r
}

// queuedBound is the bound on every delivery held, the in-flight window's
// and those queued behind their lanes, when the latter are kept out of the
// window (Capabilities.FreeWhileQueued): the source's MaxUnacked. Zero
// when they are not, and the window bounds them all.
func queuedBound(caps adapters.Capabilities) int {
	if caps.FreeWhileQueued {
		return caps.MaxUnacked
	}
	return 0
}

// boundedBatch is limit, an adapter's batch limit (0: none), cut to n.
func boundedBatch(limit, n int) int {
	if limit > 0 && limit < n {
		return limit
	}
	return n
}

func (r *run) run(ctx context.Context) error {
	var keeperWG, workersWG sync.WaitGroup
	keeperCtx, stopKeeper := context.WithCancel(r.settleCtx)
	defer stopKeeper()
	if r.c.ext != nil {
		ext := r.c.caps.Extend
		k, err := lease.New(r.c.ext, lease.Config{
			Lease:    r.c.caps.Lease,
			Fraction: r.cfg.leaseFraction,
			MaxBatch: ext.MaxEntries,
			Parallel: ext.MaxCalls,
			MaxHold:  r.cfg.maxProcessing,
			Renewed:  func(n int) { r.tel.extensions.Add(r.settleCtx, int64(n), r.tel.source...) },
			Retrying: func(n int, err error) {
				r.tel.renewFails.Add(r.settleCtx, int64(n), r.tel.source...)
				r.logs.log(logRenewalFailed, slog.Int("leases", n), slog.Any("error", err))
			},
			// Lost leases are counted and logged by settle, which sees them
			// all: the keeper does not report a lease the adapter lost by
			// itself, once the runtime has stopped it.
		})
		if err != nil {
			return fmt.Errorf("consumer: lease keeper: %w", err)
		}
		r.keeper = k
		keeperWG.Add(1)
		go func() { defer keeperWG.Done(); k.Run(keeperCtx) }()
	}
	r.tel.announce(r.settleCtx)
	var pollWG sync.WaitGroup
	if br, ok := r.c.src.(adapters.BacklogReporter); ok {
		pollWG.Add(1)
		go func() { defer pollWG.Done(); r.pollBacklog(keeperCtx, br) }()
	}
	for i := 0; i < r.cfg.concurrency; i++ {
		if r.c.batchHandler != nil {
			r.startBatchWorker(&workersWG)
		} else {
			r.startWorker(&workersWG)
		}
	}

	stopRecalls := r.startRecalls()
	received, drained := make(chan struct{}), make(chan struct{})
	var deadlineWG sync.WaitGroup
	deadlineWG.Add(1)
	go func() { defer deadlineWG.Done(); r.enforceShutdownDeadline(ctx, received, drained) }()
	recvErr := r.receive(ctx)
	close(received)
	stopRecalls()

	// Drain.
	r.c.state.Store(int32(StateDraining))
	r.draining.Store(true)
	r.unparkAll(func(*job) bool { return true })
	if !r.cfg.atMostOnce {
		r.releaseWaiting()
	}
	r.held.Wait()
	close(drained)
	deadlineWG.Wait()
	close(r.work)
	workersWG.Wait()
	r.acks.close()
	r.nacks.close()
	if r.kill != nil {
		r.kill.stop()
	}
	stopKeeper()
	keeperWG.Wait()
	pollWG.Wait()
	r.logs.flush() // nothing of the run logs any more
	r.cancelHandlers(context.Canceled)
	if err := r.c.src.Close(); err != nil {
		return errors.Join(recvErr, fmt.Errorf("consumer: closing source: %w", err))
	}
	return recvErr
}

// enforceShutdownDeadline cancels the running handlers once the shutdown
// timeout has passed since the shutdown began, or Shutdown's context ended,
// unless drained is closed first. The shutdown begins when ctx ends, or when
// received is closed (the receiver stopped by itself: the source closed),
// not when the receiver returns: a Receive may not end at once when ctx
// does (franz-go blocks a poll while a rebalance is under way, and a
// revoke waits for the running handlers), and the deadline must not wait
// for it.
func (r *run) enforceShutdownDeadline(ctx context.Context, received, drained <-chan struct{}) {
	select {
	case <-ctx.Done():
	case <-received:
	}
	timer := time.NewTimer(r.cfg.shutdownTimeout)
	defer timer.Stop()
	select {
	case <-drained:
	case <-timer.C:
		r.logs.logger.Warn("custody: shutdown timeout reached; cancelling the handlers still running, whose messages are given back",
			"timeout", r.cfg.shutdownTimeout)
		r.cancelHandlers(ErrShutdownTimeout)
	case <-r.c.cut.Done():
		r.logs.logger.Warn("custody: Shutdown's context ended; cancelling the handlers still running, whose messages are given back")
		r.cancelHandlers(ErrShutdownTimeout)
	}
}

// receive runs the receivers until ctx is done or the source is closed: as
// many as the adapter allows at once (Capabilities.Receivers), each asking
// for what the in-flight window has room for.
func (r *run) receive(ctx context.Context) error {
	n := max(r.c.caps.Receivers, 1)
	if n == 1 {
		return r.receiveLoop(ctx)
	}
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			err := r.receiveLoop(ctx)
			if err != nil {
				stop() // the source is closed: the others stop too
			}
			errs <- err
		}()
	}
	var err error
	for i := 0; i < n; i++ {
		if e := <-errs; e != nil && err == nil {
			err = e
		}
	}
	return err
}

// receiveLoop fills free room in the window from the source until ctx is
// done or the source is closed.
func (r *run) receiveLoop(ctx context.Context) error {
	bo := backoff.Exponential{Initial: 50 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.5}
	failures := 0
	var heads []*job // dispatchLaned's scratch
	var gated gatedContext
	defer gated.release()
	for {
		if ctx.Err() != nil {
			// Shutdown began: ask for nothing more. The contract has
			// Receive hand out nothing once its context is done, but a
			// source that kept to it only loosely would start new
			// handlers after shutdown began: the check costs nothing.
			return nil
		}
		if !r.c.intake.wait(ctx) {
			return nil
		}
		n, ok := r.credit.acquire(ctx)
		if !ok {
			return nil
		}
		if !r.c.intake.wait(ctx) { // paused while waiting for room
			r.credit.release(n)
			return nil
		}
		r.receivingSince.CompareAndSwap(0, time.Now().UnixNano())
		rctx := r.c.intake.receiveContext(ctx, &gated)
		r.c.intake.beginReceive()
		ds, err := r.c.src.Receive(rctx, n)
		r.c.intake.endReceive()
		r.receivingSince.Store(0)
		// Keep what was used (more, if an adapter returned more than asked).
		r.credit.release(n - len(ds))
		if len(ds) > 0 {
			storeNow(&r.lastReceive)
			heads = r.accept(ds, heads)
			r.noteRecalledOnArrival(ds)
		}
		switch {
		case err == nil:
			r.received.Store(true)
			failures = 0
		case ctx.Err() != nil:
			return nil
		case rctx.Err() != nil:
			// Paused: the gate ended the Receive.
		case errors.Is(err, adapters.ErrClosed):
			return fmt.Errorf("consumer: source closed while receiving: %w", err)
		case len(ds) > 0:
			// A partial failure (one partition's error among others'
			// records): say so, but do not slow the rest down.
			r.logs.log(logReceivePartial, slog.Any("error", err), slog.Int("deliveries", len(ds)))
			failures = 0
		default:
			failures++
			delay := bo.Delay(failures)
			r.logs.log(logReceiveFailed, slog.Any("error", err), slog.Int("failures", failures), slog.Duration("retry_in", delay))
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return nil
			}
		}
	}
}

// accept takes custody of ds: it starts their leases and hands them to the
// workers, or to their lanes. heads is scratch for dispatchLaned, returned
// for the next call.
func (r *run) accept(ds []*adapters.Delivery, heads []*job) []*job {
	ctx := r.settleCtx
	r.held.Add(len(ds))
	r.holding.Add(int64(len(ds)))
	r.tel.received.Add(ctx, int64(len(ds)), r.tel.source...)
	r.tel.inFlight.Add(ctx, int64(len(ds)), r.tel.source...)
	r.giveSignals(ds)
	if r.cfg.atMostOnce {
		ds = r.ackOnReceipt(ds)
	}
	// One allocation for the batch's jobs, not one per job: the batch's
	// memory lives until its last job is settled, which the in-flight bound
	// keeps small.
	jobs := make([]job, len(ds))
	if r.keeper != nil && !r.cfg.atMostOnce {
		// Leases are tracked before any job is dispatched, so a job that
		// finishes at once never stops a lease that was not started. They
		// are allocated apart from the jobs, so that sources without leases
		// do not pay for them.
		leases := make([]lease.Lease, len(ds))
		r.keeper.StartAll(func(yield func(*lease.Lease, *adapters.Delivery) bool) {
			for i, d := range ds {
				jobs[i].lease = &leases[i]
				if !yield(&leases[i], d) {
					return
				}
			}
		})
	}
	redelivered, laned := 0, false
	accepted := time.Since(r.started)
	for i, d := range ds {
		if d.Attempt > 1 {
			redelivered++
		}
		j := &jobs[i]
		j.d, j.ackedEarly, j.accepted = d, r.cfg.atMostOnce, accepted
		switch {
		case d.OrderingKey != "":
			j.lane = d.OrderingKey
		case r.cfg.ordering == OrderByKey && d.Key != "":
			j.lane = keyLanePrefix + d.Key
		}
		laned = laned || j.lane != ""
	}
	if redelivered > 0 {
		r.tel.redelivered.Add(ctx, int64(redelivered), r.tel.source...)
	}
	if !laned {
		for i := range jobs {
			r.work <- &jobs[i] // never blocks: see newRun
		}
		return heads
	}
	return r.dispatchLaned(jobs, heads)
}

// ackOnReceipt acks ds before any handler runs (at-most-once mode) and
// returns those whose ack succeeded. Whatever failed to ack comes back;
// handling it now as well would be at-least-once, which this mode promised
// not to be: it is left to its lease.
func (r *run) ackOnReceipt(ds []*adapters.Delivery) []*adapters.Delivery {
	err := r.c.src.Ack(r.settleCtx, ds)
	if err == nil {
		return ds
	}
	kept := ds[:0:0]
	for i, d := range ds {
		if e := adapters.EntryError(err, i); e != nil {
			r.tel.ackFailures.Add(r.settleCtx, 1, r.tel.source...)
			r.logs.log(logEarlyAckFailed, slog.String("id", d.ID), slog.Any("error", e))
			r.settle(&job{d: d}, verdict{how: settleLeave})
			continue
		}
		kept = append(kept, d)
	}
	return kept
}

// giveSignals gives the deliveries of ds that have no Signal one of the
// runtime's own, allocated together: the lease keeper and the handler's
// context need one for every delivery, and most adapters lose deliveries
// only through results, so they leave it nil.
func (r *run) giveSignals(ds []*adapters.Delivery) {
	n := 0
	for _, d := range ds {
		if d.Signal == nil {
			n++
		}
	}
	if n == 0 {
		return
	}
	sigs := make([]adapters.Signal, n)
	for _, d := range ds {
		if d.Signal == nil {
			d.Signal = &sigs[len(sigs)-n]
			n--
		}
	}
}
