package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// collected is one collection of the consumer's metrics.
type collected struct {
	t       *testing.T
	metrics map[string]metricdata.Metrics
	// points maps "name" and "name/<outcome or result>" to the summed
	// value (a histogram's count).
	points map[string]int64
}

func collectAll(t *testing.T, reader *sdkmetric.ManualReader) collected {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	c := collected{t: t, metrics: map[string]metricdata.Metrics{}, points: map[string]int64{}}
	add := func(name string, attrs attribute.Set, v int64) {
		c.points[name] += v
		for _, k := range []attribute.Key{"custody.outcome", "custody.result"} {
			if o, ok := attrs.Value(k); ok {
				c.points[name+"/"+o.AsString()] += v
			}
		}
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			c.metrics[m.Name] = m
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range data.DataPoints {
					add(m.Name, dp.Attributes, dp.Value)
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					add(m.Name, dp.Attributes, int64(dp.Count))
				}
			case metricdata.Gauge[int64]:
				for _, dp := range data.DataPoints {
					add(m.Name, dp.Attributes, dp.Value)
				}
			}
		}
	}
	return c
}

// stopAndCollect stops r, fails the test if Run did not return nil, and
// collects the metrics, checking that they balance for the consumer name.
func stopAndCollect(t *testing.T, r *running, reader *sdkmetric.ManualReader, name string) collected {
	t.Helper()
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced(name)
	return c
}

// settledTotal sums custody.messages.settled over every outcome.
func (c collected) settledTotal() int64 { return c.points["custody.messages.settled"] }

// balanced checks what must hold once Run has returned: every received
// delivery was settled exactly once, none is left in flight, and every data
// point carries the consumer's name, so that the instruments can be joined.
func (c collected) balanced(name string) {
	c.t.Helper()
	if got, want := c.settledTotal(), c.points["custody.messages.received"]; got != want {
		c.t.Errorf("custody.messages.settled sums to %d over its outcomes, received %d: every delivery must settle exactly once (%s)", got, want, c)
	}
	if n := c.points["custody.messages.in_flight"]; n != 0 {
		c.t.Errorf("custody.messages.in_flight = %d after Run returned, want 0", n)
	}
	for _, m := range c.metrics {
		forEachAttrs(m, func(s attribute.Set) {
			if v, ok := s.Value("custody.consumer"); !ok || v.AsString() != name {
				c.t.Errorf("%s data point %v lacks custody.consumer=%q", m.Name, s.ToSlice(), name)
			}
		})
	}
}

func (c collected) want(want map[string]int64) {
	c.t.Helper()
	for k, v := range want {
		if c.points[k] != v {
			c.t.Errorf("%s = %d, want %d", k, c.points[k], v)
		}
	}
	if c.t.Failed() {
		c.t.Logf("collected: %s", c)
	}
}

func (c collected) String() string {
	keys := make([]string, 0, len(c.points))
	for k := range c.points {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "\n  %s = %d", k, c.points[k])
	}
	return b.String()
}

func forEachAttrs(m metricdata.Metrics, f func(attribute.Set)) {
	switch data := m.Data.(type) {
	case metricdata.Sum[int64]:
		for _, dp := range data.DataPoints {
			f(dp.Attributes)
		}
	case metricdata.Histogram[float64]:
		for _, dp := range data.DataPoints {
			f(dp.Attributes)
		}
	case metricdata.Gauge[int64]:
		for _, dp := range data.DataPoints {
			f(dp.Attributes)
		}
	}
}

// inPlaceSource hides the memory broker's delayed redelivery, so that the
// runtime retries in place, as it does on Kafka.
type inPlaceSource struct{ *memory.Source }

func (s inPlaceSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.NackDelay = false
	return c
}

// pathsHandler exercises the less common outcomes, once each: every message
// but "ok" and "perm" fails its first call a different way. (A deferral
// waiting in place leaves Attempt as it was, so calls are counted here.)
type pathsHandler struct{ calls *counter }

