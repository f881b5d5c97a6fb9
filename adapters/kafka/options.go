package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/custody-go/custody/internal/option"
)

// OrderingScope chooses which records of a partition may run at the same
// time, through Delivery.OrderingKey (see the package documentation,
// section Ordering). It is not consumer.WithOrdering, which orders by
// Message.Key the deliveries of adapters that set no ordering key: the
// Kafka adapter always sets its own (or none, Unordered).
type OrderingScope int

const (
	// ByPartition runs one record at a time per partition, in offset order:
	// the order Kafka promises. The default.
	ByPartition OrderingScope = iota
	// ByKey runs records with the same key in a partition in offset order
	// and records with different keys concurrently. Records without a key
	// share one lane per partition.
	ByKey
	// Unordered runs any records concurrently. Commits stay prefix-safe;
	// only the order of effects is given up.
	Unordered
)

func (o OrderingScope) String() string {
	switch o {
	case ByPartition:
		return "ByPartition"
	case ByKey:
		return "ByKey"
	case Unordered:
		return "Unordered"
	}
	return fmt.Sprintf("OrderingScope(%d)", int(o))
}

// Defaults of the Source options.
const (
	DefaultCommitInterval         = time.Second
	DefaultCommitLinger           = 5 * time.Millisecond
	DefaultMaxUnackedPerPartition = 512
	DefaultMaxUnacked             = 4096
	DefaultRevokeDrain            = 10 * time.Second
	DefaultPollWait               = time.Second
	DefaultCommitTimeout          = 10 * time.Second
	DefaultLagRefresh             = 10 * time.Second
	// DefaultMetadataLimit is the offset-commit metadata limit of Kafka
	// brokers (offset.metadata.max.bytes).
	DefaultMetadataLimit = 4096
	// minMetadataLimit leaves room for the header and one run.
	minMetadataLimit = 32
)

// ClientFactory builds the franz-go client. The Source passes the options it
// needs (seed brokers, group, topics, callbacks) after the caller's own
// options from WithClientOptions.
type ClientFactory func(opts ...kgo.Opt) (*kgo.Client, error)

// Option configures a Source, a dead-letter sink or a Replay. Invalid values
// fail New, NewDeadLetter or NewReplay with an error naming the option.
// WithBrokers, WithClientOptions, WithClientFactory, WithGroup and
// WithLogger apply to all; the others to a Source only, and NewDeadLetter
// and NewReplay refuse them.
type Option func(*config) error

type config struct {
	brokers        []string
	group          string
	topics         []string
	clientOpts     []kgo.Opt
	factory        ClientFactory
	ordering       OrderingScope
	commitInterval time.Duration
	commitLinger   time.Duration
	commitTimeout  time.Duration
	maxPerPart     int
	maxTotal       int
	revokeDrain    time.Duration
	pollWait       time.Duration
	metadataLimit  int
	lagRefresh     time.Duration
	meterProvider  metric.MeterProvider
	logger         *slog.Logger
	// sourceOnly names the options given that apply to a Source only;
	// validate tells from it a default from a value given.
	sourceOnly []string
}

// sourceOnly marks an option that applies to a Source only.
func sourceOnly(name string, set func(*config) error) Option {
	return func(c *config) error {
		c.sourceOnly = append(c.sourceOnly, name)
		return set(c)
	}
}

// atLeast returns the Source-only option name, which stores v in the field
// given and refuses a v below lo, saying why.
func atLeast[T int | time.Duration](name string, v, lo T, why string, field func(*config) *T) Option {
	return sourceOnly(name, func(c *config) error {
		if v < lo {
			return fmt.Errorf("kafka: %s(%v): %s", name, v, why)
		}
		*field(c) = v
		return nil
	})
}

// apply returns the configuration opts make of the defaults.
func apply(opts []Option) (config, error) {
	cfg := defaultConfig()
	if err := option.Apply(&cfg, opts); err != nil {
		return cfg, err
	}
	return cfg, nil
}

