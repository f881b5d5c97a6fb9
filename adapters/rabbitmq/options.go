package rabbitmq

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/custody-go/custody/internal/option"
)

// DefaultURL is the broker address used when neither WithURL nor WithDialFunc
// is given: the conventional local development broker.
const DefaultURL = "amqp://guest:guest@localhost:5672/"

// Option configures a Source (New), a dead-letter sink (NewDeadLetter) or a
// dead-letter replay (NewReplay). The connection options (WithURL,
// WithConfig, WithTLS, WithDialFunc), WithLogger and WithMeterProvider apply
// to all three, each other option to one, and the others refuse it by name.
type Option func(*settings) error

// QueueType says how a Source declares its queue.
type QueueType int

const (
	// CheckQueue only checks that the queue exists (a passive declare) and
	// fails New when it does not. The default.
	CheckQueue QueueType = iota
	// ClassicQueue declares a durable classic queue.
	ClassicQueue
	// QuorumQueue declares a quorum queue (x-queue-type=quorum).
	QuorumQueue
)

func (q QueueType) String() string {
	switch q {
	case ClassicQueue:
		return "classic"
	case QuorumQueue:
		return "quorum"
	default:
		return "check"
	}
}

type settings struct {
	url       string
	config    amqp.Config
	configSet bool
	dialFunc  func(ctx context.Context) (*amqp.Connection, error)
	logger    *slog.Logger
	meters    metric.MeterProvider

	prefetch        int
	consumerTag     string
	queueType       QueueType
	queueArgs       amqp.Table
	dlxByPolicy     bool
	delayQueues     bool
	consumerTimeout time.Duration
	reconnectMin    time.Duration
	reconnectMax    time.Duration
	pollWait        time.Duration
	closeTimeout    time.Duration

	// scoped lists the options given that apply to one constructor only.
	scoped []scopedOption

	replayThroughExchange bool // WithReplayThroughExchange

	deadLetterDeclare *deadLetterDeclare // WithDeclareDeadLetter
}

func defaultSettings() *settings {
	return &settings{
		url:             DefaultURL,
		prefetch:        256,
		consumerTimeout: 30 * time.Minute,
		reconnectMin:    100 * time.Millisecond,
		reconnectMax:    10 * time.Second,
		pollWait:        time.Second,
		closeTimeout:    5 * time.Second,
	}
}

func apply(opts []Option) (*settings, error) {
	s := defaultSettings()
	if err := option.Apply(s, opts); err != nil {
		return nil, err
	}
	if s.dialFunc != nil && (s.configSet || s.url != DefaultURL) {
		return nil, errors.New("rabbitmq: WithDialFunc cannot be combined with WithURL, WithConfig or WithTLS: the dial function decides how to connect")
	}
	if s.config.Recovery != nil {
		return nil, errors.New("rabbitmq: WithConfig: Config.Recovery must be nil; the adapter reconnects by itself and must see every new channel to keep delivery tags apart")
	}
	if s.logger == nil {
		s.logger = slog.Default()
	}
	if s.meters == nil {
		s.meters = otel.GetMeterProvider()
	}
	return s, nil
}

// countsDeliveries reports whether Delivery.Attempt survives a redelivery:
// a quorum queue counts deliveries, and a delay queue's copy carries
// HeaderAttempt. A classic queue only flags a redelivery, and a queue the
// Source only checks may be either.
func (s *settings) countsDeliveries() bool {
	return s.delayQueues || s.queueType == QuorumQueue
}

// maxHold is how long a delivery may stay unacked: the broker closes the
// channel of one held for its consumer timeout. A margin (a quarter of it,
// at most a minute) leaves time to give it back first.
func (s *settings) maxHold() time.Duration {
	return s.consumerTimeout - min(s.consumerTimeout/4, time.Minute)
}

type scopedOption struct{ name, ctor string }

// only records that the option name applies to the constructor ctor only.
func (s *settings) only(ctor, name string) {
	s.scoped = append(s.scoped, scopedOption{name, ctor})
}

// applyFor applies opts for the constructor ctor, which refuses by name the
// options that apply to another constructor only.
func applyFor(ctor string, opts []Option) (*settings, error) {
	s, err := apply(opts)
	if err != nil {
		return nil, err
	}
	var foreign []string
	for _, o := range s.scoped {
		if o.ctor != ctor {
			foreign = append(foreign, o.name+" (only for "+o.ctor+")")
		}
	}
	if len(foreign) > 0 {
		return nil, fmt.Errorf("rabbitmq: %s: options for another constructor: %s", ctor, strings.Join(foreign, ", "))
	}
	return s, nil
}

