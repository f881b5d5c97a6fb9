package consumer

import (
	"context"
	"reflect"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
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

// telemetry holds the instruments, created once in New, and pre-built
// attribute options so the hot path allocates nothing for them.
type telemetry struct {
	tracer trace.Tracer
	// spans says whether processing spans can reach anything; see
	// newSpanSwitch.
	spans func() bool

	received    metric.Int64Counter
	redelivered metric.Int64Counter
	settled     metric.Int64Counter
	duration    metric.Float64Histogram
	panics      metric.Int64Counter
	extensions  metric.Int64Counter
	leasesLost  metric.Int64Counter
	renewFails  metric.Int64Counter
	ackFailures metric.Int64Counter
	dlqFailures metric.Int64Counter
	inFlight    metric.Int64UpDownCounter

	// Options are kept as ready slices: passing a slice to a variadic
	// parameter allocates nothing, building one per call would.
	source    []metric.AddOption
	outcomes  map[string][]metric.AddOption
	resultOK  []metric.RecordOption
	resultErr []metric.RecordOption
	spanStart []trace.SpanStartOption
	spanAttrs []attribute.KeyValue
}

func newTelemetry(c *config) (*telemetry, error) {
	m := c.meterProvider.Meter(instrumentationName)
	t := &telemetry{tracer: c.tracerProvider.Tracer(instrumentationName), spans: newSpanSwitch(c.tracerProvider)}
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
	t.dlqFailures = counter("custody.deadletter.failures", "Dead-letter writes that failed; the original was not acked.")
	if err != nil {
		return nil, err
	}
	if t.duration, err = m.Float64Histogram("custody.handler.duration",
		metric.WithDescription("Time one handler attempt took."), metric.WithUnit("s")); err != nil {
		return nil, err
	}
	if t.inFlight, err = m.Int64UpDownCounter("custody.messages.in_flight",
		metric.WithDescription("Deliveries held: running, buffered or awaiting their ack."), metric.WithUnit("{message}")); err != nil {
		return nil, err
	}
	src := attribute.String("custody.consumer", c.name)
	set := attribute.NewSet(src)
	t.source = []metric.AddOption{metric.WithAttributeSet(set)}
	t.outcomes = map[string][]metric.AddOption{}
	for _, o := range []string{outcomeAcked, outcomeRetried, outcomeDeadLettered, outcomeReleased, outcomeLost, outcomeExhausted, outcomeFailed, outcomeLeft} {
		t.outcomes[o] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(src, attribute.String("custody.outcome", o)))}
	}
	t.resultOK = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(src, attribute.String("custody.result", "ok")))}
	t.resultErr = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(src, attribute.String("custody.result", "error")))}
	t.spanStart = []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)}
	t.spanAttrs = []attribute.KeyValue{attribute.String("messaging.consumer.group.name", c.name)}
	return t, nil
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
	if !isGlobalDefault(tp) {
		return func() bool { return true }
	}
	return func() bool {
		// Different dynamic types compare unequal without a panic, even
		// when the installed provider's type is not comparable.
		return otel.GetTracerProvider() != tp
	}
}

// isGlobalDefault reports whether tp is OpenTelemetry's delegating global
// provider, which records nothing until an SDK is installed. Its type is
// internal to OpenTelemetry, so it is recognised by name; a mismatch after an
// upgrade only means spans are always started, as before.
func isGlobalDefault(tp trace.TracerProvider) bool {
	t := reflect.TypeOf(tp)
	return t != nil && t.Kind() == reflect.Pointer &&
		t.Elem().Name() == "tracerProvider" &&
		t.Elem().PkgPath() == "go.opentelemetry.io/otel/internal/global"
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
		if len(hk) == len(k) && equalFold(hk, k) {
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

func equalFold(a, b string) bool {
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}
