package consumer

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/custody-go/custody/adapters"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// Option configures a Consumer. Options are checked by New: an invalid value
// fails New with an error naming the option.
type Option interface {
	apply(*config) error
}

type optionFunc func(*config) error

func (f optionFunc) apply(c *config) error { return f(c) }

// Ordering chooses which deliveries must not run concurrently.
type Ordering int

const (
	// OrderAsDelivered keeps the order the broker promised and nothing more:
	// deliveries the adapter gives an ordering key (a Kafka partition, an SQS
	// FIFO group) run one at a time per key, in order. The default.
	OrderAsDelivered Ordering = iota
	// OrderByKey also runs messages with the same Message.Key one at a time,
	// in the order received, on brokers that promise no order themselves.
	// Messages without a key run unordered.
	OrderByKey
)

type config struct {
	name            string
	concurrency     int
	maxInFlight     int
	retry           Retry
	deadLetter      adapters.DeadLetter
	ordering        Ordering
	handlerTimeout  time.Duration
	shutdownTimeout time.Duration
	maxProcessing   time.Duration
	leaseFraction   float64
	logger          *slog.Logger
	meterProvider   metric.MeterProvider
	tracerProvider  trace.TracerProvider
	propagator      propagation.TextMapPropagator
	atMostOnce      bool
	leaveOnShutdown bool
	batching        batching
	killSwitch      *KillSwitch
	backlogInterval time.Duration
}

// batching is the configuration of a batch consumer.
type batching struct {
	size   int
	bytes  int
	linger time.Duration
	// set names the first batch option given, for New's error when the
	// handler is not a batch handler.
	set    bool
	option string
}

func defaultConfig() config {
	return config{
		batching:        batching{size: 100},
		backlogInterval: 30 * time.Second,
		concurrency:     1,
		retry:           Retry{MaxAttempts: 5},
		shutdownTimeout: 30 * time.Second,
		maxProcessing:   12 * time.Hour,
		leaseFraction:   1.0 / 3,
	}
}

// WithName names the consumer in telemetry, logs and dead-letter
// diagnostics. Default: the source's Capabilities().Name.
func WithName(name string) Option {
	return optionFunc(func(c *config) error { c.name = name; return nil })
}

// Upper bounds of WithConcurrency and WithMaxInFlight: the runtime starts a
// goroutine per handler slot and sizes its queues by the in-flight bound, so
// a value past these would exhaust memory (or panic) in Run rather than fail
// at New.
const (
	maxConcurrency = 1 << 16
	maxInFlight    = 1 << 20
)

// WithConcurrency sets how many handlers run at once. Default 1. Must be
// between 1 and 65,536.
func WithConcurrency(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > maxConcurrency {
			return fmt.Errorf("consumer: WithConcurrency(%d): must be between 1 and %d", n, maxConcurrency)
		}
		c.concurrency = n
		return nil
	})
}

// WithMaxInFlight bounds the deliveries held at once: running, waiting for a
// worker, an ordering lane or a retry, or waiting for their ack. Held
// deliveries keep their leases renewed (not those waiting for their ack).
// Where a waiting delivery costs the broker nothing
// (adapters.Capabilities.FreeWhileQueued: Kafka by key), those queued behind
// the running delivery of their ordering lane are not counted, so that one
// slow lane does not stop the others; the source's MaxUnacked bounds
// everything held instead (see the package documentation, section
// Concurrency and order).
// Default: twice the concurrency and at least 20, so that one batch can be
// fetched while another is handled, plus room for the acks an adapter
// keeps waiting to fill a batch (SQS: 4 calls of 10), and never more than
// the adapter's MaxUnacked (a prefetch, a MaxAckPending). Must be at least
// the concurrency, at most the adapter's MaxUnacked, and at most
// 1,048,576.
//
// A deeper window keeps quick handlers fed: with handlers of a few
// microseconds at concurrency 1, 100 measured about 15% faster than the
// default on the memory broker (BenchmarkConsumerConcurrency1Work). The
// cost: one consumer holds, and keeps leased, that many messages that other
// instances could otherwise take, which with slow handlers means waiting.
func WithMaxInFlight(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > maxInFlight {
			return fmt.Errorf("consumer: WithMaxInFlight(%d): must be between 1 and %d", n, maxInFlight)
		}
		c.maxInFlight = n
		return nil
	})
}

