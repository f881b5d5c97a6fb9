package jetstream

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

const meterName = "github.com/custody-go/custody/adapters/jetstream"

// The requests a Source makes, as counted in Stats and metrics.
const (
	opFetch = iota
	opAck
	opNak
	opProgress
	opTerm
	opBacklog // the consumer info and message reads of Backlog
	opCount
)

var opNames = [opCount]string{"fetch", "ack", "nak", "progress", "term", "backlog"}

// telemetry holds the Source's instruments, whose descriptions say what
// each counts. Both carry messaging.destination.name (the stream) and
// messaging.consumer.group.name (the durable consumer); requests also
// custody.jetstream.request (opNames) and error (failed, or not answered in
// time).
type telemetry struct {
	counter metric.Int64Counter
	reg     metric.Registration
	base    metric.MeasurementOption
	attrs   [opCount][2]metric.AddOption
}

func newTelemetry(mp metric.MeterProvider, s *Source) (*telemetry, error) {
	m := mp.Meter(meterName)
	stream := attribute.String("messaging.destination.name", s.stream)
	group := attribute.String("messaging.consumer.group.name", s.consumer)
	t := &telemetry{base: metric.WithAttributes(stream, group)}
	for op := range opCount {
		for i, failed := range []bool{false, true} {
			t.attrs[op][i] = metric.WithAttributes(stream, group,
				attribute.String("custody.jetstream.request", opNames[op]), attribute.Bool("error", failed))
		}
	}
	var err error
	if t.counter, err = m.Int64Counter("custody.jetstream.requests", metric.WithUnit("{request}"),
		metric.WithDescription("Requests to the JetStream server: fetches, acks, naks, renewals (InProgress), terms, backlog reads.")); err != nil {
		return nil, err
	}
	pending, err := m.Int64ObservableGauge("custody.jetstream.pending", metric.WithUnit("{message}"),
		metric.WithDescription("Messages the consumer has not delivered yet (its backlog), as of the latest fetch."))
	if err != nil {
		return nil, err
	}
	t.reg, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		o.ObserveInt64(pending, s.stats.pending.Load(), t.base)
		return nil
	}, pending)
	if err != nil {
		return nil, err
	}
	return t, nil
}

func (t *telemetry) request(op int, failed bool) {
	i := 0
	if failed {
		i = 1
	}
	t.counter.Add(context.Background(), 1, t.attrs[op][i])
}

func (t *telemetry) requests(op, ok, failed int) {
	if ok > 0 {
		t.counter.Add(context.Background(), int64(ok), t.attrs[op][0])
	}
	if failed > 0 {
		t.counter.Add(context.Background(), int64(failed), t.attrs[op][1])
	}
}

func (t *telemetry) close() {
	if t.reg != nil {
		_ = t.reg.Unregister()
	}
}