// WithURL sets the AMQP URL to dial (default DefaultURL). amqps:// URLs use
// TLS; see WithTLS to configure it.
func WithURL(url string) Option {
	return func(s *settings) error {
		if url == "" {
			return errors.New("rabbitmq: WithURL: the URL is empty")
		}
		if _, err := amqp.ParseURI(url); err != nil {
			return fmt.Errorf("rabbitmq: WithURL: %w", err)
		}
		s.url = url
		return nil
	}
}

// WithConfig sets the amqp091 connection configuration used with the URL
// (heartbeat, vhost, TLS, SASL, client properties). Default: amqp091's
// defaults (10 s heartbeat). Config.Recovery must be nil.
func WithConfig(cfg amqp.Config) Option {
	return func(s *settings) error {
		tlsCfg := s.config.TLSClientConfig
		s.config = cfg
		if s.config.TLSClientConfig == nil {
			s.config.TLSClientConfig = tlsCfg
		}
		s.configSet = true
		return nil
	}
}

// WithTLS sets the TLS client configuration (default: none, or an empty
// configuration for amqps:// URLs).
func WithTLS(cfg *tls.Config) Option {
	return func(s *settings) error {
		if cfg == nil {
			return errors.New("rabbitmq: WithTLS: the configuration is nil")
		}
		s.config.TLSClientConfig = cfg
		s.configSet = true
		return nil
	}
}

// WithDialFunc makes the adapter obtain each connection, the first and every
// reconnection, from dial instead of dialing a URL. Each call must return a
// new connection, which the adapter then owns and closes. The connection must
// not have automatic recovery enabled.
func WithDialFunc(dial func(ctx context.Context) (*amqp.Connection, error)) Option {
	return func(s *settings) error {
		if dial == nil {
			return errors.New("rabbitmq: WithDialFunc: the function is nil")
		}
		s.dialFunc = dial
		return nil
	}
}

// WithLogger sets where the adapter logs reconnections and warnings.
// Default: slog.Default(), like the consumer's own.
func WithLogger(l *slog.Logger) Option {
	return func(s *settings) error {
		if l == nil {
			return errors.New("rabbitmq: WithLogger: the logger is nil")
		}
		s.logger = l
		return nil
	}
}

// WithMeterProvider sets where the adapter's metrics go (see the package
// documentation, section Telemetry). Default: the global OpenTelemetry
// MeterProvider.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(s *settings) error {
		if mp == nil {
			return errors.New("rabbitmq: WithMeterProvider: the provider is nil")
		}
		s.meters = mp
		return nil
	}
}

// WithPrefetch sets the channel's QoS prefetch count: how many unacked
// deliveries the broker lets this consumer hold (default 256). It must be at
// least the consumer's concurrency, or workers idle while the window is full;
// deliveries the runtime holds while their retry waits in place also occupy
// it. At most 65535.
//
// Every delivery in the window waits its turn unacked, and the broker closes
// the channel (redelivering them all) when one waits past its
// consumer_timeout. With slow handlers keep prefetch × handler time /
// concurrency well under that timeout: at concurrency 1 and 10 s a message,
// the default 256 makes the last one wait 42 minutes, past the default 30.
func WithPrefetch(n int) Option {
	return func(s *settings) error {
		s.only("New", "WithPrefetch")
		if n < 1 || n > 65535 {
			return fmt.Errorf("rabbitmq: WithPrefetch(%d): the prefetch must be between 1 and 65535", n)
		}
		s.prefetch = n
		return nil
	}
}

// WithConsumerTag sets the consumer tag, at most 255 bytes (default:
// "custody-" followed by the queue name, cut to fit, and a random suffix).
// Each connection uses it anew after a reconnect.
func WithConsumerTag(tag string) Option {
	return func(s *settings) error {
		s.only("New", "WithConsumerTag")
		if tag == "" {
			return errors.New("rabbitmq: WithConsumerTag: the tag is empty")
		}
		if err := checkShortstr("WithConsumerTag", "tag", tag); err != nil {
			return err
		}
		s.consumerTag = tag
		return nil
	}
}

