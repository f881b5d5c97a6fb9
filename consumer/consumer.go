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

// Consumer runs a Handler over a Source. Create it with New and start it with
// Run. A Consumer runs once.
type Consumer struct {
	src     adapters.Source
	ext     adapters.Extender
	caps    adapters.Capabilities
	handler Handler
	cfg     config
	tel     *telemetry
	batch   int // deliveries asked for per Receive
	started atomic.Bool

	// stop is cancelled by Shutdown: Run stops receiving and drains.
	stop    context.Context
	stopRun context.CancelFunc
	// cut is cancelled when Shutdown's context ends before the drain did:
	// the drain stops waiting for running handlers.
	cut      context.Context
	cutDrain context.CancelFunc
	// done is closed when Run returns.
	done chan struct{}
}

// New returns a Consumer that feeds src's deliveries to h. It checks every
// option and the source's capabilities, and fails with an error naming the
// option or capability at fault.
//
// It refuses a nil src or h, and so a typed nil one: the nil pointer a
// constructor returns beside its error (src, _ := rabbitmq.New(...)), a nil
// HandlerFunc, or a [Chain] given a nil Middleware. A Handler that is a nil
// pointer is refused even if its methods would not dereference it: make
// such a handler a struct value. Nil options are skipped, so that an
// option can be chosen conditionally.
func New(src adapters.Source, h Handler, opts ...Option) (*Consumer, error) {
	if err := checkSource(src); err != nil {
		return nil, err
	}
	if err := checkHandler(h); err != nil {
		return nil, err
	}
	cfg := defaultConfig()
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o.apply(&cfg); err != nil {
			return nil, err
		}
	}
	caps := src.Capabilities()
	if err := cfg.fill(caps); err != nil {
		return nil, err
	}
	c := &Consumer{src: src, caps: caps, handler: h, cfg: cfg, done: make(chan struct{})}
	c.stop, c.stopRun = context.WithCancel(context.Background())
	c.cut, c.cutDrain = context.WithCancel(context.Background())
	if caps.Lease > 0 {
		ext, ok := src.(adapters.Extender)
		if !ok {
			return nil, fmt.Errorf("consumer.New: source %q declares a %v lease but does not implement adapters.Extender, so leases could not be kept alive", caps.Name, caps.Lease)
		}
		c.ext = ext
	}
	tel, err := newTelemetry(&cfg, caps)
	if err != nil {
		return nil, fmt.Errorf("consumer.New: creating OpenTelemetry instruments: %w", err)
	}
	c.tel = tel
	c.batch = receiveBatch(caps, cfg.maxInFlight)
	if cfg.deadLetter == nil && !cfg.atMostOnce {
		cfg.logger.Warn("custody: no dead-letter destination (WithDeadLetter); messages that exhaust their retries are given back to the broker after the policy's backoff and may never leave the stream",
			"consumer", cfg.name)
	}
	return c, nil
}

// Run receives and handles messages until ctx is cancelled or the source
// fails for good, then drains: it stops receiving, gives back at once the
// deliveries not yet started (those queued behind a running message of
// their ordering key follow it, to keep their order), lets running handlers
// finish until the shutdown timeout (then cancels their contexts), acks what
// finished, stops lease renewals and closes the source. It returns after all
// of that, with no goroutine of its own left running. A clean shutdown
// returns nil.
//
// A handler that ignores its context keeps Run from returning.
//
// Shutdown stops Run the same way; after Shutdown, Run returns at once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("consumer: Run called twice; create a new Consumer")
	}
	defer close(c.done)
	r := newRun(c, ctx)
	// Shutdown stops receiving as cancelling ctx does; the handlers' and the
	// acks' contexts do not derive from this one (see newRun).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(c.stop, cancel)()
	if c.stop.Err() != nil {
		cancel() // AfterFunc would cancel too, but from another goroutine, later
	}
	return r.run(ctx)
}

