package kafka

import (
	"context"
	"errors"
	"fmt"

	"github.com/custody-go/custody/adapters"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// HeaderGroup is the dead-letter header naming the consumer group that gave up
// on the record.
const HeaderGroup = "custody-group"

// DeadLetter produces records that will not be processed to a dead-letter
// topic. It implements adapters.DeadLetter. Create it with NewDeadLetter, or
// with Source.NewDeadLetter to produce through the Source's client.
type DeadLetter struct {
	cl    *kgo.Client
	own   bool // the sink made cl and closes it
	topic string
	group string
}

// NewDeadLetter creates a sink producing to topic, with a franz-go client of
// its own, and reaches the cluster within ctx: it fails, with the cause, when
// no broker answers before ctx ends, or when the topic does not exist (unless
// kgo.AllowAutoTopicCreation), so that a wrong address or name shows here
// rather than at the first poison record. WithBrokers is required;
// WithGroup (written to the HeaderGroup header), WithClientOptions,
// WithClientFactory and WithLogger apply; the Source's other options are
// refused.
//
// The sink produces with acks from all in-sync replicas (forced) and no
// linger; writes are idempotent unless the client options disable it
// (kgo.DisableIdempotentWrite). A copy is its record plus up to about 2 KiB
// of diagnostics and its key once more: records near the size limit need a
// higher kgo.ProducerBatchMaxBytes here, and on the topic. Close the sink
// after the consumer that uses it has returned.
func NewDeadLetter(ctx context.Context, topic string, opts ...Option) (*DeadLetter, error) {
	if topic == "" {
		return nil, errors.New("kafka: NewDeadLetter: the topic must not be empty")
	}
	cfg, err := clientConfig("NewDeadLetter", opts)
	if err != nil {
		return nil, err
	}
	cl, err := cfg.connect(ctx, "NewDeadLetter: ", cfg.kgoOpts(newConnWatch(cfg.logger, "dead-letter sink of topic "+topic),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(0),
	))
	if err != nil {
		return nil, err
	}
	if err := checkTopic(ctx, cl, topic); err != nil {
		cl.Close()
		return nil, err
	}
	return &DeadLetter{cl: cl, own: true, topic: topic, group: cfg.group}, nil
}

// NewDeadLetter creates a sink producing to topic through the Source's
// client, with its group written to the HeaderGroup header. It fails, with
// the cause, when the topic does not exist (see the function NewDeadLetter)
// or ctx ends before the cluster answers. The sink works while the Source is
// open (the runtime sends its last dead letter before it closes the Source);
// its Close does nothing.
func (s *Source) NewDeadLetter(ctx context.Context, topic string) (*DeadLetter, error) {
	if topic == "" {
		return nil, errors.New("kafka: Source.NewDeadLetter: the topic must not be empty")
	}
	if err := checkTopic(ctx, s.cl, topic); err != nil {
		return nil, err
	}
	return &DeadLetter{cl: s.cl, topic: topic, group: s.cfg.group}, nil
}

// checkTopic fails unless topic exists or cl may create it.
func checkTopic(ctx context.Context, cl *kgo.Client, topic string) error {
	if auto, _ := cl.OptValue(kgo.AllowAutoTopicCreation).(bool); auto {
		return nil
	}
	details, err := kadm.NewClient(cl).ListTopics(ctx, topic)
	if err != nil {
		return fmt.Errorf("kafka: looking up dead-letter topic %q: %w", topic, err)
	}
	d, ok := details[topic]
	switch {
	case !ok || errors.Is(d.Err, kerr.UnknownTopicOrPartition):
		return fmt.Errorf("kafka: dead-letter topic %q does not exist: create it, or let the client create it (kgo.AllowAutoTopicCreation)", topic)
	case d.Err != nil:
		return fmt.Errorf("kafka: looking up dead-letter topic %q: %w", topic, d.Err)
	}
	return nil
}

// Send implements adapters.DeadLetter. It produces the original key, value and
// headers with the diagnostic headers, and returns nil only once the brokers
// acknowledged the record. Diagnostic headers the original already carried
// (it was dead-lettered before and replayed) are replaced, not kept beside
// the new ones.
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
				"and the sink's kgo.ProducerBatchMaxBytes (WithClientOptions) a few KiB above the source topic's: %w",
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
// dead-letter destination (see Send).
func keepHeader(k string, diag map[string]string) bool {
	if _, clash := diag[k]; clash {
		return false
	}
	return !adapters.IsDiagnosticHeader(k) && k != HeaderGroup
}

// Close closes the sink's client; a sink made by Source.NewDeadLetter leaves
// the Source's client to the Source.
func (dl *DeadLetter) Close() error {
	if dl.own {
		dl.cl.Close()
	}
	return nil
}
