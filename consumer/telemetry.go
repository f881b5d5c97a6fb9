package consumer

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/custody-go/custody/adapters"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

const instrumentationName = "github.com/custody-go/custody/consumer"

// Outcomes recorded on custody.messages.settled.
const (
	outcomeAcked        = "acked"
	outcomeRetried      = "retried"
	outcomeDeadLettered = "dead_lettered"
	outcomeReleased     = "released"
	outcomeLost         = "lost"
	outcomeExhausted    = "exhausted"
	outcomeFailed       = "failed" // at-most-once: handler failed, message gone
	outcomeLeft         = "left"   // left to the broker's lease: at shutdown, or a failed early ack (at-most-once)
)

// durationBounds are the bucket boundaries, in seconds, of
// custody.handler.duration: OpenTelemetry's advice for messaging durations
// (5 ms to 10 s), widened to a millisecond below and to five minutes above,
// since handlers may run as long as their leases are renewed. Without them
// the SDK's default boundaries, meant for milliseconds (0, 5, 10, 25, ...),
// would put every handler shorter than five seconds into one bucket.
var durationBounds = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 60, 120, 300}

// telemetry holds the instruments, created once in New, and pre-built
// attribute options so the hot path allocates nothing for them.
type telemetry struct {
	tracer trace.Tracer
	// spans says whether processing spans can reach anything; see
	// newSpanSwitch.
	spans func() bool
	// timed says whether handler durations can reach anything; see
	// newMetricSwitch.
	timed func() bool

	received        metric.Int64Counter
	redelivered     metric.Int64Counter
	settled         metric.Int64Counter
	duration        metric.Float64Histogram
	panics          metric.Int64Counter
	extensions      metric.Int64Counter
	leasesLost      metric.Int64Counter
	renewFails      metric.Int64Counter
	ackFailures     metric.Int64Counter
	dlqFailures     metric.Int64Counter
	unavailable     metric.Int64Counter
	killSwitchTrips metric.Int64Counter
	inFlight        metric.Int64UpDownCounter
	batchSize       metric.Int64Histogram

	// Options are kept as ready slices: passing a slice to a variadic
	// parameter allocates nothing, building one per call would.
	source       []metric.AddOption
	sourceRecord []metric.RecordOption
	outcomes     map[string][]metric.AddOption
	results      [resultKinds][]metric.RecordOption
	spanAttrs    []attribute.KeyValue
}

func newTelemetry(c *config, caps adapters.Capabilities) (*telemetry, error) {
	m := c.meterProvider.Meter(instrumentationName)
	t := &telemetry{
		tracer: c.tracerProvider.Tracer(instrumentationName),
		spans:  newSpanSwitch(c.tracerProvider),
		timed:  newMetricSwitch(c.meterProvider),
	}
	var err error
	counter := func(name, desc string) metric.Int64Counter {
		if err != nil {
			return nil
		}
		var ctr metric.Int64Counter
		ctr, err = m.Int64Counter(name, metric.WithDescription(desc), metric.WithUnit("{message}"))
		return ctr
	}
	t.received = counter("custody.messages.received", "Deliveries received from the broker.")
	t.redelivered = counter("custody.messages.redelivered", "Deliveries whose attempt number is above 1: retries, crashes, lost leases.")
	t.settled = counter("custody.messages.settled", "Deliveries by final outcome: acked, retried, dead_lettered, released, left, lost, exhausted, failed.")
	t.panics = counter("custody.handler.panics", "Handler panics recovered.")
	t.extensions = counter("custody.lease.extensions", "Lease renewals that succeeded.")
	t.leasesLost = counter("custody.lease.lost", "Deliveries whose lease was lost while held (expect a duplicate).")
	t.renewFails = counter("custody.lease.renewal_failures", "Lease renewals that failed (throttling, network errors) and are tried again while the lease lasts.")
	t.ackFailures = counter("custody.ack.failures", "Acks that failed (expect a redelivery).")
	t.dlqFailures = counter("custody.deadletter.failures", "Dead-letter writes that failed (not those cut short by the shutdown deadline or by the loss of the delivery); the original was not acked.")
	t.killSwitchTrips = counter("custody.killswitch.trips", "Times the kill switch (consumer.WithKillSwitch) tripped and stopped intake.")
	t.unavailable = counter("custody.handler.unavailable", "Handler attempts that reported a dependency outage (consumer.Unavailable): no attempt used up, the message waits in place.")
	if err != nil {
		return nil, err
	}
	if t.duration, err = m.Float64Histogram("custody.handler.duration",
		metric.WithDescription("Time one handler attempt took, by result: ok, error, deferred (consumer.Defer), unavailable (consumer.Unavailable) or cancelled (cut short by the shutdown deadline or the loss of the delivery)."), metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(durationBounds...)); err != nil {
		return nil, err
	}
	if t.inFlight, err = m.Int64UpDownCounter("custody.messages.in_flight",
		metric.WithDescription("Deliveries held: running, buffered or awaiting their ack."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	if t.batchSize, err = m.Int64Histogram("custody.batch.size",
		metric.WithDescription("Messages per call of a batch handler."), metric.WithUnit("{message}"),
		metric.WithExplicitBucketBoundaries(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)); err != nil {
		return nil, err
	}
	src := attribute.String("custody.consumer", c.name)
	set := attribute.NewSet(src)
	t.source = []metric.AddOption{metric.WithAttributeSet(set)}
	t.sourceRecord = []metric.RecordOption{metric.WithAttributeSet(set)}
	t.outcomes = map[string][]metric.AddOption{}
	for _, o := range []string{outcomeAcked, outcomeRetried, outcomeDeadLettered, outcomeReleased, outcomeLost, outcomeExhausted, outcomeFailed, outcomeLeft} {
		t.outcomes[o] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(src, attribute.String("custody.outcome", o)))}
	}
	for res, name := range resultNames {
		t.results[res] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(src, attribute.String("custody.result", name)))}
	}
	// The consumer's name under the metrics' key, so that spans and metrics
	// join. It is not messaging.consumer.group.name: the runtime does not
	// know the broker's consumer group (a Kafka group is named apart from
	// the consumer, and its metrics carry the group's real name under that
	// key), and SQS and RabbitMQ have none.
	t.spanAttrs = []attribute.KeyValue{
		src,
		attribute.String("messaging.operation.type", "process"),
		attribute.String("messaging.operation.name", "process"),
	}
	if caps.System != "" {
		t.spanAttrs = append(t.spanAttrs, attribute.String("messaging.system", caps.System))
	}
	return t, nil
}