// Shutdown stops c gracefully and waits for Run to return: Run stops
// receiving and drains as when its context is cancelled (see Run), acking
// what finishes and giving back the rest, then closes the source.
//
// If ctx ends before Run returns, Shutdown stops waiting for the running
// handlers: their contexts are cancelled with cause ErrShutdownTimeout, as
// when the shutdown timeout is reached, and Shutdown returns ctx's error
// while Run finishes giving back what is left. The drain also ends at the
// shutdown timeout ([WithShutdownTimeout]), whichever comes first.
//
// Shutdown may be called from any goroutine, more than once. Called before
// Run, it makes Run return at once (after closing the source) and returns
// nil; called after Run returned, it returns nil at once.
//
// A handler that calls Shutdown waits for Run, which waits for that
// handler to return: Shutdown returns only when ctx ends (the handler's own
// context ends at the shutdown timeout, so passing it bounds the wait).
// To stop the consumer from a handler, call Shutdown in a new goroutine, or
// cancel Run's context.
func (c *Consumer) Shutdown(ctx context.Context) error {
	c.stopRun()
	if !c.started.Load() {
		return nil
	}
	// Checked first: a select with both ready picks at random, and Run having
	// returned, there is nothing left for ctx to cut short.
	select {
	case <-c.done:
		return nil
	default:
	}
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		c.cutDrain()
		return ctx.Err()
	}
}

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
	acks     chan *job
	draining atomic.Bool
	drainCh  chan struct{}

	ackMu         sync.Mutex
	ackBatch      int // pending acks that make a full batch
	flushing      bool
	lingering     bool // lingerTimer is armed
	lingerTimer   *time.Timer
	lingerWG      sync.WaitGroup // an armed or running timer callback
	pendingAcks   []*job
	spareAcks     []*job
	ackDeliveries []*adapters.Delivery // touched only by the flushing worker

	lanesMu sync.Mutex
	lanes   map[string][]*job // queued behind the running job of each lane
	started time.Time         // the origin of job.accepted
	heads   []*job            // the receiver's scratch for dispatchLaned

	spanName string

	// recalledOnArrival wakes the recall loop (see recall.go); nil when the
	// source reports no recalls.
	recalledOnArrival chan struct{}
}

// job is one held delivery.
type job struct {
	d            *adapters.Delivery
	lease        *lease.Lease   // nil without a lease keeper
	msg          Message        // the first attempt's message, allocated with the job
	ctx          attemptContext // the first attempt's context, likewise
	lane         string
	successor    *job          // the lane's next job, once this one is done
	accepted     time.Duration // when it was received, since run.started
	retries      int           // in-place retries so far
	unavailable  int           // consecutive attempts that found a dependency unavailable
	firstFailure time.Time
	deadLettered bool // the pending ack completes a dead-lettering
	ackedEarly   bool // at-most-once mode
	// giveBack is set on the jobs queued behind a lost one in its lane:
	// they are given back instead of run (see run.lost).
	giveBack bool
	// leaseLostCounted is set once the job's lost lease was counted.
	leaseLostCounted bool
	// exiting is set while the job's handler ends its worker with
	// runtime.Goexit (see call).
	exiting bool
}

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
		credit:         newCredit(c.cfg.maxInFlight, c.batch),
		// Never full: at most maxInFlight jobs are held, and the slack
		// absorbs an adapter that returns more deliveries than asked, so a
		// worker handing on its lane's next job never blocks.
		work:     make(chan *job, 2*c.cfg.maxInFlight),
		acks:     make(chan *job, c.cfg.maxInFlight),
		drainCh:  make(chan struct{}),
		lanes:    make(map[string][]*job),
		started:  time.Now(),
		spanName: "process " + c.cfg.name,
		// A full batch frees room for the receiver's next Receive (see
		// credit), so the two overlap.
		ackBatch: c.batch,
	}
	if m := c.caps.MaxAckBatch; m > 0 && m < r.ackBatch {
		r.ackBatch = m
	}
	r.lingerTimer = time.AfterFunc(time.Hour, r.lingerExpired)
	r.lingerTimer.Stop()
	return r
}

