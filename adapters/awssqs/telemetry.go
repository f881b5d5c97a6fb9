package awssqs

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

const meterName = "github.com/custody-go/custody/adapters/awssqs"

// telemetry holds a Source's instruments (see the package documentation,
// section Telemetry).
type telemetry struct {
	requests, entriesFailed, received, released metric.Int64Counter

	queue    metric.MeasurementOption
	requestA [numOps][numResults]metric.MeasurementOption
	failedA  [numOps][numReasons]metric.MeasurementOption
}

// operation is an SQS API a Source calls.
type operation int

const (
	opReceive operation = iota
	opDelete
	opVisibility
	opAttributes
	numOps
)

var opNames = [numOps]string{"ReceiveMessage", "DeleteMessageBatch", "ChangeMessageVisibilityBatch", "GetQueueAttributes"}

// result is how a request ended.
type result int

const (
	resultOK result = iota
	resultEmpty
	resultError
	numResults
)

var resultNames = [numResults]string{"ok", "empty", "error"}

// reason is why SQS failed a batch entry.
type reason int

const (
	reasonLeaseLost reason = iota
	reasonSQS
	reasonRefused
	numReasons
)

var reasonNames = [numReasons]string{"lease_lost", "sqs", "refused"}

func newTelemetry(mp metric.MeterProvider, queue string) (*telemetry, error) {
	m := mp.Meter(meterName)
	t := &telemetry{}
	for _, c := range []struct {
		counter                 *metric.Int64Counter
		name, unit, description string
	}{
		{&t.requests, "custody.sqs.requests", "{request}", "SQS requests, by operation and result."},
		{&t.entriesFailed, "custody.sqs.entries.failed", "{entry}", "Batch entries SQS failed, by operation and reason."},
		{&t.received, "custody.sqs.received", "{message}", "Messages received."},
		{&t.released, "custody.sqs.released", "{message}", "Messages received but not handed out, made visible again."},
	} {
		var err error
		if *c.counter, err = m.Int64Counter(c.name, metric.WithUnit(c.unit), metric.WithDescription(c.description)); err != nil {
			return nil, err
		}
	}
	q := attribute.String("messaging.destination.name", queue)
	t.queue = metric.WithAttributes(q)
	for op := range numOps {
		o := attribute.String("operation", opNames[op])
		for r := range numResults {
			t.requestA[op][r] = metric.WithAttributes(q, o, attribute.String("result", resultNames[r]))
		}
		for r := range numReasons {
			t.failedA[op][r] = metric.WithAttributes(q, o, attribute.String("reason", reasonNames[r]))
		}
	}
	return t, nil
}

func (t *telemetry) request(op operation, r result) {
	t.requests.Add(context.Background(), 1, t.requestA[op][r])
}

func (t *telemetry) entryFailed(op operation, r reason) {
	t.entriesFailed.Add(context.Background(), 1, t.failedA[op][r])
}

func (t *telemetry) receivedN(n int) {
	if n > 0 {
		t.received.Add(context.Background(), int64(n), t.queue)
	}
}

func (t *telemetry) releasedN(n int) {
	if n > 0 {
		t.released.Add(context.Background(), int64(n), t.queue)
	}
}