func defaultConfig() config {
	return config{
		factory:        kgo.NewClient,
		commitInterval: DefaultCommitInterval,
		commitLinger:   DefaultCommitLinger,
		commitTimeout:  DefaultCommitTimeout,
		maxPerPart:     DefaultMaxUnackedPerPartition,
		maxTotal:       DefaultMaxUnacked,
		revokeDrain:    DefaultRevokeDrain,
		pollWait:       DefaultPollWait,
		metadataLimit:  DefaultMetadataLimit,
		lagRefresh:     DefaultLagRefresh,
	}
}

// WithBrokers sets the seed broker addresses (host:port). Required.
func WithBrokers(addrs ...string) Option {
	return func(c *config) error {
		if len(addrs) == 0 {
			return errors.New("kafka: WithBrokers: give at least one broker address")
		}
		if slices.Contains(addrs, "") {
			return errors.New("kafka: WithBrokers: empty broker address")
		}
		c.brokers = slices.Clone(addrs)
		return nil
	}
}

// WithGroup sets the consumer group. Required for a Source; a dead-letter
// sink writes it to the HeaderGroup header.
func WithGroup(group string) Option {
	return func(c *config) error {
		if group == "" {
			return errors.New("kafka: WithGroup: the group name must not be empty")
		}
		c.group = group
		return nil
	}
}

// WithTopics sets the topics the group consumes. Required.
func WithTopics(topics ...string) Option {
	return sourceOnly("WithTopics", func(c *config) error {
		if len(topics) == 0 {
			return errors.New("kafka: WithTopics: give at least one topic")
		}
		if slices.Contains(topics, "") {
			return errors.New("kafka: WithTopics: empty topic name")
		}
		c.topics = slices.Clone(topics)
		return nil
	})
}

// WithClientOptions adds franz-go options to the client: TLS (kgo.DialTLSConfig),
// SASL (kgo.SASL), client id, fetch sizes, logger; for a dead-letter sink,
// kgo.ProducerBatchMaxBytes (see NewDeadLetter). Options that take over what
// the adapter manages (group, topics, commits, rebalance callbacks, and
// acks from all in-sync replicas without a linger for dead letters) are
// overridden by the adapter.
func WithClientOptions(opts ...kgo.Opt) Option {
	return func(c *config) error {
		c.clientOpts = append(c.clientOpts, opts...)
		return nil
	}
}

// WithClientFactory replaces kgo.NewClient, for callers that build or wrap
// their clients themselves. Default: kgo.NewClient.
func WithClientFactory(f ClientFactory) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("kafka: WithClientFactory: nil factory")
		}
		c.factory = f
		return nil
	}
}

// WithOrderingScope sets which records of a partition may run at the same
// time: ByPartition, ByKey or Unordered. Default ByPartition.
func WithOrderingScope(o OrderingScope) Option {
	return sourceOnly("WithOrderingScope", func(c *config) error {
		if o < ByPartition || o > Unordered {
			return fmt.Errorf("kafka: WithOrderingScope(%d): use ByPartition, ByKey or Unordered", int(o))
		}
		c.ordering = o
		return nil
	})
}

// WithCommitInterval sets the longest a done record waits for its commit
// when commits are not sent sooner (see WithCommitLinger), and how often a
// failed commit is tried again. Commits also happen on revoke and on Close.
// Default 1s.
func WithCommitInterval(d time.Duration) Option {
	return atLeast("WithCommitInterval", d, time.Millisecond, "must be at least 1ms",
		func(c *config) *time.Duration { return &c.commitInterval })
}

