package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/custody-go/custody/adapters"
)

// Consumer runs a Handler over a Source. Create it with New and start it with
// Run. A Consumer runs once.
type Consumer struct {
	src     adapters.Source
	ext     adapters.Extender
	caps    adapters.Capabilities
	handler Handler
	// batchHandler is set instead of handler by NewBatch.
	batchHandler BatchHandler
	cfg          config
	tel          *telemetry
	batch        int // deliveries asked for per Receive
	started      atomic.Bool

	state  atomic.Int32        // a State
	cur    atomic.Pointer[run] // the run under way, or the last one
	intake gate                // closed by Pause and by a tripped kill switch
	// sourcePause serialises what an adapters.Pauser source is told, and
	// remembers it, so that the source ends in the gate's latest state.
	sourcePause struct {
		sync.Mutex
		paused bool
	}

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
	return newConsumer("consumer.New", src, h, nil, opts)
}

// NewBatch returns a Consumer that feeds src's deliveries to h in batches
// (see [BatchHandler], [WithBatchSize], [WithBatchBytes] and
// [WithBatchLinger]). It checks its arguments as New does.
func NewBatch(src adapters.Source, h BatchHandler, opts ...Option) (*Consumer, error) {
	if err := checkBatchHandler(h); err != nil {
		return nil, err
	}
	return newConsumer("consumer.NewBatch", src, nil, h, opts)
}

func newConsumer(fn string, src adapters.Source, h Handler, bh BatchHandler, opts []Option) (*Consumer, error) {
	if err := checkSource(src); err != nil {
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
	if bh == nil && cfg.batching.set {
		return nil, fmt.Errorf("%s: %s applies to batch handlers; use consumer.NewBatch, or leave the option out", fn, cfg.batching.option)
	}
	if bh != nil && cfg.atMostOnce {
		return nil, fmt.Errorf("%s: WithAtMostOnceAckBeforeProcessingUnsafe is not offered for batch handlers", fn)
	}
	caps := src.Capabilities()
	if err := cfg.fill(caps, bh != nil); err != nil {
		return nil, err
	}
	c := &Consumer{src: src, caps: caps, handler: h, batchHandler: bh, cfg: cfg, done: make(chan struct{})}
	c.stop, c.stopRun = context.WithCancel(context.Background())
	c.cut, c.cutDrain = context.WithCancel(context.Background())
	c.intake.init()
	if caps.Lease > 0 {
		ext, ok := src.(adapters.Extender)
		if !ok {
			return nil, fmt.Errorf("%s: source %q declares a %v lease but does not implement adapters.Extender, so leases could not be kept alive", fn, caps.Name, caps.Lease)
		}
		c.ext = ext
	}
	tel, err := newTelemetry(&cfg, caps)
	if err != nil {
		return nil, fmt.Errorf("%s: creating OpenTelemetry instruments: %w", fn, err)
	}
	c.tel = tel
	if _, ok := src.(adapters.BacklogReporter); ok {
		err := observeBacklog(&c.cfg, func() *backlogReading {
			if r := c.cur.Load(); r != nil {
				return r.backlog.Load()
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("%s: creating OpenTelemetry instruments: %w", fn, err)
		}
	}
	c.batch = receiveBatch(caps, cfg.maxInFlight)
	if cfg.deadLetter == nil && !cfg.atMostOnce {
		cfg.logger.Warn("custody: no dead-letter destination (WithDeadLetter); messages that exhaust their retries are given back to the broker after the policy's backoff and may never leave the stream",
			"consumer", cfg.name)
	}
	return c, nil
}

// Run receives and handles messages until ctx is cancelled or the source
// fails for good, then drains (see the package documentation, section
// Shutdown; deliveries queued behind a running message of their ordering key
// follow it, to keep their order) and returns with no goroutine of its own
// left running. A clean shutdown returns nil. A handler that ignores its
// context keeps Run from returning. After Shutdown, Run returns at once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("consumer: Run called twice; create a new Consumer")
	}
	defer close(c.done)
	r := newRun(c, ctx)
	c.cur.Store(r)
	if c.intake.closed() {
		c.state.Store(int32(StatePaused))
		c.syncSourcePause()
	} else {
		c.state.Store(int32(StateRunning))
	}
	defer c.state.Store(int32(StateStopped))
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

// Shutdown stops c gracefully and waits for Run to return: Run drains as
// when its context is cancelled.
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
