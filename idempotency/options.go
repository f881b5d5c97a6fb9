package idempotency

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/custody-go/custody/consumer"
)

// Option configures the middleware. New checks every option and fails with
// an error naming the one that is invalid.
type Option func(*config) error

type config struct {
	keyFunc      func(*consumer.Message) string
	fingerprint  func(*consumer.Message) string
	lease        time.Duration
	extendEvery  time.Duration
	retention    time.Duration
	overlapDelay time.Duration
	storeTimeout time.Duration
	meter        metric.MeterProvider
	name         string
	logger       *slog.Logger
}

func defaultConfig() config {
	return config{
		keyFunc:      MessageID,
		lease:        DefaultLease,
		retention:    24 * time.Hour,
		storeTimeout: 5 * time.Second,
	}
}

// MessageID is the default KeyFunc: the broker's stable identity of the
// message (SQS MessageId, Kafka topic/partition/offset, AMQP message-id when
// the publisher set one). It is empty when the broker gave none, and the
// middleware then refuses the message with a permanent [ErrNoKey].
//
// A broker's ID is unique only among the messages that broker knows. Kafka's
// topic/partition/offset starts over when a topic is deleted and created
// again, and the same topic on another cluster has the same IDs; an AMQP
// message-id is whatever its publisher chose. A store that outlives such a
// reset within the retention, or that consumers of several clusters share,
// takes the new messages for completed ones and skips their effects. Keep
// such stores apart, or key on the producer's business key, or put the
// cluster in the key with [WithKeyFunc].
func MessageID(m *consumer.Message) string { return m.ID }

// WithKeyFunc sets how the idempotency key is read from a message. Default
// [MessageID]. Prefer a key the producer chose for the business operation
// (an order id, a payment id in a header): unlike a broker's message id it
// also catches a message published twice. Return "" when there is no key:
// the message then fails with a permanent [ErrNoKey].
func WithKeyFunc(f func(*consumer.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("idempotency: WithKeyFunc(nil): pass a function or leave the option out")
		}
		c.keyFunc = f
		return nil
	}
}

// WithFingerprint stores a summary of each message's payload with its key;
// a later message with the same key and a different fingerprint fails with
// a permanent [ErrFingerprintMismatch] instead of being skipped as a
// duplicate. [FingerprintBody] hashes the body. Default: no fingerprint.
func WithFingerprint(f func(*consumer.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("idempotency: WithFingerprint(nil): pass a function such as idempotency.FingerprintBody, or leave the option out")
		}
		c.fingerprint = f
		return nil
	}
}

// DefaultLease is the claim lease unless WithLease says otherwise.
//
// The lease is how long the keys of a consumer that died stay blocked
// (each redelivery of them is deferred until it runs out), not how long a
// handler may run: the claim is renewed while the handler runs, every fifth
// of the lease by default. So the lease only has to outlast a few renewals
// and a hiccup of the store: an outage shorter than the lease less two
// renewal intervals (6s at the defaults) never stops a running handler; a
// longer one cancels it with ErrClaimLost before the claim can run out, and
// its message waits for the store (consumer.Unavailable) and runs again.
const DefaultLease = 10 * time.Second

// WithLease sets how long a claim holds a key before another delivery may
// take it over, should this process stop extending it (a crash). A longer
// lease rides out longer store outages without stopping running handlers,
// and blocks a dead consumer's keys longer (see [DefaultLease]). Default
// 10s. Must be at least 1ms.
func WithLease(d time.Duration) Option {
	return func(c *config) error {
		if d < time.Millisecond {
			return fmt.Errorf("idempotency: WithLease(%v): must be at least 1ms", d)
		}
		c.lease = d
		return nil
	}
}

// WithExtendInterval sets how often a running handler's claim is extended
// back to the full lease. A failed extension is tried again an interval
// later while the claim would still be held then; the handler is cancelled
// (ErrClaimLost) at the last failure before the claim runs out, so it
// survives a store outage of at least the lease less two intervals.
// Default a fifth of the lease. Must be positive and shorter than the
// lease.
func WithExtendInterval(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("idempotency: WithExtendInterval(%v): must be positive", d)
		}
		c.extendEvery = d
		return nil
	}
}

// WithRetention sets how long a completed key is remembered. A duplicate
// that arrives later runs the handler again, so make it longer than the
// broker can redeliver a message: its lease or visibility timeout plus your
// retry schedule for redeliveries, and longer if you replay queues or reset
// offsets. Default 24h. Must be at least 1ms.
func WithRetention(d time.Duration) Option {
	return func(c *config) error {
		if d < time.Millisecond {
			return fmt.Errorf("idempotency: WithRetention(%v): must be at least 1ms", d)
		}
		c.retention = d
		return nil
	}
}

// WithOverlapRetryDelay sets how long an overlapping duplicate waits before
// it is tried again (as consumer.Defer). Where the broker counts
// deliveries, each deferral raises the next delivery's Attempt, and a
// broker-side redrive policy (an SQS maxReceiveCount) counts it: keep that
// limit above your slowest handler divided by this delay. Default: the
// lease. Must be positive.
func WithOverlapRetryDelay(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("idempotency: WithOverlapRetryDelay(%v): must be positive", d)
		}
		c.overlapDelay = d
		return nil
	}
}

// WithStoreTimeout bounds each call to the store on a delivery's behalf
// (for a batch, each call, which with a BatchStore carries the keys of the
// whole batch): the Claim before the handler, and the Complete or Release
// after it returns. They run on a context detached from the handler's: a
// handler cancelled at its deadline still records its outcome, and a Claim
// the store may already have made is waited for (and given back when the
// delivery ended meanwhile) rather than left behind for its whole lease.
// Keep it shorter than the lease: a Claim answered after the lease ran out
// holds nothing, and is given back without running the handler. Default
// 5s. Must be positive.
func WithStoreTimeout(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("idempotency: WithStoreTimeout(%v): must be positive", d)
		}
		c.storeTimeout = d
		return nil
	}
}

// WithName sets the custody.consumer attribute of the middleware's metrics,
// so that they join the consumer's own (and two consumers in one process
// count their duplicates apart): pass the name given to consumer.WithName
// (or the adapter's default, such as "sqs:orders"). Default none: the
// attribute is left out.
func WithName(name string) Option {
	return func(c *config) error {
		c.name = name
		return nil
	}
}

// WithMeterProvider sets where the middleware's metrics go. Default
// otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return errors.New("idempotency: WithMeterProvider(nil): pass a provider or leave the option out")
		}
		c.meter = mp
		return nil
	}
}

// WithLogger sets where store failures are reported: a Complete or Release
// that failed (the message is not failed for it), and outages of the store
// (see the package documentation, section When the store fails). Default
// slog.Default().
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return errors.New("idempotency: WithLogger(nil): pass a logger or leave the option out")
		}
		c.logger = l
		return nil
	}
}

func (c *config) fill() error {
	if c.extendEvery == 0 {
		c.extendEvery = c.lease / 5
	}
	if c.extendEvery >= c.lease {
		return fmt.Errorf("idempotency: WithExtendInterval(%v): must be shorter than the lease (%v), or the claim expires between extensions", c.extendEvery, c.lease)
	}
	if c.overlapDelay == 0 {
		c.overlapDelay = c.lease
	}
	if c.meter == nil {
		c.meter = otel.GetMeterProvider()
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	return nil
}