// WithRetry sets the retry policy. Default: 5 attempts, exponential backoff
// from 200ms to 1m with jitter. Zero fields take their defaults.
func WithRetry(r Retry) Option {
	return optionFunc(func(c *config) error {
		if r.MaxAttempts < 0 {
			return fmt.Errorf("consumer: WithRetry: MaxAttempts %d must not be negative", r.MaxAttempts)
		}
		if r.MaxAttempts == 0 {
			r.MaxAttempts = 5
		}
		if err := checkBackoff(r.Backoff); err != nil {
			return err
		}
		c.retry = r
		return nil
	})
}

// WithDeadLetter sets where messages go when they fail MaxAttempts times or
// fail with a Permanent error. The original is acked only after the
// destination confirmed the write. Without one, such messages are given back
// to the broker after the retry policy's backoff for their attempt, which
// grows with every redelivery, or after the delay the handler asked for with
// RetryAfter (the broker's own redrive policy may then move them); where the
// broker cannot delay a redelivery, or the message is in an ordered lane (a
// Kafka partition, a FIFO group) that a redelivery would let later messages
// overtake, the handler is retried in place at that pace, holding up the
// lane. New logs a warning.
func WithDeadLetter(dl adapters.DeadLetter) Option {
	return optionFunc(func(c *config) error {
		if dl == nil {
			return errors.New("consumer: WithDeadLetter(nil): pass a dead-letter destination or leave the option out")
		}
		if isNil(dl) {
			// A constructor's error ignored: accepted, the nil pointer
			// would panic in a worker at the first poison message.
			return fmt.Errorf("consumer: WithDeadLetter: a nil %T; check the error of the call that made it", dl)
		}
		c.deadLetter = dl
		return nil
	})
}

// WithOrdering chooses which deliveries must run one at a time. Default
// OrderAsDelivered.
func WithOrdering(o Ordering) Option {
	return optionFunc(func(c *config) error {
		if o != OrderAsDelivered && o != OrderByKey {
			return fmt.Errorf("consumer: WithOrdering(%d): unknown ordering", o)
		}
		c.ordering = o
		return nil
	})
}

// WithHandlerTimeout bounds one attempt of the handler; its context is
// cancelled with ErrHandlerTimeout after d. The attempt fails if the handler
// then returns an error (as one that honours its context does); a handler
// that still returns nil has its message acked. Default 0: no timeout.
func WithHandlerTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 0 {
			return fmt.Errorf("consumer: WithHandlerTimeout(%v): must not be negative", d)
		}
		c.handlerTimeout = d
		return nil
	})
}

// WithShutdownTimeout sets how long Run lets in-flight handlers finish after
// its context is cancelled or Shutdown is called. Their contexts stay alive
// until then (or until Shutdown's context ends, if sooner); afterwards they
// are cancelled with ErrShutdownTimeout and their messages are given back to
// the broker. The timeout counts from the cancellation, even when the
// adapter's Receive under way cannot end at once (a Kafka poll during a
// rebalance). Default 30s.
func WithShutdownTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 0 {
			return fmt.Errorf("consumer: WithShutdownTimeout(%v): must not be negative", d)
		}
		c.shutdownTimeout = d
		return nil
	})
}

// WithMaxProcessingTime caps how long a delivery's lease is kept alive,
// counted from its receipt, retries in place included. At the cap the
// handler's context is cancelled (lease lost) and the broker redelivers the
// message. Default 12h, and never more than the broker's own cap (SQS: 12h
// from the receive).
func WithMaxProcessingTime(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("consumer: WithMaxProcessingTime(%v): must be positive", d)
		}
		c.maxProcessing = d
		return nil
	})
}

// WithLeaseRenewal sets the fraction of the lease after which it is renewed.
// Default 1/3. New refuses a fraction that would renew a lease more often
// than every millisecond. A renewal that fails without the adapter saying the
// lease is gone (a network error, throttling) is tried again while the lease
// has time left; one the adapter refuses as lost cancels the handler at once
// (see package lease).
func WithLeaseRenewal(fraction float64) Option {
	return optionFunc(func(c *config) error {
		if !(fraction > 0 && fraction < 1) { // NaN too
			return fmt.Errorf("consumer: WithLeaseRenewal(%v): must be in (0, 1)", fraction)
		}
		c.leaseFraction = fraction
		return nil
	})
}

// WithLogger sets the logger. Default slog.Default(). What is logged at
// which level, and how lines are rate-limited: see Logs in the package
// documentation.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) error {
		if l == nil {
			return errors.New("consumer: WithLogger(nil): pass a logger or leave the option out")
		}
		c.logger = l
		return nil
	})
}