func (r *run) run(ctx context.Context) error {
	var (
		keeperWG  sync.WaitGroup
		workersWG sync.WaitGroup
		ackersWG  sync.WaitGroup
	)
	keeperCtx, stopKeeper := context.WithCancel(r.settleCtx)
	defer stopKeeper()
	if r.c.ext != nil {
		k, err := lease.New(r.c.ext, lease.Config{
			Lease:    r.c.caps.Lease,
			Fraction: r.cfg.leaseFraction,
			MaxBatch: r.c.caps.MaxExtendBatch,
			MaxHold:  r.cfg.maxProcessing,
			Renewed:  func(n int) { r.tel.extensions.Add(r.settleCtx, int64(n), r.tel.source...) },
			Retrying: func(n int, err error) {
				r.tel.renewFails.Add(r.settleCtx, int64(n), r.tel.source...)
				r.logs.log(logRenewalFailed, slog.Int("leases", n), slog.Any("error", err))
			},
			// Lost leases are counted and logged by run.lost, which sees them
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
	ackers := 0
	if r.c.caps.AckLinger > 0 {
		// A broker that wants full batches bills per request and answers over
		// the network: overlap a few requests.
		ackers = 4
	}
	for i := 0; i < ackers; i++ {
		ackersWG.Add(1)
		go func() { defer ackersWG.Done(); r.ackLoop() }()
	}
	for i := 0; i < r.cfg.concurrency; i++ {
		r.startWorker(&workersWG)
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
	r.draining.Store(true)
	close(r.drainCh)
	if !r.cfg.atMostOnce {
		r.releaseWaiting()
	}
	r.held.Wait()
	close(drained)
	deadlineWG.Wait()
	close(r.work)
	workersWG.Wait()
	r.stopLinger()
	close(r.acks)
	ackersWG.Wait()
	stopKeeper()
	keeperWG.Wait()
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

// receive fills free slots from the source until ctx is done or the source
// is closed.
func (r *run) receive(ctx context.Context) error {
	bo := backoff.Exponential{Initial: 50 * time.Millisecond, Max: 5 * time.Second, Multiplier: 2, Jitter: 0.5}
	failures := 0
	for {
		if ctx.Err() != nil {
			// Shutdown began: ask for nothing more. The contract has
			// Receive hand out nothing once its context is done, but a
			// source that kept to it only loosely (one handing out what it
			// had fetched ahead) would start new handlers after shutdown
			// began: the check costs nothing.
			return nil
		}
		n, ok := r.credit.acquire(ctx)
		if !ok {
			return nil
		}
		ds, err := r.c.src.Receive(ctx, n)
		// Keep what was used (more, if an adapter returned more than asked).
		r.credit.release(n - len(ds))
		if len(ds) > 0 {
			r.accept(ds)
			r.noteRecalledOnArrival(ds)
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, adapters.ErrClosed) {
				return fmt.Errorf("consumer: source closed while receiving: %w", err)
			}
			if len(ds) > 0 {
				// A partial failure (one partition's error among others'
				// records): say so, but do not slow the rest down.
				r.logs.log(logReceivePartial, slog.Any("error", err), slog.Int("deliveries", len(ds)))
				failures = 0
				continue
			}
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
			continue
		}
		failures = 0
	}
}

func (r *run) accept(ds []*adapters.Delivery) {
	ctx := r.settleCtx
	r.held.Add(len(ds))
	r.tel.received.Add(ctx, int64(len(ds)), r.tel.source...)
	r.tel.inFlight.Add(ctx, int64(len(ds)), r.tel.source...)
	if r.cfg.atMostOnce {
		if err := r.c.src.Ack(ctx, ds); err != nil {
			// Whatever failed to ack comes back; handling it now as well would
			// be at-least-once, which this mode promised not to be.
			kept := ds[:0:0]
			for i, d := range ds {
				if e := adapters.EntryError(err, i); e != nil {
					r.tel.ackFailures.Add(ctx, 1, r.tel.source...)
					r.logs.log(logEarlyAckFailed, slog.String("id", d.ID), slog.Any("error", e))
					r.settle(&job{d: d}, outcomeLeft) // not nacked: its lease brings it back
					continue
				}
				kept = append(kept, d)
			}
			ds = kept
		}
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
		return
	}
	r.dispatchLaned(jobs)
}

// dispatchLaned hands each job to a worker, or queues it behind its lane's
// running job. The lanes are sorted under one lock per batch; the jobs that
// start lanes are handed on once it is released.
func (r *run) dispatchLaned(jobs []job) {
	heads := r.heads[:0]
	r.lanesMu.Lock()
	for i := range jobs {
		j := &jobs[i]
		if j.lane == "" {
			heads = append(heads, j)
			continue
		}
		if q, busy := r.lanes[j.lane]; busy {
			r.lanes[j.lane] = append(q, j)
			continue
		}
		r.lanes[j.lane] = nil
		heads = append(heads, j)
	}
	r.lanesMu.Unlock()
	for _, j := range heads {
		r.work <- j // never blocks: see newRun
	}
	clear(heads)
	r.heads = heads
}

// startWorker starts a worker, which runs jobs until r.work is closed. A
// handler that ends its worker with runtime.Goexit (see handlerExited) gets
// it replaced, so that the run keeps its concurrency and drains.
func (r *run) startWorker(wg *sync.WaitGroup) {
	wg.Add(1)
	go func() {
		closed := false
		defer func() {
			if !closed {
				r.startWorker(wg) // before Done: the count never touches zero
			}
			wg.Done()
		}()
		for {
			var j *job
			select {
			case j = <-r.work:
			default:
				// Nothing to do right now: send the acks that wait for
				// company before waiting for work.
				r.flushAcks()
				j = <-r.work
			}
			if j == nil {
				closed = true // r.work closed
				return
			}
			r.runLane(j)
		}
	}()
}

// laneRun bounds how many jobs of one lane a worker runs back to back before
// it hands the lane's next job to whichever worker is free: long enough to
// skip a channel hand-off for most jobs of a busy lane, short enough that
// lanes share the workers fairly when there are fewer workers than lanes.
const laneRun = 16

// keyLanePrefix begins the lanes OrderByKey makes of Message.Key, apart from
// the adapters' ordering keys.
const keyLanePrefix = "\x00key:"

// runLane processes j and then, on the same worker, the jobs queued behind
// it in its lane, up to laneRun of them.
func (r *run) runLane(j *job) {
	defer func() {
		if j.exiting {
			// j's handler called runtime.Goexit: this worker is ending.
			r.handlerExited(j)
		}
	}()
	for n := 1; ; n++ {
		r.process(j)
		s := j.successor
		if s == nil {
			return
		}
		j.successor = nil
		if n == laneRun {
			r.work <- s // never blocks: see newRun
			return
		}
		j = s
	}
}

// next passes j's lane on to the job queued behind it, if any: the worker
// that ran j runs it next (see runLane). Called once j no longer runs.
//
// It takes up to laneRun queued jobs at once and links them through their
// successor fields, so a busy lane costs one lock per run of jobs rather
// than one per job; the lane stays busy until the last of them is done.
// It takes only the next job when the source recalls deliveries: a job
// linked behind another is out of reach of releaseRecalled until the one
// before it ends. Were that one a handler running on past a Kafka revoke's
// drain (one that ignores its context), the recalled jobs linked behind it
// would stay held, lost, and keep the runtime's in-flight credit until it
// returned: with the partition's records fetched again piling up behind
// them, the receiver would stop, and every lane of the member would wait.
// (And an OrderByKey lane may mix streams, one key in several partitions:
// a recalled job of one linked behind a job of another, which may hold the
// lane for long, as a retry's backoff does, would be out of reach too.)
func (r *run) next(j *job) {
	if j.lane == "" || j.successor != nil {
		return // no lane, or the job's successor was taken with it
	}
	r.lanesMu.Lock()
	q := r.lanes[j.lane]
	if len(q) == 0 {
		delete(r.lanes, j.lane)
		r.lanesMu.Unlock()
		return
	}
	n := min(len(q), laneRun)
	if r.recalledOnArrival != nil {
		n = 1
	}
	for i := 0; i < n-1; i++ {
		q[i].successor = q[i+1]
	}
	j.successor = q[0]
	clear(q[:n])
	r.lanes[j.lane] = q[n:]
	r.lanesMu.Unlock()
}

// settle ends the runtime's custody of j.
func (r *run) settle(j *job, outcome string) {
	r.tel.settle(r.settleCtx, outcome, 1)
	r.credit.release(1)
	r.held.Done()
}