func newPathsHandler() pathsHandler { return pathsHandler{newCounter()} }

func (p pathsHandler) handle(ctx context.Context, m *consumer.Message) error {
	first := p.calls.inc(m.Body) == 1
	switch string(m.Body) {
	case "fail":
		if first {
			return errors.New("transient")
		}
	case "panic":
		if first {
			panic("boom")
		}
	case "defer":
		if first {
			return consumer.Defer(errors.New("not yet"), time.Millisecond)
		}
	case "retryafter":
		if first {
			return consumer.RetryAfter(errors.New("later"), time.Millisecond)
		}
	case "timeout":
		if first {
			<-ctx.Done() // the handler timeout
			return ctx.Err()
		}
	case "perm":
		return consumer.Permanent(errors.New("unparseable"))
	}
	return nil
}

var pathBodies = []string{"ok", "fail", "panic", "defer", "retryafter", "timeout", "perm", "ackfail"}

// runPaths publishes pathBodies and runs them until every one is acked or
// dead-lettered; the dead-letter write of "perm" fails twice first, and the
// ack of "ackfail" fails once.
func runPaths(t *testing.T, inPlace bool) collected {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 2 * time.Second})
	e.publish(pathBodies...)
	var ackFailed atomic.Bool
	mem := e.source(memory.WithFaults(memory.Faults{Ack: func(d *adapters.Delivery) error {
		if string(d.Body) == "ackfail" && ackFailed.CompareAndSwap(false, true) {
			return errors.New("ack lost on the wire")
		}
		return nil
	}}))
	dlq := e.dlq()
	var dlqFails atomic.Int32
	dlq.SetFault(func(*adapters.Delivery) error {
		if dlqFails.Add(1) <= 2 {
			return errors.New("dead-letter topic unavailable")
		}
		return nil
	})
	var src adapters.Source = mem
	if inPlace {
		src = inPlaceSource{mem}
	}
	r := runOn(t, src, newPathsHandler().handle, consumer.WithName("paths"), consumer.WithConcurrency(4),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(time.Millisecond)}),
		consumer.WithDeadLetter(dlq), consumer.WithHandlerTimeout(50*time.Millisecond),
		consumer.WithMeterProvider(mp))
	waitFor(t, "every message acked or dead-lettered", func() bool {
		s := e.stats("q")
		return s.Acked == int64(len(pathBodies)) && e.stats("dlq").Visible == 1
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("paths")
	return c
}

// TestTelemetryOnRedeliveringBroker: each retry, deferral, panic and
// handler timeout gives the delivery back (settled "retried"), the next
// delivery counts as redelivered, and every delivery settles exactly once.
// A failed dead-letter write is tried again in place, without running the
// handler again.
func TestTelemetryOnRedeliveringBroker(t *testing.T) {
	c := runPaths(t, false)
	c.want(map[string]int64{
		// ok 1, fail 2, panic 2, defer 2, retryafter 2, timeout 2,
		// perm 1 (its two failed dead-letter writes wait in place),
		// ackfail 2.
		"custody.messages.received":              14,
		"custody.messages.redelivered":           6,
		"custody.messages.settled/acked":         7,
		"custody.messages.settled/retried":       5,
		"custody.messages.settled/dead_lettered": 1,
		"custody.messages.settled/lost":          1,
		"custody.handler.duration":               14,
		"custody.handler.duration/error":         5,
		"custody.handler.duration/deferred":      1,
		"custody.handler.duration/ok":            8,
		"custody.handler.panics":                 1,
		"custody.deadletter.failures":            2,
		"custody.ack.failures":                   1,
		"custody.lease.lost":                     0,
	})
}

// TestTelemetryRetryingInPlace: where the broker cannot delay a redelivery
// (Kafka), retries wait in place: nothing is settled "retried", the
// dead-letter write is retried without running the handler again, and the
// deliveries still balance.
func TestTelemetryRetryingInPlace(t *testing.T) {
	c := runPaths(t, true)
	c.want(map[string]int64{
		"custody.messages.received":              9, // ackfail twice
		"custody.messages.redelivered":           1,
		"custody.messages.settled/acked":         7,
		"custody.messages.settled/retried":       0,
		"custody.messages.settled/dead_lettered": 1,
		"custody.messages.settled/lost":          1,
		// ok 1, fail 2, panic 2, defer 2, retryafter 2, timeout 2, perm 1,
		// ackfail 2.
		"custody.handler.duration":          14,
		"custody.handler.duration/error":    5,
		"custody.handler.duration/deferred": 1,
		"custody.handler.panics":            1,
		"custody.deadletter.failures":       2,
		"custody.ack.failures":              1,
	})
}

// TestTelemetryAtMostOnce: acked on receipt, a delivery is settled "acked"
// or "failed" by its handler, never retried; one whose early ack failed is
// "left" and handled on its redelivery.
func TestTelemetryAtMostOnce(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 100 * time.Millisecond})
	e.publish("ok", "fail", "panic", "ackfail")
	var ackFailed atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{Ack: func(d *adapters.Delivery) error {
		if string(d.Body) == "ackfail" && ackFailed.CompareAndSwap(false, true) {
			return errors.New("ack lost on the wire")
		}
		return nil
	}}))
	var handled atomic.Int32
	h := newPathsHandler()
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		defer handled.Add(1)
		return h.handle(ctx, m)
	}, consumer.WithName("amo"), consumer.WithAtMostOnceAckBeforeProcessingUnsafe(), consumer.WithMeterProvider(mp))
	waitFor(t, "four handled", func() bool { return handled.Load() == 4 && e.stats("q").Acked == 4 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("amo")
	c.want(map[string]int64{
		"custody.messages.received":       5,
		"custody.messages.redelivered":    1,
		"custody.messages.settled/acked":  2,
		"custody.messages.settled/failed": 2,
		"custody.messages.settled/left":   1,
		"custody.ack.failures":            1,
		"custody.handler.panics":          1,
		"custody.handler.duration":        4,
	})
}

// TestTelemetryAtShutdownTimeout: at the shutdown timeout the running
// handler is cut short and given back, the deliveries waiting for a worker
// are given back at once, and a handler that ignores its context and
// succeeds is acked; all of it balances.
func TestTelemetryAtShutdownTimeout(t *testing.T) {
	for _, leave := range []bool{false, true} {
		t.Run(fmt.Sprintf("leave=%v", leave), func(t *testing.T) {
			reader, mp := newMeter()
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("stuck", "stubborn", "w1", "w2", "w3", "w4")
			var running sync.WaitGroup
			running.Add(2)
			opts := []consumer.Option{consumer.WithName("shut"), consumer.WithConcurrency(2), consumer.WithMaxInFlight(6),
				consumer.WithShutdownTimeout(50 * time.Millisecond), consumer.WithMeterProvider(mp)}
			if leave {
				opts = append(opts, consumer.WithLeaveUnfinishedOnShutdown())
			}
			src := e.source()
			c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				switch string(m.Body) {
				case "stuck":
					running.Done()
					<-ctx.Done()
					return ctx.Err()
				case "stubborn":
					running.Done()
					<-ctx.Done()
					return nil // finished its effect regardless
				}
				t.Errorf("%s ran after shutdown began", m.Body)
				return nil
			}), append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)...)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			waitForSix := func() bool { return e.stats("q").InFlight == 6 }
			go func() { done <- c.Run(ctx) }()
			running.Wait()
			waitFor(t, "all six held", waitForSix)
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			col := collectAll(t, reader)
			col.balanced("shut")
			gaveBack := "custody.messages.settled/released"
			if leave {
				gaveBack = "custody.messages.settled/left"
			}
			col.want(map[string]int64{
				"custody.messages.received":      6,
				"custody.messages.settled/acked": 1,
				gaveBack:                         5,
				"custody.handler.duration":       2,
				// The attempt cut short is no failure: no error rate
				// on every deploy with a long handler.
				"custody.handler.duration/cancelled": 1,
				"custody.handler.duration/ok":        1,
				"custody.handler.duration/error":     0,
			})
		})
	}
}

