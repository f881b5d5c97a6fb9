package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// newMeter returns a meter provider whose measurements reader collects.
func newMeter() (*sdkmetric.ManualReader, *sdkmetric.MeterProvider) {
	reader := sdkmetric.NewManualReader()
	return reader, sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
}

// sums returns every Int64 sum data point by metric name and outcome.
func sums(t *testing.T, reader *sdkmetric.ManualReader) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, dp := range data.DataPoints {
					name := m.Name
					if v, ok := dp.Attributes.Value(attribute.Key("custody.outcome")); ok {
						name += "/" + v.AsString()
					}
					out[name] += dp.Value
				}
			case metricdata.Histogram[float64]:
				for _, dp := range data.DataPoints {
					out[m.Name] += int64(dp.Count)
				}
			}
		}
	}
	return out
}

func TestTelemetryCountsWhatHappened(t *testing.T) {
	reader, mp := newMeter()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))

	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	traceID := "4bf92f3577b34da6a3ce929d0e0e4736"
	e.b.Publish(context.Background(), "q",
		memory.Message{Body: []byte("ok"), Headers: map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}},
		memory.Message{Body: []byte("retry")},
		memory.Message{Body: []byte("poison")},
		memory.Message{Body: []byte("slow")},
	)
	failAck := true
	src := e.source(memory.WithFaults(memory.Faults{Ack: func(d *adapters.Delivery) error {
		if string(d.Body) == "ok" && failAck {
			failAck = false
			return errors.New("ack lost")
		}
		return nil
	}}))
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		switch string(m.Body) {
		case "retry":
			if m.Attempt == 1 {
				return errors.New("once")
			}
		case "poison":
			return consumer.Permanent(errors.New("bad"))
		case "slow":
			time.Sleep(250 * time.Millisecond)
		}
		return nil
	}, consumer.WithConcurrency(4), fastRetry(3), consumer.WithDeadLetter(e.dlq()),
		consumer.WithMeterProvider(mp), consumer.WithTracerProvider(tp),
		consumer.WithPropagator(propagation.TraceContext{}))
	waitFor(t, "queue drained", func() bool { s := e.stats("q"); return s.Acked == 4 && s.Visible == 0 && s.InFlight == 0 })
	r.stop()

	got := sums(t, reader)
	want := map[string]int64{
		"custody.messages.received":              6, // ok twice (lost ack), retry twice, poison, slow
		"custody.messages.redelivered":           2,
		"custody.messages.settled/acked":         3,
		"custody.messages.settled/lost":          1, // the ack that failed
		"custody.messages.settled/retried":       1,
		"custody.messages.settled/dead_lettered": 1,
		"custody.ack.failures":                   1,
		"custody.messages.in_flight":             0,
		"custody.handler.duration":               6,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %d, want %d", k, got[k], v)
		}
	}
	if got["custody.lease.extensions"] < 1 {
		t.Errorf("custody.lease.extensions = %d, want at least 1 for a handler that outlived a third of its lease", got["custody.lease.extensions"])
	}

	ended := spans.Ended()
	if len(ended) != 6 {
		t.Fatalf("%d spans, want one per handler attempt (6)", len(ended))
	}
	var linked bool
	for _, s := range ended {
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("span kind %v, want consumer", s.SpanKind())
		}
		if s.SpanContext().TraceID().String() == traceID {
			linked = true
		}
	}
	if !linked {
		t.Error("no span continued the trace from the message's traceparent header")
	}
}

var globalTracingUnset = func() *atomic.Bool { var b atomic.Bool; b.Store(true); return &b }()