// WithDeclare makes the Source declare its queue, durable, with the given
// type and arguments (for example x-dead-letter-exchange,
// x-dead-letter-routing-key, x-delivery-limit), on every connection. The
// default, CheckQueue, only checks that the queue exists.
func WithDeclare(t QueueType, args amqp.Table) Option {
	return func(s *settings) error {
		s.only("New", "WithDeclare")
		all, err := declareArgs("WithDeclare", t, args)
		if err != nil {
			return err
		}
		s.queueType, s.queueArgs = t, all
		return nil
	}
}

// declareArgs checks a queue type and its arguments for the option named
// opt, and returns a copy of the arguments with x-queue-type set for a
// quorum queue.
func declareArgs(opt string, t QueueType, args amqp.Table) (amqp.Table, error) {
	switch t {
	case CheckQueue, ClassicQueue, QuorumQueue:
	default:
		return nil, fmt.Errorf("rabbitmq: %s: unknown queue type %d", opt, int(t))
	}
	if t == CheckQueue && len(args) > 0 {
		return nil, fmt.Errorf("rabbitmq: %s(CheckQueue, args): arguments only apply when the queue is declared; use ClassicQueue or QuorumQueue", opt)
	}
	if qt, ok := args["x-queue-type"]; ok {
		want := t.String()
		if v, _ := qt.(string); v != want {
			return nil, fmt.Errorf("rabbitmq: %s(%s): argument x-queue-type=%v contradicts the queue type", opt, want, qt)
		}
	}
	all := amqp.Table{}
	for k, v := range args {
		all[k] = v
	}
	if t == QuorumQueue {
		all["x-queue-type"] = "quorum"
	}
	return all, nil
}

// WithDeadLetterByPolicy tells the Source that a broker policy (rather than
// the queue's declared arguments) gives its queue a dead-letter exchange, so
// NativeDeadLetter may reject messages into it.
func WithDeadLetterByPolicy() Option {
	return func(s *settings) error {
		s.only("New", "WithDeadLetterByPolicy")
		s.dlxByPolicy = true
		return nil
	}
}

// WithDelayQueues makes the broker hold retries back (default: off, and the
// runtime waits out each retry in place, holding a prefetch slot). With it
// the Source reports NackDelay, and a retry publishes a copy carrying its
// next attempt to a quorum delay queue that dead-letters it back after the
// delay; the original is acked once the broker confirmed the copy. It needs
// RabbitMQ 3.10 or later and a user who may declare queues (New declares one
// delay queue to check). Read what delay queues leave to the broker before
// turning them on: the package documentation, section Retries, and
// docs/rabbitmq.md.
func WithDelayQueues() Option {
	return func(s *settings) error {
		s.only("New", "WithDelayQueues")
		s.delayQueues = true
		return nil
	}
}

// WithConsumerTimeout tells the adapter the broker's consumer_timeout
// (default 30 min, RabbitMQ's default), after which the broker closes the
// channel of a delivery still unacked. The adapter warns about deliveries
// held for more than half of it and reports it, less a quarter (at most a
// minute), as Capabilities.MaxLeaseAge.
func WithConsumerTimeout(d time.Duration) Option {
	return func(s *settings) error {
		s.only("New", "WithConsumerTimeout")
		if d < time.Second {
			return fmt.Errorf("rabbitmq: WithConsumerTimeout(%v): the timeout must be at least 1s", d)
		}
		s.consumerTimeout = d
		return nil
	}
}

// WithReconnectBackoff sets the delays between reconnection attempts: from
// initial, doubling, up to max, with jitter (defaults 100 ms and 10 s). The
// first wait is initial again after a connection that lived at least max;
// each connection in a row that died sooner doubles it once more.
func WithReconnectBackoff(initial, max time.Duration) Option {
	return func(s *settings) error {
		s.only("New", "WithReconnectBackoff")
		if initial <= 0 || max < initial {
			return fmt.Errorf("rabbitmq: WithReconnectBackoff(%v, %v): need 0 < initial <= max", initial, max)
		}
		s.reconnectMin, s.reconnectMax = initial, max
		return nil
	}
}

// WithPollWait sets how long Receive waits for a delivery before returning
// an empty batch (default 1 s).
func WithPollWait(d time.Duration) Option {
	return func(s *settings) error {
		s.only("New", "WithPollWait")
		if d <= 0 {
			return fmt.Errorf("rabbitmq: WithPollWait(%v): the wait must be above zero", d)
		}
		s.pollWait = d
		return nil
	}
}