// partialReceiveSource returns its first deliveries together with an error,
// as a source does when one partition fails among others.
type partialReceiveSource struct {
	*memory.Source
	once atomic.Bool
}

func (s *partialReceiveSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, n)
	if err == nil && len(ds) > 0 && s.once.CompareAndSwap(false, true) {
		return ds, errors.New("partition 3 failed")
	}
	return ds, err
}

func TestTelemetryReceiveWithAnError(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("a", "b", "c")
	r := runOn(t, &partialReceiveSource{Source: e.source()}, func(context.Context, *consumer.Message) error { return nil },
		consumer.WithName("partial"), consumer.WithMeterProvider(mp))
	waitFor(t, "three acked", func() bool { return e.stats("q").Acked == 3 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("partial")
	c.want(map[string]int64{"custody.messages.received": 3, "custody.messages.settled/acked": 3})
}

// TestTelemetryLeaseLostMidHandler: a lease refused mid-handler cancels the
// handler; the delivery is settled lost once and its lease counted lost
// once, and the redelivery is counted as such.
func TestTelemetryLeaseLostMidHandler(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("x")
	var refused atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		if refused.CompareAndSwap(false, true) {
			return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}, consumer.WithName("lease"), consumer.WithMeterProvider(mp))
	waitFor(t, "acked on the redelivery", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("lease")
	c.want(map[string]int64{
		"custody.messages.received":      2,
		"custody.messages.redelivered":   1,
		"custody.messages.settled/lost":  1,
		"custody.messages.settled/acked": 1,
		"custody.lease.lost":             1,
		"custody.ack.failures":           0,
	})
}

// TestSpanAttributesStatusAndParent: one consumer span per attempt, a child
// of the span context in the message's traceparent; Error status only for
// a failed attempt; the messaging attributes and the consumer's name as the
// metrics carry it.
func TestSpanAttributesStatusAndParent(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const traceID, parentID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	if err := e.b.Publish(context.Background(), "q", memory.Message{ID: "m1", Body: []byte("fail"),
		Headers: map[string]string{"Traceparent": "00-" + traceID + "-" + parentID + "-01"}}); err != nil {
		t.Fatal(err)
	}
	// Run's own context carries a span: it must not become the parent of
	// messages without trace context.
	outer, outerSpan := tp.Tracer("test").Start(context.Background(), "main")
	outerSpan.End()
	r := runIn(t, outer, e.source(), newPathsHandler().handle,
		consumer.WithName("spans"), consumer.WithTracerProvider(tp), consumer.WithPropagator(propagation.TraceContext{}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(time.Millisecond)}))
	waitFor(t, "acked", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	ended := messageSpans(t, spans, 2) // a failed attempt and a successful one
	for i, s := range ended {
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("span %d: kind %v, want consumer", i, s.SpanKind())
		}
		if s.Parent().TraceID().String() != traceID || s.Parent().SpanID().String() != parentID || !s.Parent().IsRemote() {
			t.Errorf("span %d: parent %v, want the remote span %s/%s of the traceparent header", i, s.Parent(), traceID, parentID)
		}
		attrs := attribute.NewSet(s.Attributes()...)
		for k, v := range map[attribute.Key]string{
			"messaging.destination.name": "q",
			"messaging.message.id":       "m1",
			"custody.consumer":           "spans",
		} {
			if got, ok := attrs.Value(k); !ok || got.String() != v {
				t.Errorf("span %d: %s = %q, want %q (attributes %v)", i, k, got.String(), v, s.Attributes())
			}
		}
		if got, _ := attrs.Value("custody.attempt"); got.AsInt64() != int64(i+1) {
			t.Errorf("span %d: custody.attempt = %d, want %d", i, got.AsInt64(), i+1)
		}
		if group, ok := attrs.Value("messaging.consumer.group.name"); ok && group.AsString() == "spans" {
			t.Errorf("span %d: messaging.consumer.group.name = %q: the consumer's name is no broker consumer group (a Kafka span would name another group than the Kafka metrics)", i, group.AsString())
		}
	}
	if st := ended[0].Status(); st.Code != codes.Error {
		t.Errorf("failed attempt: status %v, want Error", st)
	}
	if st := ended[1].Status(); st.Code == codes.Error {
		t.Errorf("successful attempt: status %v, want not Error", st)
	}
}

// messageSpans returns the ended spans but the test's own "main" span, and
// fails the test unless there are want of them.
func messageSpans(t *testing.T, spans *tracetest.SpanRecorder, want int) []sdktrace.ReadOnlySpan {
	t.Helper()
	var ended []sdktrace.ReadOnlySpan
	for _, s := range spans.Ended() {
		if s.Name() != "main" {
			ended = append(ended, s)
		}
	}
	if len(ended) != want {
		t.Fatalf("%d message spans, want %d", len(ended), want)
	}
	return ended
}

// TestSpanWithoutTraceContextIsARoot: a message without trace context (no
// headers, or headers without a traceparent) starts its own trace. Run's
// context is the process's lifetime, and a span context it carries must not
// parent every message ever handled: a local span (a startup span), or a
// remote one (a batch job continuing the trace it was started in, from a
// TRACEPARENT environment variable, say).
func TestSpanWithoutTraceContextIsARoot(t *testing.T) {
	remote := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{0x0a, 0xf7, 0x65, 0x19},
		SpanID:     trace.SpanID{0xb7, 0xad, 0x6b, 0x71},
		TraceFlags: trace.FlagsSampled,
		Remote:     true,
	})
	for _, tc := range []struct {
		name string
		ctx  func(trace.TracerProvider) (context.Context, trace.SpanContext)
	}{
		{"local span", func(tp trace.TracerProvider) (context.Context, trace.SpanContext) {
			ctx, span := tp.Tracer("test").Start(context.Background(), "main")
			span.End()
			return ctx, span.SpanContext()
		}},
		{"remote span context", func(trace.TracerProvider) (context.Context, trace.SpanContext) {
			return trace.ContextWithRemoteSpanContext(context.Background(), remote), remote
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			spans := tracetest.NewSpanRecorder()
			tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("bare")
			if err := e.b.Publish(context.Background(), "q", memory.Message{Body: []byte("headers"),
				Headers: map[string]string{"content-type": "text/plain"}}); err != nil {
				t.Fatal(err)
			}
			outer, outerSC := tc.ctx(tp)
			r := runIn(t, outer, e.source(), func(context.Context, *consumer.Message) error { return nil },
				consumer.WithTracerProvider(tp), consumer.WithPropagator(propagation.TraceContext{}))
			waitFor(t, "acked", func() bool { return e.stats("q").Acked == 2 })
			if err := r.stop(); err != nil {
				t.Fatal(err)
			}
			ended := messageSpans(t, spans, 2)
			for _, s := range ended {
				if p := s.Parent(); p.IsValid() || s.SpanContext().TraceID() == outerSC.TraceID() {
					t.Errorf("message span's parent is %v in trace %v (Run's context carries %v), want a root span of a new trace",
						p.SpanID(), s.SpanContext().TraceID(), outerSC.SpanID())
				}
			}
		})
	}
}