// A consumer built before the application installs its tracing SDK through
// the OpenTelemetry globals skips spans while nothing could record them, and
// starts them once the SDK is installed; the trace context in the message's
// headers reaches the handler in both phases.
func TestSpansFollowTheGlobalProvider(t *testing.T) {
	if !globalTracingUnset.CompareAndSwap(true, false) {
		t.Skip("the OpenTelemetry global provider can be installed only once per process (-count > 1)")
	}
	otel.SetTextMapPropagator(propagation.TraceContext{})
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	traceID := "4bf92f3577b34da6a3ce929d0e0e4736"
	header := map[string]string{"traceparent": "00-" + traceID + "-00f067aa0ba902b7-01"}
	seen := make(chan string, 2)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		seen <- trace.SpanContextFromContext(ctx).TraceID().String()
		return nil
	})
	spans := tracetest.NewSpanRecorder()
	e.b.Publish(context.Background(), "q", memory.Message{Body: []byte("before"), Headers: header})
	if got := <-seen; got != traceID {
		t.Errorf("before the SDK: handler saw trace %s, want %s", got, traceID)
	}
	otel.SetTracerProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)))
	t.Cleanup(func() { otel.SetTracerProvider(noop.NewTracerProvider()) })
	e.b.Publish(context.Background(), "q", memory.Message{Body: []byte("after"), Headers: header})
	if got := <-seen; got != traceID {
		t.Errorf("after the SDK: handler saw trace %s, want %s", got, traceID)
	}
	waitFor(t, "both acked", func() bool { return e.stats("q").Acked == 2 })
	r.stop()
	ended := spans.Ended()
	if len(ended) != 1 {
		t.Fatalf("%d spans recorded, want 1 (the message handled after the SDK was installed)", len(ended))
	}
	if got := ended[0].SpanContext().TraceID().String(); got != traceID {
		t.Errorf("span in trace %s, want %s", got, traceID)
	}
}

var globalMetricsUnset = func() *atomic.Bool { var b atomic.Bool; b.Store(true); return &b }()

// A consumer built before the application installs its metrics SDK through
// the OpenTelemetry globals does not time its handlers while nothing could
// record the durations, and times them once the SDK is installed.
func TestHandlerDurationsFollowTheGlobalMeterProvider(t *testing.T) {
	if !globalMetricsUnset.CompareAndSwap(true, false) {
		t.Skip("the OpenTelemetry global meter provider can be installed only once per process (-count > 1)")
	}
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	handled := make(chan struct{}, 2)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		handled <- struct{}{}
		return nil
	})
	e.publish("before")
	<-handled
	reader, mp := newMeter()
	otel.SetMeterProvider(mp)
	t.Cleanup(func() { otel.SetMeterProvider(metricnoop.NewMeterProvider()) })
	e.publish("after")
	<-handled
	waitFor(t, "both acked", func() bool { return e.stats("q").Acked == 2 })
	r.stop()
	if got := sums(t, reader)["custody.handler.duration"]; got != 1 {
		t.Fatalf("custody.handler.duration counted %d attempts, want 1 (the message handled after the SDK was installed)", got)
	}
}

// A renewal that fails without the lease being gone (the broker throttled
// it) is counted, tried again, and the handler keeps its lease and finishes.
func TestTransientRenewalFailureIsCountedAndTheHandlerKeepsItsLease(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 600 * time.Millisecond})
	e.publish("slow")
	var extendCalls atomic.Int32
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		if extendCalls.Add(1) == 1 {
			return errors.New("throttled")
		}
		return nil
	}}))
	var cause atomic.Value
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-time.After(time.Second): // outlives the lease: renewals must work
			return nil
		case <-ctx.Done():
			cause.Store(context.Cause(ctx))
			return ctx.Err()
		}
	}, consumer.WithMeterProvider(mp))
	waitFor(t, "acked", func() bool { return e.stats("q").Acked == 1 })
	r.stop()
	if c := cause.Load(); c != nil {
		t.Fatalf("handler cancelled after one throttled renewal: %v", c)
	}
	got := sums(t, reader)
	if got["custody.lease.renewal_failures"] != 1 || got["custody.lease.lost"] != 0 {
		t.Fatalf("renewal_failures = %d, lost = %d; want 1 and 0", got["custody.lease.renewal_failures"], got["custody.lease.lost"])
	}
	if s := e.stats("q"); s.Acked != 1 || s.Visible != 0 {
		t.Fatalf("stats %+v: want the message acked once", s)
	}
}

