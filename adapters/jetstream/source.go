package jetstream

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// Source receives from one durable pull consumer of a JetStream stream.
// Create it with [New]; the runtime (package consumer) drives it. Its
// methods are safe for concurrent use.
type Source struct {
	js       jetstream.JetStream
	nc       *nats.Conn
	cons     jetstream.Consumer
	stream   string
	consumer string
	info     jetstream.ConsumerConfig
	opts     options
	caps     adapters.Capabilities
	replies  *replies
	conn     *connWatch
	stats    counters
	tel      *telemetry

	streamMu     sync.Mutex
	streamHandle jetstream.Stream // looked up by the first Backlog that needs it

	closeCtx  context.Context // done once Close is called
	closeNow  context.CancelFunc
	closeOnce sync.Once
}

var (
	_ adapters.Source   = (*Source)(nil)
	_ adapters.Extender = (*Source)(nil)
)

// New returns a Source over the durable pull consumer named consumer of
// stream, through js (whose connection you own: Close never closes it). It
// binds to the consumer, which must exist, or creates or updates it with
// WithCreate; ctx bounds the calls New makes.
//
// New fails, saying what to change, when the server is older than 2.7.1
// (delayed naks), and when the consumer is a push consumer, does not ack
// explicitly, has a BackOff list, or has a MaxDeliver limit that
// WithMaxAttempts does not vouch for (see the package documentation).
func New(ctx context.Context, js jetstream.JetStream, stream, consumer string, opts ...Option) (*Source, error) {
	if js == nil {
		return nil, errors.New("jetstream.New: nil JetStream; pass jetstream.New(nc)")
	}
	if stream == "" || consumer == "" {
		return nil, fmt.Errorf("jetstream.New(%q, %q): name the stream and the durable consumer", stream, consumer)
	}
	o := defaultOptions()
	if err := option.Apply(&o, opts); err != nil {
		return nil, err
	}
	nc := js.Conn()
	if err := checkServer(nc); err != nil {
		return nil, fmt.Errorf("jetstream.New: %w", err)
	}
	var (
		cons jetstream.Consumer
		err  error
	)
	if o.create != nil {
		cfg := *o.create
		if (cfg.Durable != "" && cfg.Durable != consumer) || (cfg.Name != "" && cfg.Name != consumer) {
			return nil, fmt.Errorf("jetstream.New: WithCreate names the consumer %q, but New was given %q", cfg.Durable+cfg.Name, consumer)
		}
		cfg.Durable, cfg.Name = consumer, ""
		cfg.AckPolicy = jetstream.AckExplicitPolicy
		if cfg.AckWait == 0 {
			cfg.AckWait = DefaultAckWait
		}
		if cfg.MaxDeliver == 0 {
			cfg.MaxDeliver = -1
		}
		cons, err = js.CreateOrUpdateConsumer(ctx, stream, cfg)
		if err != nil {
			return nil, fmt.Errorf("jetstream.New: creating consumer %q on stream %q: %w", consumer, stream, err)
		}
	} else {
		cons, err = js.Consumer(ctx, stream, consumer)
		if err != nil {
			hint := ""
			switch {
			case errors.Is(err, jetstream.ErrConsumerNotFound):
				hint = " (create it, or pass jetstream.WithCreate)"
			case errors.Is(err, jetstream.ErrNotPullConsumer):
				hint = " (custody fetches: use a pull consumer)"
			}
			return nil, fmt.Errorf("jetstream.New: binding to consumer %q of stream %q%s: %w", consumer, stream, hint, err)
		}
	}
	info := cons.CachedInfo()
	if err := checkConsumer(info.Config, o, consumer); err != nil {
		return nil, err
	}
	r, err := newReplies(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream.New: %w", err)
	}
	s := &Source{
		js:       js,
		nc:       nc,
		cons:     cons,
		stream:   stream,
		consumer: consumer,
		info:     info.Config,
		opts:     o,
		replies:  r,
	}
	s.closeCtx, s.closeNow = context.WithCancel(context.Background())
	s.caps = adapters.Capabilities{
		Name:             "jetstream:" + stream + "/" + consumer,
		System:           "nats",
		Lease:            info.Config.AckWait,
		NackDelay:        true,
		CountsDeliveries: true,
		Ordered:          o.ordered,
		MaxUnacked:       info.Config.MaxAckPending,
		MaxReceive:       o.maxFetch,
		Ack:              ackBatching,
		Nack:             ackBatching,
	}
	if o.ackBatching != nil {
		s.caps.Ack = *o.ackBatching
	}
	if o.receivers > 0 {
		s.caps.Receivers = o.receivers
	}
	s.stats.pending.Store(int64(info.NumPending))
	mp := o.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if s.tel, err = newTelemetry(mp, s); err != nil {
		r.close()
		return nil, fmt.Errorf("jetstream.New: metrics: %w", err)
	}
	s.conn = watchConn(nc)
	return s, nil
}

