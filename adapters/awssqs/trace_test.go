package awssqs

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/custody-go/custody/consumer"
)

// TestTraceContextFromAttributes: a producer's W3C trace context, sent as
// the traceparent message attribute, is the parent of the processing span.
func TestTraceContextFromAttributes(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 10*time.Second, nil)
	const traceID, parentSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	e.send(url, "traced", "", map[string]string{"traceparent": "00-" + traceID + "-" + parentSpan + "-01"})
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	var handled atomic.Bool
	runUntil(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		handled.Store(true)
		return nil
	}), "the message handled", handled.Load,
		consumer.WithTracerProvider(tp), consumer.WithPropagator(propagation.TraceContext{}))
	spans := rec.Ended()
	if len(spans) == 0 {
		t.Fatal("no span recorded")
	}
	for _, s := range spans {
		if s.SpanContext().TraceID().String() == traceID && s.Parent().SpanID().String() == parentSpan {
			return
		}
	}
	t.Errorf("no span continues trace %s from span %s; got %d spans, first in trace %s", traceID, parentSpan, len(spans), spans[0].SpanContext().TraceID())
}