// WithMeterProvider sets where metrics go. Default otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) error {
		if mp == nil {
			return errors.New("consumer: WithMeterProvider(nil): pass a provider or leave the option out")
		}
		if isNil(mp) {
			return fmt.Errorf("consumer: WithMeterProvider: a nil %T; check the error of the call that made it, or leave the option out", mp)
		}
		c.meterProvider = mp
		return nil
	})
}

// WithTracerProvider sets where spans go. Default otel.GetTracerProvider().
// While that global provider has no SDK behind it, and with the no-op
// provider, no span is started (they would record nothing and cost
// allocations per message); the trace context in the message's headers still
// reaches the handler. Installing an SDK through otel.SetTracerProvider after
// New turns spans on.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) error {
		if tp == nil {
			return errors.New("consumer: WithTracerProvider(nil): pass a provider or leave the option out")
		}
		if isNil(tp) {
			return fmt.Errorf("consumer: WithTracerProvider: a nil %T; check the error of the call that made it, or leave the option out", tp)
		}
		c.tracerProvider = tp
		return nil
	})
}

// WithPropagator sets how trace context is read from message headers.
// Default otel.GetTextMapPropagator() (set it to propagation.TraceContext{}
// for W3C traceparent headers).
func WithPropagator(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) error {
		if p == nil {
			return errors.New("consumer: WithPropagator(nil): pass a propagator or leave the option out")
		}
		if isNil(p) {
			return fmt.Errorf("consumer: WithPropagator: a nil %T; check the error of the call that made it, or leave the option out", p)
		}
		c.propagator = p
		return nil
	})
}

// WithAtMostOnceAckBeforeProcessingUnsafe acks every message as soon as it
// is received, before the handler runs. A crash or a failed handler then
// loses the message: nothing is retried or dead-lettered. At shutdown the
// messages already received are still handled (they cannot be given back),
// within the shutdown timeout; past it their handlers get a cancelled
// context. Use it only for data where losing some is acceptable (sampled
// metrics, best-effort caches). Default off.
func WithAtMostOnceAckBeforeProcessingUnsafe() Option {
	return optionFunc(func(c *config) error { c.atMostOnce = true; return nil })
}

// WithLeaveUnfinishedOnShutdown keeps the runtime from giving deliveries back
// at shutdown: those that did not finish (or never started) stay with the
// broker until their lease runs out or their connection closes, instead of
// being released for immediate redelivery. Use it when another consumer
// should not pick them up at once, for example while a deploy replaces this
// one. Default off: unfinished deliveries are released (Nack with no delay).
// Outside shutdown it changes nothing: deliveries queued behind a lost one of
// their ordering key are still released at once. Nor does it keep back
// deliveries the adapter recalled (a revoked Kafka partition's) that have not
// started: they are released at once, since the adapter waits for them.
func WithLeaveUnfinishedOnShutdown() Option {
	return optionFunc(func(c *config) error { c.leaveOnShutdown = true; return nil })
}

// minRenewal is the shortest renewal interval New accepts.
const minRenewal = time.Millisecond