// WithCommitLinger sets how long the Source waits, once a record is marked
// done, before it commits: every partition's records marked done meanwhile
// go in the same request, one request in flight at a time. The linger
// bounds the work a crash repeats (about the records running at the crash
// plus a linger and a round trip's worth) and the request rate (at most one
// per linger plus round trip while records are being done). 0 commits as
// soon as the previous commit returns; the commit interval alone commits
// about once per interval. Default 5ms, or the commit interval if shorter;
// it must not exceed the commit interval.
func WithCommitLinger(d time.Duration) Option {
	return atLeast("WithCommitLinger", d, 0, "must not be negative",
		func(c *config) *time.Duration { return &c.commitLinger })
}

// WithCommitTimeout bounds one commit request. Default 10s.
func WithCommitTimeout(d time.Duration) Option {
	return atLeast("WithCommitTimeout", d, 1, "must be positive",
		func(c *config) *time.Duration { return &c.commitTimeout })
}

// WithMaxUnackedPerPartition bounds the records of one partition handed out
// and not yet acked: the partition's fetching pauses while its records
// polled and not acked (waiting or handed out) reach the bound. By key it is
// what bounds a slow key's records waiting behind it in the runtime (see
// the package documentation, section Ordering). Default 512, or
// WithMaxUnacked if lower. Must not exceed WithMaxUnacked.
func WithMaxUnackedPerPartition(n int) Option {
	return atLeast("WithMaxUnackedPerPartition", n, 1, "must be at least 1",
		func(c *config) *int { return &c.maxPerPart })
}

// WithMaxUnacked bounds the records handed out and not yet acked over all
// partitions, as AMQP's prefetch does: at the bound the Source stops
// polling. It is the most the runtime can hold, not what it holds:
// consumer.WithMaxInFlight (default max(2×concurrency, 20), at most this)
// bounds that, but for the records waiting by key behind their key's
// running one, which this bounds (see the package documentation, section
// Ordering); consumer.New refuses a concurrency above it, since the extra
// workers would never get a record. Default 4096.
func WithMaxUnacked(n int) Option {
	return atLeast("WithMaxUnacked", n, 1, "must be at least 1",
		func(c *config) *int { return &c.maxTotal })
}

// WithRevokeDrain sets how long a revoked partition's running handlers may
// run on before their contexts are cancelled (with adapters.ErrRevoked) and
// the partition's done prefix is committed (see the package documentation,
// section Rebalances). Keep it well below the group's rebalance timeout
// (kgo.RebalanceTimeout, 60s by default): the rebalance waits for it.
// Default 10s.
func WithRevokeDrain(d time.Duration) Option {
	return atLeast("WithRevokeDrain", d, 0, "must not be negative",
		func(c *config) *time.Duration { return &c.revokeDrain })
}

// WithPollWait bounds how long one Receive waits for records. Default 1s.
func WithPollWait(d time.Duration) Option {
	return atLeast("WithPollWait", d, time.Millisecond, "must be at least 1ms",
		func(c *config) *time.Duration { return &c.pollWait })
}

// WithMetadataLimit sets the size limit of the offset-commit metadata that
// carries done offsets beyond the committed one. It must not exceed the
// brokers' offset.metadata.max.bytes. A partition whose metadata could
// outgrow it stops taking new records until its prefix catches up. Default
// 4096 bytes; at least 32.
func WithMetadataLimit(n int) Option {
	return atLeast("WithMetadataLimit", n, minMetadataLimit, fmt.Sprintf("must be at least %d bytes", minMetadataLimit),
		func(c *config) *int { return &c.metadataLimit })
}

// WithLagRefresh sets how old a partition's end offset may grow before the
// Source lists it from the brokers (one ListOffsets request for all such
// partitions). Fetches bring the end offset, but a partition paused for
// backpressure, not fetched while the runtime is behind, or with nothing to
// read brings none: its lag would stand still exactly while it grows.
// Default 10s; 0 turns the refresh off (lag from fetches alone).
func WithLagRefresh(d time.Duration) Option {
	return atLeast("WithLagRefresh", d, 0, "must not be negative (0 turns the refresh off)",
		func(c *config) *time.Duration { return &c.lagRefresh })
}