// TestLeaseLostIsCountedWhoeverNoticedIt: a lease the broker reports lost by
// itself (here: it ran out while a renewal hung, and another consumer
// received the message) is counted in custody.lease.lost and logged. Only
// the lease keeper counted, and it counts nothing for a lease the runtime
// has stopped, which it does as soon as the cancelled handler returns.
func TestLeaseLostIsCountedWhoeverNoticedIt(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("x")
	entered, unblock := make(chan struct{}), make(chan struct{})
	var hung atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		if hung.CompareAndSwap(false, true) {
			close(entered)
			<-unblock // the renewal hangs until the lease has run out
		}
		return nil
	}}))
	var unblocked sync.Once
	defer unblocked.Do(func() { close(unblock) })
	returned := make(chan struct{})
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		defer close(returned)
		<-ctx.Done()
		return ctx.Err()
	}, consumer.WithMeterProvider(mp), consumer.WithMaxInFlight(1)) // so that only the other consumer can take it
	await(t, "a renewal on the wire", entered)
	other := e.source()
	var taken []*adapters.Delivery
	waitFor(t, "the lease to run out and another consumer to take the message", func() bool {
		ds, err := other.Receive(context.Background(), 1)
		if err != nil {
			t.Fatal(err)
		}
		taken = ds
		return len(ds) == 1
	})
	await(t, "the handler to return", returned)
	time.Sleep(50 * time.Millisecond) // let the runtime stop the lease before the renewal returns
	unblocked.Do(func() { close(unblock) })
	waitFor(t, "the delivery settled as lost", func() bool { return sums(t, reader)["custody.messages.settled/lost"] == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if err := other.Ack(context.Background(), taken); err != nil {
		t.Fatal(err)
	}
	if n := sums(t, reader)["custody.lease.lost"]; n != 1 {
		t.Fatalf("custody.lease.lost = %d, want 1", n)
	}
}

// TestLeaseLostIsCountedWhenTheHandlerSucceedsAnyway: a handler that ignores
// its cancelled context and returns nil is acked all the same (the broker
// may still take the ack), but its lease was lost and is counted.
func TestLeaseLostIsCountedWhenTheHandlerSucceedsAnyway(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("x")
	var refused atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		if refused.CompareAndSwap(false, true) {
			return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		return nil // the effect was done regardless
	}, consumer.WithMeterProvider(mp))
	waitFor(t, "the delivery settled", func() bool {
		s := sums(t, reader)
		return s["custody.messages.settled/acked"]+s["custody.messages.settled/lost"] == 1
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := sums(t, reader)["custody.lease.lost"]; n != 1 {
		t.Fatalf("custody.lease.lost = %d, want 1", n)
	}
}

// TestLeaseLostIsCountedOnceWhenItsAckIsRefusedToo: a handler that ignores
// its lost lease and succeeds is counted when it returns; the broker then
// refusing its ack for that same lost lease is the same loss, not a second.
func TestLeaseLostIsCountedOnceWhenItsAckIsRefusedToo(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("x")
	var refused, ackRefused atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{
		Extend: func(*adapters.Delivery) error {
			if refused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
		Ack: func(*adapters.Delivery) error {
			if ackRefused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			<-ctx.Done()
		}
		return nil // the effect was done regardless
	}, consumer.WithMeterProvider(mp))
	waitFor(t, "the refused ack settled as lost", func() bool { return sums(t, reader)["custody.messages.settled/lost"] == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := sums(t, reader)["custody.lease.lost"]; n != 1 {
		t.Fatalf("custody.lease.lost = %d, want 1: one delivery lost its lease once", n)
	}
}

// TestLeaseLostAtAckIsCounted: a lease the broker reports gone only when the
// ack is refused (a stale receipt, no failed renewal before it) is a lost
// lease all the same, and counted.
func TestLeaseLostAtAckIsCounted(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 30 * time.Second})
	e.publish("x")
	var ackRefused atomic.Bool
	src := e.source(memory.WithFaults(memory.Faults{Ack: func(*adapters.Delivery) error {
		if ackRefused.CompareAndSwap(false, true) {
			return fmt.Errorf("receipt handle is stale: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
	r := run(t, src, func(context.Context, *consumer.Message) error { return nil }, consumer.WithMeterProvider(mp))
	waitFor(t, "the refused ack settled as lost", func() bool { return sums(t, reader)["custody.messages.settled/lost"] == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := sums(t, reader)["custody.lease.lost"]; n != 1 {
		t.Fatalf("custody.lease.lost = %d, want 1", n)
	}
}

// TestLeaseLostWhileWaitingIsCountedWhenLeavingUnfinishedOnShutdown: with
// WithLeaveUnfinishedOnShutdown, a delivery still waiting in its lane at
// shutdown is left to its lease; one whose lease was already lost has none
// left to wait for, and is settled and counted as lost.
func TestLeaseLostWhileWaitingIsCountedWhenLeavingUnfinishedOnShutdown(t *testing.T) {
	reader, mp := newMeter()
	b := memory.NewBroker()
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: 300 * time.Millisecond, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	if err := b.Publish(context.Background(), "q",
		memory.Message{Key: "a", Body: []byte("a1")}, memory.Message{Key: "a", Body: []byte("a2")}); err != nil {
		t.Fatal(err)
	}
	var lostD atomic.Pointer[adapters.Delivery]
	src, err := b.Source("q", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(d *adapters.Delivery) error {
			if string(d.Body) == "a2" && lostD.CompareAndSwap(nil, d) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done() // a1 runs until the shutdown timeout; a2 waits behind it
		return nil
	}, consumer.WithMeterProvider(mp), consumer.WithLeaveUnfinishedOnShutdown(),
		consumer.WithShutdownTimeout(100*time.Millisecond))
	waitFor(t, "a2's lease lost while it waits", func() bool {
		d := lostD.Load()
		return d != nil && d.Signal.LostCause() != nil
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	s := sums(t, reader)
	if s["custody.messages.settled/lost"] != 1 || s["custody.lease.lost"] != 1 || s["custody.messages.settled/left"] != 0 {
		t.Fatalf("settled lost=%d left=%d, custody.lease.lost=%d; want a2 settled and counted as lost",
			s["custody.messages.settled/lost"], s["custody.messages.settled/left"], s["custody.lease.lost"])
	}
}

// TestAtMostOnceFailedEarlyAckIsCountedLeft: a delivery whose early ack
// failed is neither handled nor nacked; it comes back when its lease runs
// out, so it is settled as "left", not "released" (given back at once).
func TestAtMostOnceFailedEarlyAckIsCountedLeft(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: 50 * time.Millisecond})
	e.publish("a")
	r := run(t, e.sourceLosingFirstAck(), func(ctx context.Context, m *consumer.Message) error { return nil },
		consumer.WithAtMostOnceAckBeforeProcessingUnsafe(), consumer.WithMeterProvider(mp))
	waitFor(t, "acked on the redelivery", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	s := sums(t, reader)
	if s["custody.messages.settled/left"] != 1 || s["custody.messages.settled/released"] != 0 {
		t.Fatalf("settled left %d, released %d; want the failed early ack counted as left", s["custody.messages.settled/left"], s["custody.messages.settled/released"])
	}
}

// revokingSource loses a delivery with a cause other than a lost lease (as
// a Kafka revoke or a dead RabbitMQ channel does) while its handler runs,
// and counts the acks that reach it.
type revokingSource struct {
	*memory.Source
	mu    sync.Mutex
	held  map[string]*adapters.Delivery
	acked atomic.Int32
}

func (s *revokingSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, max)
	s.mu.Lock()
	for _, d := range ds {
		s.held[string(d.Body)] = d
	}
	s.mu.Unlock()
	return ds, err
}

func (s *revokingSource) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	s.acked.Add(int32(len(ds)))
	return s.Source.Ack(ctx, ds)
}

func (s *revokingSource) revoke(body string) {
	s.mu.Lock()
	d := s.held[body]
	s.mu.Unlock()
	d.Signal.Lose(fmt.Errorf("partition revoked: %w", adapters.ErrRevoked))
}

// A handler that succeeds after its delivery was lost for good is settled
// lost: its ack is not sent (the adapter would refuse it), so no ack failure
// is counted nor a redelivery warned of, and no lease is counted lost.
func TestSuccessAfterARevokeIsSettledLostWithoutAnAck(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x")
	src := &revokingSource{Source: e.source(), held: map[string]*adapters.Delivery{}}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		src.revoke(string(m.Body))
		return nil // the effect was done regardless
	}, consumer.WithMeterProvider(mp))
	waitFor(t, "the delivery settled", func() bool {
		s := sums(t, reader)
		return s["custody.messages.settled/acked"]+s["custody.messages.settled/lost"] == 1
	})
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	s := sums(t, reader)
	if s["custody.messages.settled/lost"] != 1 || s["custody.ack.failures"] != 0 || s["custody.lease.lost"] != 0 {
		t.Fatalf("settled lost %d, ack failures %d, leases lost %d; want 1, 0, 0",
			s["custody.messages.settled/lost"], s["custody.ack.failures"], s["custody.lease.lost"])
	}
	if n := src.acked.Load(); n != 0 {
		t.Fatalf("%d acks sent for a delivery the adapter had lost", n)
	}
}