// spanStartOptions describes d's processing span at its start, where a
// sampler can see it: the consumer, the operation, the broker, and the
// message (its queue or topic, id, attempt, body size; a Kafka record's
// partition and offset).
func (t *telemetry) spanStartOptions(d *adapters.Delivery, attempt int) []trace.SpanStartOption {
	attrs := make([]attribute.KeyValue, len(t.spanAttrs), len(t.spanAttrs)+6)
	copy(attrs, t.spanAttrs)
	attrs = append(attrs,
		attribute.String("messaging.destination.name", d.Queue),
		attribute.String("messaging.message.id", d.ID),
		attribute.Int("messaging.message.body.size", len(d.Body)),
		attribute.Int("custody.attempt", attempt),
	)
	if d.Partition >= 0 && d.Offset >= 0 {
		attrs = append(attrs,
			attribute.String("messaging.destination.partition.id", strconv.Itoa(int(d.Partition))),
			attribute.Int64("messaging.kafka.offset", d.Offset),
		)
	}
	return []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...)}
}

// newSpanSwitch returns a check, cheap enough for every message, of whether a
// span started through tp could be recorded. Starting a span that goes
// nowhere still costs allocations on every message: a consumer on the
// OpenTelemetry global provider before any SDK is installed, or on the no-op
// provider, skips it. The check follows the global provider, so installing an
// SDK after New turns spans on. The trace context extracted from the
// message's headers reaches the handler either way.
func newSpanSwitch(tp trace.TracerProvider) func() bool {
	switch tp.(type) {
	case noop.TracerProvider, *noop.TracerProvider:
		return func() bool { return false }
	}
	if !isGlobalDefault(tp, "tracerProvider") {
		return func() bool { return true }
	}
	return func() bool {
		// Different dynamic types compare unequal without a panic, even
		// when the installed provider's type is not comparable.
		return otel.GetTracerProvider() != tp
	}
}

// newMetricSwitch is newSpanSwitch for the handler duration histogram: a
// consumer whose metrics go nowhere does not read the clock twice per
// attempt to time its handler. Counters are added to either way; they cost
// next to nothing when they go nowhere.
func newMetricSwitch(mp metric.MeterProvider) func() bool {
	switch mp.(type) {
	case metricnoop.MeterProvider, *metricnoop.MeterProvider:
		return func() bool { return false }
	}
	if !isGlobalDefault(mp, "meterProvider") {
		return func() bool { return true }
	}
	return func() bool { return otel.GetMeterProvider() != mp }
}

// isGlobalDefault reports whether p is OpenTelemetry's delegating global
// provider of the given type name, which records nothing until an SDK is
// installed. Its type is internal to OpenTelemetry, so it is recognised by
// name; a mismatch after an upgrade only means spans are always started and
// handlers always timed, as before.
func isGlobalDefault(p any, typeName string) bool {
	t := reflect.TypeOf(p)
	return t != nil && t.Kind() == reflect.Pointer &&
		t.Elem().Name() == typeName &&
		t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global"
}

// result is the custody.result of a handler attempt.
type result uint8

const (
	resultOK result = iota
	resultError
	resultDeferred // consumer.Defer
	// resultCancelled is an attempt cut short by the shutdown deadline or
	// the loss of its delivery.
	resultCancelled
	resultUnavailable // consumer.Unavailable
	resultKinds
)

// resultNames are the results' custody.result values, and the names of the
// span events that record them (but for ok and error).
var resultNames = [resultKinds]string{"ok", "error", "deferred", "cancelled", "unavailable"}

