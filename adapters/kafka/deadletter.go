package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// HeaderGroup is the dead-letter header naming the consumer group that gave up
// on the record.
const HeaderGroup = "custody-group"

// DeadLetterConfig configures a dead-letter topic sink.
type DeadLetterConfig struct {
	// Topic receives the dead-lettered records. Required.
	Topic string
	// Brokers are the seed brokers. Required unless Client is set.
	Brokers []string
	// Group is written to the HeaderGroup header (and to the consumer
	// diagnostic header when the runtime names no consumer).
	Group string
	// ClientOptions are extra franz-go options (TLS, SASL, client id,
	// kgo.ProducerBatchMaxBytes: a copy is its record plus up to about 2 KiB
	// of diagnostics and its key once more, so records near the size limit
	// need a higher one here, and on the topic). The sink adds its own: acks
	// from all in-sync replicas (forced) and no linger. Writes are
	// idempotent, franz-go's default, unless these options disable it
	// (kgo.DisableIdempotentWrite), which the sink does not undo.
	ClientOptions []kgo.Opt
	// Client, when set, is used instead of creating one; the sink does not
	// close it. It must produce with acks=all for the guarantee to hold.
	Client *kgo.Client
	// Logger receives the connection trouble of the client the sink
	// creates: a broker it cannot connect to, once, and the connection
	// back. Default: slog.Default().
	Logger *slog.Logger
}

// DeadLetter produces records that will not be processed to a dead-letter
// topic. It implements adapters.DeadLetter. Create it with NewDeadLetter or
// Source.DeadLetter.
type DeadLetter struct {
	cl    *kgo.Client
	own   bool
	topic string
	group string
}

// NewDeadLetter creates a dead-letter topic sink. Close it after the consumer
// that uses it has returned.
func NewDeadLetter(cfg DeadLetterConfig) (*DeadLetter, error) {
	if cfg.Topic == "" {
		return nil, errors.New("kafka: DeadLetterConfig.Topic is required")
	}
	dl := &DeadLetter{topic: cfg.Topic, group: cfg.Group, cl: cfg.Client}
	if dl.cl != nil {
		return dl, nil
	}
	if len(cfg.Brokers) == 0 {
		return nil, errors.New("kafka: DeadLetterConfig.Brokers is required when no Client is given")
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.Default()
	}
	opts := append([]kgo.Opt(nil), cfg.ClientOptions...)
	opts = append(opts,
		kgo.WithHooks(newConnLog(logger, "dead-letter sink of topic "+cfg.Topic)),
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
	)
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: creating the dead-letter client: %w", err)
	}
	dl.cl, dl.own = cl, true
	return dl, nil
}

// DeadLetter creates a sink on topic with the Source's brokers, client options
// and group.
func (s *Source) DeadLetter(topic string) (*DeadLetter, error) {
	return NewDeadLetter(DeadLetterConfig{
		Topic:         topic,
		Brokers:       s.cfg.brokers,
		Group:         s.cfg.group,
		ClientOptions: s.cfg.clientOpts,
		Logger:        s.cfg.logger,
	})
}

// Send implements adapters.DeadLetter. It produces the original key, value and
// headers with the diagnostic headers, and returns nil only once the brokers
// acknowledged the record. Diagnostic headers the original already carried
// (it was dead-lettered before and replayed) are replaced, not kept beside
// the new ones. On error nothing is marked: the original stays
// uncommitted and the runtime tries again or gives it back.
func (dl *DeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	diag := adapters.Diagnostics(d, f)
	if dl.group != "" {
		diag[HeaderGroup] = dl.group
		if _, ok := diag[adapters.HeaderConsumer]; !ok {
			diag[adapters.HeaderConsumer] = dl.group
		}
	}
	rec := &kgo.Record{Topic: dl.topic}
	var orig *kgo.Record
	if d.As(&orig) && orig != nil {
		rec.Key, rec.Value = orig.Key, orig.Value
		for _, h := range orig.Headers {
			if keepHeader(h.Key, diag) {
				rec.Headers = append(rec.Headers, h)
			}
		}
	} else {
		if d.Key != "" {
			rec.Key = []byte(d.Key)
		}
		rec.Value = d.Body
		for k, v := range d.Headers {
			if keepHeader(k, diag) {
				rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
			}
		}
	}
	for k, v := range diag {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	if err := dl.cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		if errors.Is(err, kerr.MessageTooLarge) || errors.Is(err, kerr.RecordListTooLarge) {
			// Retrying cannot help, and the partition waits on the record
			// until it leaves: say what to change, on every try.
			return fmt.Errorf("kafka: the dead-letter copy of %s (%d bytes: the record, its key once more and the diagnostics) "+
				"is too large for topic %q; the partition waits on it until the copy fits: raise the topic's max.message.bytes "+
				"and the sink's kgo.ProducerBatchMaxBytes (DeadLetterConfig.ClientOptions) a few KiB above the source topic's: %w",
				d.ID, recordSize(rec), dl.topic, err)
		}
		return fmt.Errorf("kafka: producing to dead-letter topic %q: %w", dl.topic, err)
	}
	return nil
}

// recordSize is the bytes of r's key, value and headers, about what the
// producer measures against its limit.
func recordSize(r *kgo.Record) int {
	n := len(r.Key) + len(r.Value)
	for _, h := range r.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// keepHeader reports whether the copy keeps the original's header k: not
// when diag replaces it, nor when it is a diagnostic of an earlier trip to a
// dead-letter destination (a replayed copy), which would otherwise sit beside
// the new diagnostics and describe the wrong failure.
func keepHeader(k string, diag map[string]string) bool {
	if _, clash := diag[k]; clash {
		return false
	}
	return !adapters.IsDiagnosticHeader(k) && k != HeaderGroup
}

// Close closes the sink's client (not a client given in the config).
func (dl *DeadLetter) Close() error {
	if dl.own {
		dl.cl.Close()
	}
	return nil
}