// WithMeterProvider sets where the Source's metrics go (see the package
// documentation, section Telemetry). Default: the global otel MeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return sourceOnly("WithMeterProvider", func(c *config) error {
		if mp == nil {
			return errors.New("kafka: WithMeterProvider: nil provider")
		}
		c.meterProvider = mp
		return nil
	})
}

// WithLogger sets where the Source, a dead-letter sink or a Replay logs a
// broker it cannot connect to (once, not once per attempt, while franz-go
// keeps trying) and the connection back. Default: slog.Default(), like the
// consumer's own.
func WithLogger(l *slog.Logger) Option {
	return func(c *config) error {
		if l == nil {
			return errors.New("kafka: WithLogger: nil logger")
		}
		c.logger = l
		return nil
	}
}

func (c *config) validate() error {
	if err := c.validateClient(); err != nil {
		return err
	}
	if c.group == "" {
		return errors.New("kafka: WithGroup is required: give the consumer group name")
	}
	if len(c.topics) == 0 {
		return errors.New("kafka: WithTopics is required: give the topics to consume")
	}
	if !slices.Contains(c.sourceOnly, "WithCommitLinger") {
		c.commitLinger = min(c.commitLinger, c.commitInterval)
	}
	if c.commitLinger > c.commitInterval {
		return fmt.Errorf("kafka: WithCommitLinger(%v) exceeds WithCommitInterval(%v): give a linger up to the interval (the interval alone commits about once per interval)", c.commitLinger, c.commitInterval)
	}
	if !slices.Contains(c.sourceOnly, "WithMaxUnackedPerPartition") {
		c.maxPerPart = min(c.maxPerPart, c.maxTotal)
	}
	if c.maxPerPart > c.maxTotal {
		return fmt.Errorf("kafka: WithMaxUnackedPerPartition(%d) exceeds WithMaxUnacked(%d)", c.maxPerPart, c.maxTotal)
	}
	if c.meterProvider == nil {
		c.meterProvider = otel.GetMeterProvider()
	}
	return nil
}

// validateClient checks and completes what a Source and a dead-letter sink
// both need to build a client.
func (c *config) validateClient() error {
	if len(c.brokers) == 0 {
		return errors.New("kafka: WithBrokers is required: give the seed broker addresses")
	}
	if c.logger == nil {
		c.logger = slog.Default()
	}
	return nil
}

// clientConfig returns the configuration opts make for a client that is not
// a Source's (fn names the constructor): Source-only options are refused.
func clientConfig(fn string, opts []Option) (config, error) {
	cfg, err := apply(opts)
	if err != nil {
		return cfg, err
	}
	if len(cfg.sourceOnly) > 0 {
		return cfg, fmt.Errorf("kafka: %s: %s only apply to a Source", fn, strings.Join(cfg.sourceOnly, ", "))
	}
	return cfg, cfg.validateClient()
}

// kgoOpts returns the caller's client options, then the hook w, the seed
// brokers and extra, which override the caller's.
func (c *config) kgoOpts(w *connWatch, extra ...kgo.Opt) []kgo.Opt {
	opts := append([]kgo.Opt(nil), c.clientOpts...)
	opts = append(opts, kgo.WithHooks(w), kgo.SeedBrokers(c.brokers...))
	return append(opts, extra...)
}

// connect builds a client with opts and reaches the cluster within ctx. Its
// errors start with "kafka: " and fn.
func (c *config) connect(ctx context.Context, fn string, opts []kgo.Opt) (*kgo.Client, error) {
	cl, err := c.factory(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: %screating the client: %w", fn, err)
	}
	if err := cl.Ping(ctx); err != nil {
		cl.Close()
		return nil, fmt.Errorf("kafka: %sreaching the brokers %s: %w", fn, strings.Join(c.brokers, ", "), err)
	}
	return cl, nil
}