func (c *config) fill(caps adapters.Capabilities, batch bool) error {
	if c.name == "" {
		c.name = caps.Name
	}
	if c.name == "" {
		c.name = "custody"
	}
	if c.retry.Backoff == nil {
		c.retry.Backoff = defaultBackoff()
	}
	if caps.FreeWhileQueued && (caps.Lease > 0 || caps.MaxLeaseAge > 0 || caps.MaxUnacked <= 0) {
		return fmt.Errorf("consumer: source %q declares Capabilities.FreeWhileQueued with a lease (%v), a maximum lease age (%v) or no MaxUnacked (%d): queued deliveries would then cost the broker a lease or a clock, or nothing would bound them",
			caps.Name, caps.Lease, caps.MaxLeaseAge, caps.MaxUnacked)
	}
	if caps.MaxUnacked > 0 && c.concurrency > caps.MaxUnacked {
		return fmt.Errorf("consumer: WithConcurrency(%d) exceeds the %d unacked deliveries source %q hands out (its prefetch, or its MaxAckPending): raise the adapter's limit or lower the concurrency",
			c.concurrency, caps.MaxUnacked, caps.Name)
	}
	if caps.MaxUnacked > 0 && c.maxInFlight > caps.MaxUnacked {
		return fmt.Errorf("consumer: WithMaxInFlight(%d) exceeds the %d unacked deliveries source %q hands out (its prefetch, or its MaxAckPending), so the window could never fill: raise the adapter's limit or lower WithMaxInFlight",
			c.maxInFlight, caps.MaxUnacked, caps.Name)
	}
	if c.maxInFlight == 0 {
		c.maxInFlight = defaultMaxInFlight(c.concurrency, caps)
		if batch {
			// Room for every worker's batch and the next ones to gather.
			c.maxInFlight = max(c.maxInFlight, 2*c.concurrency*c.batching.size)
			if caps.MaxUnacked > 0 && c.maxInFlight > caps.MaxUnacked {
				c.maxInFlight = max(caps.MaxUnacked, c.concurrency)
			}
			c.maxInFlight = min(c.maxInFlight, maxInFlight)
		}
	}
	if c.maxInFlight < c.concurrency {
		return fmt.Errorf("consumer: WithMaxInFlight(%d) is below WithConcurrency(%d): workers would idle", c.maxInFlight, c.concurrency)
	}
	if every := time.Duration(float64(caps.Lease) * c.leaseFraction); caps.Lease > 0 && every < minRenewal {
		return fmt.Errorf("consumer: WithLeaseRenewal(%v): renewing source %q's %v lease every %v would renew in a loop; choose a larger fraction, for renewals at least %v apart",
			c.leaseFraction, caps.Name, caps.Lease, every, minRenewal)
	}
	if caps.MaxLeaseAge > 0 && c.maxProcessing > caps.MaxLeaseAge {
		c.maxProcessing = caps.MaxLeaseAge
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	if c.tracerProvider == nil {
		c.tracerProvider = otel.GetTracerProvider()
	}
	if c.propagator == nil {
		c.propagator = otel.GetTextMapPropagator()
	}
	return nil
}

// receiveBatch is how many deliveries one Receive asks for: the adapter's
// limit where it has one, otherwise half the in-flight bound, so that a fast
// source fills the runtime in a few calls rather than one call per ten
// messages.
func receiveBatch(caps adapters.Capabilities, maxInFlight int) int {
	if caps.MaxReceive > 0 {
		return min(caps.MaxReceive, maxInFlight)
	}
	return max(1, maxInFlight/2)
}

// defaultMaxInFlight is the in-flight window when WithMaxInFlight is not
// given (see there). It is not scaled by the adapter's receive batch: a
// source that polls wide (SQS with several pollers) would otherwise hold,
// and keep renewing, far more than a small consumer can work through.
func defaultMaxInFlight(concurrency int, caps adapters.Capabilities) int {
	n := max(2*concurrency, 20)
	if a := caps.Ack; a.Linger > 0 && a.MaxEntries > 0 {
		n += a.MaxEntries * max(a.MaxCalls, 1)
	}
	if caps.MaxUnacked > 0 && n > caps.MaxUnacked {
		n = max(caps.MaxUnacked, concurrency)
	}
	return n
}

// The upper bound of WithBatchSize.
const maxBatchSize = 1 << 16

// WithBatchSize bounds the messages of one batch (NewBatch). Default 100.
// Must be between 1 and 65,536. The in-flight window's default grows to
// hold two batches per worker; a smaller WithMaxInFlight makes smaller
// batches.
func WithBatchSize(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 1 || n > maxBatchSize {
			return fmt.Errorf("consumer: WithBatchSize(%d): must be between 1 and %d", n, maxBatchSize)
		}
		c.batching.size = n
		c.batching.note("WithBatchSize")
		return nil
	})
}

// WithBatchBytes bounds the bytes of message bodies in one batch
// (NewBatch); a batch always takes its first message, however large.
// Default 0: no bound.
func WithBatchBytes(n int) Option {
	return optionFunc(func(c *config) error {
		if n < 0 {
			return fmt.Errorf("consumer: WithBatchBytes(%d): must not be negative", n)
		}
		c.batching.bytes = n
		c.batching.note("WithBatchBytes")
		return nil
	})
}

// WithBatchLinger sets how long a batch (NewBatch) waits to fill once it
// holds its first message. Default 0: a batch takes the messages ready for
// a worker and goes, so a quiet stream is handled at once and a busy one
// in full batches.
func WithBatchLinger(d time.Duration) Option {
	return optionFunc(func(c *config) error {
		if d < 0 {
			return fmt.Errorf("consumer: WithBatchLinger(%v): must not be negative", d)
		}
		c.batching.linger = d
		c.batching.note("WithBatchLinger")
		return nil
	})
}

func (b *batching) note(option string) {
	if !b.set {
		b.set, b.option = true, option
	}
}
