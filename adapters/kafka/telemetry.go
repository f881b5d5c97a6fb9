package kafka

import (
	"context"
	"errors"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

const meterName = "github.com/custody-go/custody/adapters/kafka"

// commitBounds are the bucket boundaries, in seconds, of
// custody.kafka.commit.duration. The SDK's default boundaries are meant for
// milliseconds (0, 5, 10, 25, ...): in seconds they would put every commit
// shorter than five seconds into one bucket.
var commitBounds = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30}

// telemetry holds the adapter's instruments (see the package documentation,
// section Telemetry). All carry messaging.consumer.group.name; those per
// partition also messaging.destination.name and
// messaging.destination.partition.id, and commit.duration the attribute
// error. A partition's lag is reported, while this member owns it, once
// both its committed offset and its end offset are known (see lagLoop).
type telemetry struct {
	group    attribute.KeyValue
	commit   metric.Float64Histogram
	failures metric.Int64Counter
	skipped  metric.Int64Counter
	rewinds  metric.Int64Counter
	expired  metric.Int64Counter
	reg      metric.Registration
	okAttrs  metric.MeasurementOption
	badAttrs metric.MeasurementOption
	groupOpt metric.MeasurementOption
	attrs    map[*partition]metric.MeasurementOption
}

func newTelemetry(mp metric.MeterProvider, group string, s *Source) (*telemetry, error) {
	m := mp.Meter(meterName)
	t := &telemetry{group: attribute.String("messaging.consumer.group.name", group), attrs: make(map[*partition]metric.MeasurementOption)}
	t.groupOpt = metric.WithAttributes(t.group)
	t.okAttrs = metric.WithAttributes(t.group, attribute.Bool("error", false))
	t.badAttrs = metric.WithAttributes(t.group, attribute.Bool("error", true))
	var err error
	counter := func(name, unit, desc string) metric.Int64Counter {
		c, cerr := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		err = errors.Join(err, cerr)
		return c
	}
	t.failures = counter("custody.kafka.commit.failures", "{request}",
		"Offset commit requests that failed in whole or in part.")
	t.skipped = counter("custody.kafka.skipped", "{message}",
		"Records skipped after a rebalance because the commit metadata recorded them done.")
	t.rewinds = counter("custody.kafka.rewinds", "{rewind}",
		"Partitions the client rewound below records already polled, after the broker lost data.")
	t.expired = counter("custody.kafka.expired", "{message}",
		"Offsets deleted (by retention, or DeleteRecords) before the group read them: the committed offset was below the log start. Offsets, not records: on a compacted topic some of them held no record.")
	if err != nil {
		return nil, err
	}
	if t.commit, err = m.Float64Histogram("custody.kafka.commit.duration",
		metric.WithUnit("s"), metric.WithDescription("Duration of one offset commit request."),
		metric.WithExplicitBucketBoundaries(commitBounds...)); err != nil {
		return nil, err
	}
	lag, err := m.Int64ObservableGauge("custody.kafka.lag", metric.WithUnit("{message}"),
		metric.WithDescription("High watermark minus committed offset, per assigned partition."))
	if err != nil {
		return nil, err
	}
	t.reg, err = m.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, p := range s.order {
			if p.hwm < 0 || p.committed < 0 {
				continue
			}
			o.ObserveInt64(lag, max(p.hwm-p.committed, 0), t.partAttrs(p))
		}
		return nil
	}, lag)
	if err != nil {
		return nil, err
	}
	return t, nil
}

// partAttrs returns the attributes of p's measurements. Called under Source.mu.
func (t *telemetry) partAttrs(p *partition) metric.MeasurementOption {
	if a, ok := t.attrs[p]; ok {
		return a
	}
	a := metric.WithAttributes(t.group,
		attribute.String("messaging.destination.name", p.topic),
		attribute.String("messaging.destination.partition.id", strconv.Itoa(int(p.id))))
	t.attrs[p] = a
	return a
}

// forget drops p's attributes when its assignment ends. Called under Source.mu.
func (t *telemetry) forget(p *partition) { delete(t.attrs, p) }

func (t *telemetry) commitDone(d time.Duration, failed bool) {
	ctx := context.Background()
	if failed {
		t.commit.Record(ctx, d.Seconds(), t.badAttrs)
		t.failures.Add(ctx, 1, t.groupOpt)
		return
	}
	t.commit.Record(ctx, d.Seconds(), t.okAttrs)
}

func (t *telemetry) close() {
	if t.reg != nil {
		_ = t.reg.Unregister()
	}
}