// How the runtime batches acks and naks (see Acks, retries and shutdown in
// the package documentation); the linger saves no requests, so it is kept
// short. BenchmarkDeclarations measures it against the workers sending, one
// call at a time: 7-15% more no-op throughput, 3-6% more with a 1 ms
// handler at concurrency 64 (docs/jetstream.md). Renewals take the
// runtime's defaults; a second Receiver measured no clear gain.
var ackBatching = adapters.Batching{Linger: 200 * time.Microsecond, MaxCalls: 8}

// minServer is the oldest server with delayed naks.
var minServer = [3]int{2, 7, 1}

var versionRE = regexp.MustCompile(`^v?(\d+)\.(\d+)\.(\d+)`)

func checkServer(nc *nats.Conn) error {
	if nc == nil {
		return errors.New("the JetStream has no connection")
	}
	v := nc.ConnectedServerVersion()
	m := versionRE.FindStringSubmatch(v)
	if m == nil {
		return fmt.Errorf("cannot read the server's version %q (not connected?)", v)
	}
	var got [3]int
	for i := range got {
		got[i], _ = strconv.Atoi(m[i+1])
	}
	if slices.Compare(got[:], minServer[:]) < 0 {
		return fmt.Errorf("server version %s is older than 2.7.1, which delayed naks need; upgrade nats-server", v)
	}
	return nil
}

// checkConsumer refuses consumer configurations that would fight the
// runtime (see the package documentation).
func checkConsumer(cfg jetstream.ConsumerConfig, o options, name string) error {
	switch {
	case cfg.AckPolicy != jetstream.AckExplicitPolicy:
		return fmt.Errorf("jetstream.New: consumer %q has AckPolicy %v; custody acks each message on its own: give it AckPolicy explicit", name, cfg.AckPolicy)
	case cfg.DeliverSubject != "":
		return fmt.Errorf("jetstream.New: consumer %q is a push consumer (DeliverSubject %q); custody fetches: use a pull consumer", name, cfg.DeliverSubject)
	case len(cfg.BackOff) > 0:
		return fmt.Errorf("jetstream.New: consumer %q has BackOff %v: the server would time redeliveries by it, shifting every delayed nak of the runtime by BackOff[n] minus AckWait and giving later deliveries leases other than AckWait; remove BackOff (consumer.Retry picks the delays)", name, cfg.BackOff)
	case cfg.AckWait <= 0:
		return fmt.Errorf("jetstream.New: consumer %q reports AckWait %v; give it an AckWait", name, cfg.AckWait)
	case cfg.MaxDeliver > 0 && o.maxAttempts == 0:
		return fmt.Errorf("jetstream.New: consumer %q has MaxDeliver %d: the server stops delivering a message after that many deliveries, leaving it in the stream with only an advisory; pass jetstream.WithMaxAttempts(the consumer's Retry.MaxAttempts) to have it checked, or set MaxDeliver to -1", name, cfg.MaxDeliver)
	case cfg.MaxDeliver > 0 && cfg.MaxDeliver < o.maxAttempts:
		return fmt.Errorf("jetstream.New: consumer %q has MaxDeliver %d, below the runtime's MaxAttempts %d (WithMaxAttempts): the server would stop delivering a message before the runtime dead-letters it; raise MaxDeliver to at least %d, or to -1", name, cfg.MaxDeliver, o.maxAttempts, o.maxAttempts)
	}
	return nil
}

// Capabilities reports a lease of the consumer's AckWait, delayed naks, the
// server's delivery count, MaxAckPending as MaxUnacked, and fetches of up to
// WithMaxFetch messages; ordered by key with WithOrderedKeys.
func (s *Source) Capabilities() adapters.Capabilities { return s.caps }

// Stream returns the name of the stream the Source reads.
func (s *Source) Stream() string { return s.stream }

// Consumer returns the name of the durable consumer the Source reads.
func (s *Source) Consumer() string { return s.consumer }

// ConsumerConfig returns the consumer's configuration as New found it.
func (s *Source) ConsumerConfig() jetstream.ConsumerConfig { return s.info }

// Close stops receiving: a Receive waiting returns adapters.ErrClosed, and
// messages its fetch brings after that are given back at once (nak). It
// leaves the consumer on the server, and unacked messages to their AckWait;
// the runtime has given back what it did not finish before it closes. After
// Close, acks, naks and renewals fail. Close never closes the connection.
func (s *Source) Close() error {
	s.closeOnce.Do(func() {
		s.closeNow()
		s.replies.close()
		s.tel.close()
		s.conn.stop()
	})
	return nil
}

func (s *Source) isClosed() bool { return s.closeCtx.Err() != nil }