// attemptResult classifies an attempt that ended with err; cut says the
// shutdown deadline or the loss of its delivery cut it short. Only a
// failure of the handler's own is an error: deploys and rebalances must not
// show as error rates.
func attemptResult(err error, cut bool) result {
	switch {
	case err == nil:
		return resultOK
	case IsUnavailable(err) && !cut:
		return resultUnavailable
	case IsDeferred(err):
		return resultDeferred
	case cut:
		return resultCancelled
	}
	return resultError
}

// clock returns the start of a handler call to time, or the zero time where
// its duration cannot be recorded: two clock reads per attempt are a good
// part of the cost of a quick handler.
func (t *telemetry) clock() time.Time {
	if t.timed() {
		return time.Now()
	}
	return time.Time{}
}

func (t *telemetry) settle(ctx context.Context, outcome string, n int) {
	t.settled.Add(ctx, int64(n), t.outcomes[outcome]...)
	t.inFlight.Add(ctx, -int64(n), t.source...)
}

// headerCarrier reads trace context from message headers.
type headerCarrier map[string]string

func (h headerCarrier) Get(k string) string {
	if v, ok := h[k]; ok {
		return v
	}
	// Brokers and publishers differ on case; traceparent is lower case in the
	// W3C spec, but some clients capitalise header names.
	for hk, v := range h {
		if strings.EqualFold(hk, k) {
			return v
		}
	}
	return ""
}
func (h headerCarrier) Set(k, v string) { h[k] = v }
func (h headerCarrier) Keys() []string {
	ks := make([]string, 0, len(h))
	for k := range h {
		ks = append(ks, k)
	}
	return ks
}

// batchSpanOptions describes a batch's processing span at its start: the
// consumer, the operation, the broker, the batch's size, and a link to each
// message's trace context (OpenTelemetry's messaging conventions for a
// batch: the span is a trace of its own, linked to the messages').
func (t *telemetry) batchSpanOptions(p propagation.TextMapPropagator, js []*job) []trace.SpanStartOption {
	attrs := make([]attribute.KeyValue, len(t.spanAttrs), len(t.spanAttrs)+2)
	copy(attrs, t.spanAttrs)
	attrs = append(attrs, attribute.Int("messaging.batch.message_count", len(js)))
	if len(js) > 0 {
		attrs = append(attrs, attribute.String("messaging.destination.name", js[0].d.Queue))
	}
	links := make([]trace.Link, 0, len(js))
	for _, j := range js {
		if len(j.d.Headers) == 0 {
			continue
		}
		sc := trace.SpanContextFromContext(p.Extract(context.Background(), headerCarrier(j.d.Headers)))
		if sc.IsValid() {
			links = append(links, trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("messaging.message.id", j.d.ID)}})
		}
	}
	return []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer), trace.WithAttributes(attrs...), trace.WithLinks(links...), trace.WithNewRoot()}
}

// announce adds zero to every counter of the consumer, so that an exporter
// shows them (a Prometheus page lists a counter only once it has a value)
// before the first message.
func (t *telemetry) announce(ctx context.Context) {
	for _, c := range []metric.Int64Counter{t.received, t.redelivered, t.panics, t.extensions,
		t.leasesLost, t.renewFails, t.ackFailures, t.dlqFailures, t.unavailable, t.killSwitchTrips} {
		c.Add(ctx, 0, t.source...)
	}
	for _, o := range t.outcomes {
		t.settled.Add(ctx, 0, o...)
	}
	t.inFlight.Add(ctx, 0, t.source...)
}

// observeBacklog registers the backlog gauges, read from the last poll
// that reading returns (nil: none yet).
func observeBacklog(c *config, reading func() *backlogReading) error {
	m := c.meterProvider.Meter(instrumentationName)
	waiting, err := m.Int64ObservableGauge("custody.backlog.waiting",
		metric.WithDescription("Messages waiting to be received, as the broker counts them (SQS visible messages, a RabbitMQ queue's ready messages, a Kafka group's lag)."),
		metric.WithUnit("{message}"))
	if err != nil {
		return err
	}
	inFlight, err := m.Int64ObservableGauge("custody.backlog.in_flight",
		metric.WithDescription("Messages received by any consumer and not yet settled, as the broker counts them."),
		metric.WithUnit("{message}"))
	if err != nil {
		return err
	}
	oldest, err := m.Float64ObservableGauge("custody.backlog.oldest_age",
		metric.WithDescription("Age of the oldest waiting message, where the broker tells it."), metric.WithUnit("s"))
	if err != nil {
		return err
	}
	attrs := metric.WithAttributeSet(attribute.NewSet(attribute.String("custody.consumer", c.name)))
	_, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		b := reading()
		if b == nil {
			return nil
		}
		if b.backlog.Waiting >= 0 {
			o.ObserveInt64(waiting, b.backlog.Waiting, attrs)
		}
		if b.backlog.InFlight >= 0 {
			o.ObserveInt64(inFlight, b.backlog.InFlight, attrs)
		}
		if b.backlog.OldestAge > 0 {
			o.ObserveFloat64(oldest, b.backlog.OldestAge.Seconds(), attrs)
		}
		return nil
	}, waiting, inFlight, oldest)
	return err
}