// TestHandlerDurationBucketsAreSeconds: the histogram is in seconds, so its
// buckets must resolve the milliseconds most handlers take. The SDK's
// default boundaries (0, 5, 10, 25, ... meant for milliseconds) put every
// handler shorter than five seconds into one bucket, and a quantile read
// from it says a 1 ms handler takes seconds.
func TestHandlerDurationBucketsAreSeconds(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("a")
	r := run(t, e.source(), func(context.Context, *consumer.Message) error { return nil }, consumer.WithMeterProvider(mp))
	waitFor(t, "acked", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	m := collectAll(t, reader).metrics["custody.handler.duration"]
	h, ok := m.Data.(metricdata.Histogram[float64])
	if !ok || len(h.DataPoints) != 1 || m.Unit != "s" {
		t.Fatalf("custody.handler.duration = %+v (unit %q), want one histogram data point in seconds", m.Data, m.Unit)
	}
	checkSecondsBuckets(t, h.DataPoints[0].Bounds)
}

// checkSecondsBuckets fails unless bounds resolve durations from a few
// milliseconds to tens of seconds.
func checkSecondsBuckets(t *testing.T, bounds []float64) {
	t.Helper()
	var subSecond int
	for _, b := range bounds {
		if b > 0 && b < 1 {
			subSecond++
		}
	}
	if subSecond < 5 || bounds[0] > 0.005 || bounds[len(bounds)-1] < 10 {
		t.Fatalf("bucket boundaries %v: want several below one second, the first at most 5 ms and the last at least 10 s", bounds)
	}
}

// TestTelemetryOrderedLaneWithALoss: in a FIFO group, a delivery whose lease
// is lost mid-handler is settled lost (its lease counted once), the ones
// queued behind it are given back ("released"), and at shutdown everything
// balances.
func TestTelemetryOrderedLaneWithALoss(t *testing.T) {
	reader, mp := newMeter()
	g := newGroupWithLoss(t, 5, "a2")
	r := runOn(t, g.src, g.handle, consumer.WithName("fifo"), consumer.WithMeterProvider(mp))
	waitFor(t, "all five done", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.done) == 5
	})
	waitFor(t, "all five acked", func() bool { s, _ := g.b.Stats("q"); return s.Acked == 5 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("fifo")
	if c.points["custody.messages.settled/lost"] != 1 || c.points["custody.lease.lost"] != 1 || c.points["custody.messages.settled/acked"] != 5 {
		t.Errorf("want a2 lost once, its lease counted once, and all five acked in the end: %s", c)
	}
	if c.points["custody.messages.settled/released"] != c.points["custody.messages.received"]-6 {
		t.Errorf("released %d of %d received: every delivery beyond a2's loss and the five acks must have been given back: %s",
			c.points["custody.messages.settled/released"], c.points["custody.messages.received"], c)
	}
}

// TestTelemetryAtMostOnceShutdownTimeout: in at-most-once mode a handler cut
// short at the shutdown timeout has no second chance: it is settled
// "failed", and the deliveries that waited for a worker are still handled
// (they were acked on receipt).
func TestTelemetryAtMostOnceShutdownTimeout(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("stuck", "w1", "w2")
	started := make(chan struct{})
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "stuck" {
			close(started)
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}, consumer.WithName("amo"), consumer.WithAtMostOnceAckBeforeProcessingUnsafe(), consumer.WithMeterProvider(mp),
		consumer.WithMaxInFlight(3), consumer.WithShutdownTimeout(20*time.Millisecond))
	<-started
	waitFor(t, "all three received", func() bool { return e.stats("q").Acked == 3 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	c.balanced("amo")
	c.want(map[string]int64{
		"custody.messages.received":       3,
		"custody.messages.settled/failed": 1,
		"custody.messages.settled/acked":  2,
	})
}

// A deferral is not a failure of the handler: its attempt's duration is
// recorded as result "deferred", not "error", and its span carries a
// "deferred" event without the error status, so error rates and error spans
// show failures only.
func TestDeferralIsNoErrorInMetricsOrSpans(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("defer")
	r := run(t, e.source(), newPathsHandler().handle, consumer.WithTracerProvider(tp), consumer.WithMeterProvider(mp))
	waitFor(t, "acked", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	c := collectAll(t, reader)
	if c.points["custody.handler.duration/deferred"] != 1 || c.points["custody.handler.duration/error"] != 0 || c.points["custody.handler.duration/ok"] != 1 {
		t.Errorf("handler durations by result: deferred %d, error %d, ok %d; want 1, 0, 1",
			c.points["custody.handler.duration/deferred"], c.points["custody.handler.duration/error"], c.points["custody.handler.duration/ok"])
	}
	ended := spans.Ended()
	if len(ended) != 2 {
		t.Fatalf("%d spans, want 2 (the deferred attempt and the successful one)", len(ended))
	}
	first := ended[0]
	if first.Status().Code == codes.Error {
		t.Errorf("the deferred attempt's span has error status %q", first.Status().Description)
	}
	var events []string
	for _, ev := range first.Events() {
		events = append(events, ev.Name)
	}
	if len(events) != 1 || events[0] != "deferred" {
		t.Errorf("the deferred attempt's span has events %v, want [deferred]", events)
	}
}

// unparsable is a handler for which every message is a permanent failure.
func unparsable(context.Context, *consumer.Message) error {
	return consumer.Permanent(errors.New("cannot parse"))
}

// TestTelemetryDeadLetterFailureAfterTheLeaseWasLost: a dead-letter write
// that fails after the delivery's lease was lost settles the delivery as
// lost, with the loss counted, instead of giving it back as a retry that
// the broker, which took the message back already, cannot honour. Its
// redelivery is dead-lettered.
func TestTelemetryDeadLetterFailureAfterTheLeaseWasLost(t *testing.T) {
	reader, mp := newMeter()
	e, src := firstLeaseRefused(t)
	dlq := e.dlq()
	dlq.SetFault(func(d *adapters.Delivery) error {
		if d.Attempt > 1 {
			return nil
		}
		select {
		case <-d.Signal.Lost(): // the refused renewal lost it while the write was on its way
		case <-time.After(patience):
			t.Error("the first delivery was never lost")
		}
		return errors.New("dead-letter queue down")
	})
	r := run(t, src, unparsable, consumer.WithName("dlq"), consumer.WithMeterProvider(mp), consumer.WithDeadLetter(dlq), fastRetry(3))
	waitFor(t, "the redelivery dead-lettered", func() bool { return e.stats("dlq").Visible == 1 })
	c := stopAndCollect(t, r, reader, "dlq")
	c.want(map[string]int64{
		"custody.messages.received":              2,
		"custody.messages.settled/lost":          1,
		"custody.messages.settled/retried":       0,
		"custody.messages.settled/dead_lettered": 1,
		"custody.deadletter.failures":            1,
		"custody.lease.lost":                     1,
	})
}

// disposingDeadLetter dead-letters a delivery and disposes of the original
// itself, as a native dead-letter reject does (RabbitMQ's), and says so
// (adapters.OriginalSettler), so that the runtime does not ack it.
type disposingDeadLetter struct {
	dlq *memory.DeadLetterQueue
	src *memory.Source
}

func (d disposingDeadLetter) Send(ctx context.Context, del *adapters.Delivery, f adapters.Failure) error {
	if err := d.dlq.Send(ctx, del, f); err != nil {
		return err
	}
	return d.src.Ack(ctx, []*adapters.Delivery{del})
}

func (disposingDeadLetter) SettlesOriginal(*adapters.Delivery) bool { return true }

// TestTelemetryDeadLetterThatSettledTheOriginal: a delivery whose
// dead-letter destination disposed of it is settled as dead-lettered
// without an ack of its own, which the broker would refuse (counted as an
// ack failure and a lost lease, with a warning of a redelivery that never
// comes).
func TestTelemetryDeadLetterThatSettledTheOriginal(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x")
	src := e.source()
	r := run(t, src, unparsable, consumer.WithName("native"), consumer.WithMeterProvider(mp),
		consumer.WithDeadLetter(disposingDeadLetter{dlq: e.dlq(), src: src}))
	waitFor(t, "the message dead-lettered", func() bool { return e.stats("dlq").Visible == 1 })
	c := stopAndCollect(t, r, reader, "native")
	c.want(map[string]int64{
		"custody.messages.settled/dead_lettered": 1,
		"custody.messages.settled/lost":          0,
		"custody.ack.failures":                   0,
		"custody.lease.lost":                     0,
	})
	if s := e.stats("q"); s.Acked != 1 || s.Visible+s.InFlight != 0 {
		t.Errorf("stats %+v, want the original gone", s)
	}
}

// stallingDeadLetter is a dead-letter destination whose writes hang until
// their context ends, as one whose broker stopped answering does.
type stallingDeadLetter struct{ sending chan struct{} }

func (d stallingDeadLetter) Send(ctx context.Context, _ *adapters.Delivery, _ adapters.Failure) error {
	close(d.sending)
	<-ctx.Done()
	return context.Cause(ctx)
}

// TestTelemetryDeadLetterWriteCutByTheShutdownDeadline: a dead-letter write
// still under way when the shutdown deadline cancels it failed because the
// consumer stopped waiting, not because the destination refused it: the
// delivery is given back, and no dead-letter failure is counted, which would page whoever watches the
// destination on every such shutdown.
func TestTelemetryDeadLetterWriteCutByTheShutdownDeadline(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x")
	dl := stallingDeadLetter{sending: make(chan struct{})}
	r := run(t, e.source(), unparsable, consumer.WithName("cut"), consumer.WithMeterProvider(mp),
		consumer.WithDeadLetter(dl), consumer.WithShutdownTimeout(20*time.Millisecond))
	await(t, "the dead-letter write", dl.sending)
	c := stopAndCollect(t, r, reader, "cut")
	c.want(map[string]int64{
		"custody.messages.received":        1,
		"custody.messages.settled/retried": 1, // given back with its backoff
		"custody.deadletter.failures":      0,
	})
}

// TestTelemetryAttemptCutByALostLeaseIsNoError: an attempt whose delivery
// was lost while it ran (its lease renewals refused) is settled as lost, not
// failed, and its duration and span say cancelled, not error: a rebalance or
// a broker hiccup must not show as the handler's error rate.
func TestTelemetryAttemptCutByALostLeaseIsNoError(t *testing.T) {
	reader, mp := newMeter()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	e, src := firstLeaseRefused(t)
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			<-ctx.Done() // until the lease is lost
			return context.Cause(ctx)
		}
		return nil
	}, consumer.WithName("cut"), consumer.WithMeterProvider(mp), consumer.WithTracerProvider(tp))
	waitFor(t, "the redelivery acked", func() bool { return e.stats("q").Acked == 1 })
	stopAndCollect(t, r, reader, "cut").want(map[string]int64{
		"custody.messages.settled/lost":      1,
		"custody.messages.settled/acked":     1,
		"custody.handler.duration/cancelled": 1,
		"custody.handler.duration/ok":        1,
		"custody.handler.duration/error":     0,
	})
	for _, s := range messageSpans(t, spans, 2) {
		if st := s.Status(); st.Code == codes.Error {
			t.Errorf("span of an attempt: status %v, want no error", st)
		}
	}
	cancelled := 0
	for _, s := range spans.Ended() {
		for _, ev := range s.Events() {
			if ev.Name == "cancelled" {
				cancelled++
			}
		}
	}
	if cancelled != 1 {
		t.Errorf("%d spans with a cancelled event, want 1 (the attempt cut short)", cancelled)
	}
}

// firstLeaseRefused returns a broker holding one message, "x", with a
// 300 ms lease, and a source that refuses every renewal of its first
// delivery, which is so lost, and renews its redelivery.
func firstLeaseRefused(t *testing.T) (*env, *memory.Source) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("x")
	return e, e.source(memory.WithFaults(memory.Faults{Extend: func(d *adapters.Delivery) error {
		if d.Attempt == 1 {
			return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
}
