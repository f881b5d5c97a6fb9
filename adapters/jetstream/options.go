package jetstream

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"

	"github.com/custody-go/custody/adapters"
)

// Defaults for the Source's options.
const (
	// DefaultPollWait is how long a Receive waits for a message on an idle
	// consumer before it returns none.
	DefaultPollWait = 5 * time.Second
	// DefaultMaxFetch is the most messages one Receive fetches. Smaller
	// pulls let the runtime ask again sooner, which keeps its workers fed
	// when handlers take time (see docs/jetstream.md).
	DefaultMaxFetch = 64
	// DefaultRequestTimeout bounds each ack, nak, renewal and term, and the
	// wait for their replies.
	DefaultRequestTimeout = 10 * time.Second
	// DefaultAckWait is the AckWait given to a consumer WithCreate creates
	// when its configuration leaves AckWait zero (the server's own default).
	DefaultAckWait = 30 * time.Second
	// maxNakDelay caps the delay of a nak: longer ones are cut to it.
	maxNakDelay = 365 * 24 * time.Hour
)

// Option configures a [Source].
type Option func(*options) error

type options struct {
	create         *jetstream.ConsumerConfig // nil: bind to an existing consumer
	pollWait       time.Duration
	maxFetch       int
	requestTimeout time.Duration
	keyHeader      string // "": Key is the subject
	ordered        bool
	maxAttempts    int // 0: not checked against MaxDeliver
	meterProvider  metric.MeterProvider
	// Benchmark knobs: fire-and-forget acks instead of acknowledged ones
	// (what the confirmation costs), and other Capabilities.Ack and
	// Receivers than the Source declares (what they were chosen against).
	unconfirmedAcks bool
	ackBatching     *adapters.Batching
	receivers       int
}

func defaultOptions() options {
	return options{
		pollWait:       DefaultPollWait,
		maxFetch:       DefaultMaxFetch,
		requestTimeout: DefaultRequestTimeout,
	}
}

// WithCreate makes New create the durable consumer with cfg, or update it to
// cfg if it exists, instead of binding to one that must exist. cfg.Durable
// (or cfg.Name) must be empty or the name given to New. Zero fields get
// custody's defaults: AckPolicy AckExplicitPolicy (any other policy is
// refused), AckWait 30 s (DefaultAckWait), MaxDeliver -1 (unlimited: the
// runtime counts attempts and dead-letters), MaxAckPending the server's
// default (1000). cfg.BackOff must be empty (see New).
func WithCreate(cfg jetstream.ConsumerConfig) Option {
	return func(o *options) error {
		if cfg.AckPolicy != jetstream.AckExplicitPolicy && cfg.AckPolicy != 0 {
			return fmt.Errorf("jetstream.WithCreate: AckPolicy %v: custody acks every message on its own; use jetstream.AckExplicitPolicy", cfg.AckPolicy)
		}
		if len(cfg.BackOff) > 0 {
			return errors.New("jetstream.WithCreate: BackOff is set: the server would time redeliveries by it and shift the runtime's delayed naks; leave it empty (consumer.Retry picks the delays)")
		}
		c := cfg
		o.create = &c
		return nil
	}
}

// WithPollWait sets how long a Receive waits for a message when none is
// ready, from 10 ms to 1 min. Default 5 s. The wait is the pull request's
// expiry, so it also bounds how long a dead connection goes unnoticed by a
// Receive.
func WithPollWait(d time.Duration) Option {
	return func(o *options) error {
		if d < 10*time.Millisecond || d > time.Minute {
			return fmt.Errorf("jetstream.WithPollWait(%v): must be from 10ms to 1m", d)
		}
		o.pollWait = d
		return nil
	}
}

// WithMaxFetch sets the most messages one Receive fetches, from 1 to 10,000.
// Default 64. The runtime asks for no more than it has room for, so a
// Receive fetches min(this, the runtime's room).
func WithMaxFetch(n int) Option {
	return func(o *options) error {
		if n < 1 || n > 10000 {
			return fmt.Errorf("jetstream.WithMaxFetch(%d): must be from 1 to 10000", n)
		}
		o.maxFetch = n
		return nil
	}
}

// WithRequestTimeout bounds every ack, nak, renewal (InProgress) and term
// request, from 100 ms to 5 min. Default 10 s. An entry not answered within
// it fails; the runtime tries a failed renewal again while the lease lasts.
func WithRequestTimeout(d time.Duration) Option {
	return func(o *options) error {
		if d < 100*time.Millisecond || d > 5*time.Minute {
			return fmt.Errorf("jetstream.WithRequestTimeout(%v): must be from 100ms to 5m", d)
		}
		o.requestTimeout = d
		return nil
	}
}

// WithKeyHeader takes each message's Key from the header name instead of
// its subject. Messages without the header have an empty Key (they run
// unordered under consumer.OrderByKey). Default: Key is the subject.
func WithKeyHeader(name string) Option {
	return func(o *options) error {
		if name == "" {
			return errors.New("jetstream.WithKeyHeader(\"\"): name a header, or leave the option out to key by subject")
		}
		o.keyHeader = name
		return nil
	}
}

// WithOrderedKeys makes every delivery's OrderingKey its Key (the subject,
// or the WithKeyHeader header) and reports the Source as ordered, so the
// runtime keeps each key's messages in stream order under the default
// consumer.OrderAsDelivered, as consumer.OrderByKey does. Default off.
func WithOrderedKeys() Option {
	return func(o *options) error { o.ordered = true; return nil }
}

// WithMaxAttempts gives New the consumer's Retry.MaxAttempts, to check the
// JetStream consumer's MaxDeliver against (see New). Without it, New
// refuses a consumer with a MaxDeliver limit.
func WithMaxAttempts(n int) Option {
	return func(o *options) error {
		if n < 1 {
			return fmt.Errorf("jetstream.WithMaxAttempts(%d): must be the consumer's Retry.MaxAttempts, at least 1", n)
		}
		o.maxAttempts = n
		return nil
	}
}

// WithMeterProvider sets where the Source's metrics go. Default
// otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(o *options) error {
		if mp == nil {
			return errors.New("jetstream.WithMeterProvider(nil): pass a provider or leave the option out")
		}
		o.meterProvider = mp
		return nil
	}
}
