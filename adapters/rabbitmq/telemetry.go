package rabbitmq

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

const meterName = "github.com/custody-go/custody/adapters/rabbitmq"

// publishBounds are the bucket boundaries, in seconds, of
// custody.rabbitmq.publish.duration: the SDK's defaults, meant for
// milliseconds, would put every publish under five seconds in one bucket.
var publishBounds = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30}

// Kinds of copies the adapter publishes, the value of attribute
// custody.rabbitmq.copy.
const (
	copyDelayQueue = "delay_queue" // a retry's copy, to its delay queue
	copyQueue      = "queue"       // a retry's copy, to the queue at once
	copyDeadLetter = "dead_letter" // a dead letter's copy, through the sink
	copyReplay     = "replay"      // a dead letter's copy, replayed to its queue
)

// telemetry holds the instruments of a Source, a DeadLetter sink or a
// Replay (see the package documentation, section Telemetry); a sink and a
// replay report publishes only.
type telemetry struct {
	acked, frames, dropped, rejects, lost, reconnects, publishes metric.Int64Counter
	publishDur                                                   metric.Float64Histogram

	// Attributes, as the variadic arguments of Add and Record, made once:
	// passing a slice made per call would cost an allocation per ack.
	dest             []metric.AddOption // the destination alone
	single, multiple []metric.AddOption
	requeue, reject  []metric.AddOption
	pubOK, pubErr    map[string]metric.MeasurementOption // by kind of copy
}

// queueTelemetry returns the instruments of the Source for queue, or of
// the Replay of dead-letter queue queue.
func queueTelemetry(mp metric.MeterProvider, queue string) (*telemetry, error) {
	return newTelemetry(mp, attribute.String("messaging.destination.name", queue))
}

// sinkTelemetry returns the instruments of the sink that publishes to
// exchange with routing key.
func sinkTelemetry(mp metric.MeterProvider, exchange, key string) (*telemetry, error) {
	return newTelemetry(mp, attribute.String("messaging.destination.name", exchange),
		attribute.String("messaging.rabbitmq.destination.routing_key", key))
}

func newTelemetry(mp metric.MeterProvider, dest ...attribute.KeyValue) (*telemetry, error) {
	m := mp.Meter(meterName)
	t := &telemetry{}
	with := func(kv ...attribute.KeyValue) attribute.Set {
		return attribute.NewSet(append(append([]attribute.KeyValue(nil), dest...), kv...)...)
	}
	opts := func(set attribute.Set) []metric.AddOption {
		return []metric.AddOption{metric.WithAttributeSet(set)}
	}
	t.dest = opts(with())
	t.single = opts(with(attribute.Bool("rabbitmq.multiple", false)))
	t.multiple = opts(with(attribute.Bool("rabbitmq.multiple", true)))
	t.requeue = opts(with(attribute.Bool("rabbitmq.requeue", true)))
	t.reject = opts(with(attribute.Bool("rabbitmq.requeue", false)))
	t.pubOK, t.pubErr = map[string]metric.MeasurementOption{}, map[string]metric.MeasurementOption{}
	for _, kind := range []string{copyDelayQueue, copyQueue, copyDeadLetter, copyReplay} {
		t.pubOK[kind] = metric.WithAttributeSet(with(attribute.String("custody.rabbitmq.copy", kind), attribute.Bool("error", false)))
		t.pubErr[kind] = metric.WithAttributeSet(with(attribute.String("custody.rabbitmq.copy", kind), attribute.Bool("error", true)))
	}
	counters := []struct {
		c                 *metric.Int64Counter
		name, unit, about string
	}{
		{&t.acked, "custody.rabbitmq.acked", "{message}", "Deliveries acked on the wire."},
		{&t.frames, "custody.rabbitmq.ack.frames", "{frame}", "basic.ack frames written; rabbitmq.multiple says whether one acked several deliveries."},
		{&t.dropped, "custody.rabbitmq.acks.dropped", "{message}", "Acks not written because their channel had died or was closing; the broker delivers those messages again."},
		{&t.rejects, "custody.rabbitmq.rejects", "{frame}", "basic.nack frames, one delivery each: requeues, and native dead letters (rabbitmq.requeue false)."},
		{&t.lost, "custody.rabbitmq.deliveries.lost", "{message}", "Deliveries lost with their channel, or to Close; the broker delivers those messages again."},
		{&t.reconnects, "custody.rabbitmq.reconnects", "{connection}", "Channels replaced after one died."},
		{&t.publishes, "custody.rabbitmq.publishes", "{message}", "Copies published with publisher confirms: retries to a delay queue or to the queue, dead letters; error says the copy was not confirmed."},
	}
	for _, c := range counters {
		var err error
		if *c.c, err = m.Int64Counter(c.name, metric.WithUnit(c.unit), metric.WithDescription(c.about)); err != nil {
			return nil, err
		}
	}
	var err error
	if t.publishDur, err = m.Float64Histogram("custody.rabbitmq.publish.duration",
		metric.WithUnit("s"), metric.WithDescription("Duration of one copy's publish, until the broker's confirm."),
		metric.WithExplicitBucketBoundaries(publishBounds...)); err != nil {
		return nil, err
	}
	return t, nil
}

// ackFrame counts one basic.ack frame acking n deliveries.
func (t *telemetry) ackFrame(n int) {
	ctx := context.Background()
	if n > 1 {
		t.frames.Add(ctx, 1, t.multiple...)
	} else {
		t.frames.Add(ctx, 1, t.single...)
	}
	t.acked.Add(ctx, int64(n), t.dest...)
}

// published counts one copy of kind, published in d, confirmed unless
// failed.
func (t *telemetry) published(kind string, d time.Duration, failed bool) {
	ctx := context.Background()
	attrs := t.pubOK[kind]
	if failed {
		attrs = t.pubErr[kind]
	}
	t.publishes.Add(ctx, 1, attrs)
	t.publishDur.Record(ctx, d.Seconds(), attrs)
}

func (t *telemetry) add(c metric.Int64Counter, n int) {
	if n > 0 {
		c.Add(context.Background(), int64(n), t.dest...)
	}
}

func (t *telemetry) rejected(requeue bool) {
	if requeue {
		t.rejects.Add(context.Background(), 1, t.requeue...)
	} else {
		t.rejects.Add(context.Background(), 1, t.reject...)
	}
}
