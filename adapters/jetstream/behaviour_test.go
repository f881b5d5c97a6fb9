package jetstream

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// runUntil runs a consumer on src until cond holds, then stops it.
func runUntil(t *testing.T, src adapters.Source, h consumer.Handler, what string, cond func() bool, opts ...consumer.Option) {
	t.Helper()
	c, err := consumer.New(src, h, append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, what, cond)
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
}

func TestNewRefusesConsumersThatFightTheRuntime(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	create := func(cfg jetstream.ConsumerConfig) {
		t.Helper()
		if _, err := e.js.CreateOrUpdateConsumer(e.ctx(), name, cfg); err != nil {
			t.Fatalf("creating %s: %v", cfg.Durable, err)
		}
	}
	create(jetstream.ConsumerConfig{Durable: "backoff", AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxDeliver: 5, BackOff: []time.Duration{time.Second, 5 * time.Second}})
	create(jetstream.ConsumerConfig{Durable: "ackall", AckPolicy: jetstream.AckAllPolicy})
	create(jetstream.ConsumerConfig{Durable: "push", AckPolicy: jetstream.AckExplicitPolicy})
	create(jetstream.ConsumerConfig{Durable: "maxdeliver", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: 3})
	// A push consumer, through the API of nats.go's legacy JetStream context.
	legacy, err := e.nc.JetStream()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := legacy.AddConsumer(name, &nats.ConsumerConfig{Durable: "pushed", DeliverSubject: nats.NewInbox(), AckPolicy: nats.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		consumer string
		opts     []Option
		want     string
	}{
		{"backoff", []Option{WithMaxAttempts(5)}, "BackOff"},
		{"ackall", nil, "AckPolicy"},
		{"pushed", nil, "use a pull consumer"},
		{"maxdeliver", nil, "WithMaxAttempts"},
		{"maxdeliver", []Option{WithMaxAttempts(5)}, "below the runtime's MaxAttempts 5"},
		{"missing", nil, "WithCreate"},
	} {
		_, err := New(e.ctx(), e.js, name, tc.consumer, tc.opts...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New on consumer %s: %v, want an error saying %q", tc.consumer, err, tc.want)
		}
	}
	if _, err := New(e.ctx(), e.js, name, "maxdeliver", WithMaxAttempts(3)); err != nil {
		t.Errorf("New on a consumer whose MaxDeliver equals WithMaxAttempts: %v", err)
	}
	if _, err := New(e.ctx(), e.js, name, "push"); err != nil {
		t.Errorf("New on a plain pull consumer: %v", err)
	}
	if err := WithCreate(jetstream.ConsumerConfig{BackOff: []time.Duration{time.Second}})(&options{}); err == nil {
		t.Error("WithCreate accepted a BackOff list")
	}
}

// TestMaxAckPendingBoundsConcurrency: the consumer's MaxAckPending is the
// most the runtime may hold, so a concurrency above it is refused at
// construction, naming what to change.
func TestMaxAckPendingBoundsConcurrency(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	src, err := New(e.ctx(), e.js, name, "small", WithCreate(jetstream.ConsumerConfig{MaxAckPending: 8}))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if got := src.Capabilities().MaxUnacked; got != 8 {
		t.Fatalf("MaxUnacked = %d, want the consumer's MaxAckPending 8", got)
	}
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := consumer.New(src, h, consumer.WithConcurrency(16)); err == nil || !strings.Contains(err.Error(), "WithConcurrency(16)") {
		t.Fatalf("consumer.New with a concurrency above MaxAckPending: %v, want an error naming WithConcurrency", err)
	}
}

// TestCapabilities: the lease is the consumer's AckWait; naks take a delay
// and the server counts deliveries; acks and naks, each a round trip, are
// made by the runtime's own goroutines, several at once, after a short
// linger, so that no worker waits for the server's reply.
func TestCapabilities(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	src, err := New(e.ctx(), e.js, name, "caps", WithCreate(jetstream.ConsumerConfig{AckWait: 7 * time.Second, MaxAckPending: 300}), WithMaxFetch(50))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	c := src.Capabilities()
	if c.Lease != 7*time.Second || !c.NackDelay || !c.CountsDeliveries || c.MaxUnacked != 300 || c.MaxReceive != 50 || c.Ordered {
		t.Errorf("Capabilities %+v: want Lease 7s, NackDelay, CountsDeliveries, MaxUnacked 300, MaxReceive 50, not Ordered", c)
	}
	for op, b := range map[string]adapters.Batching{"Ack": c.Ack, "Nack": c.Nack} {
		if b.Linger <= 0 || b.Linger > time.Millisecond || b.MaxCalls < 2 {
			t.Errorf("Capabilities.%s = %+v: want a linger of at most 1ms, so that the runtime's goroutines make the calls, and several calls at once", op, b)
		}
	}
}

// TestPoisonMessageDeadLettered: a message failing MaxAttempts times is in
// the dead-letter stream with its diagnostics and the subject it came from,
// is terminated (not acked), and is never delivered again.
func TestPoisonMessageDeadLettered(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	e.stream(name+"_dlq", false)
	dlq, err := NewDeadLetter(e.ctx(), e.js, name+"_dlq.orders")
	if err != nil {
		t.Fatal(err)
	}
	e.publish(name+".orders.eu", []byte("poison"), map[string]string{"origin": "test", "Nats-Msg-Id": "publisher-id"})
	e.publish(name+".orders.eu", []byte("good"), nil)
	const ackWait = 2 * time.Second
	src, err := New(e.ctx(), e.js, name, "poison", WithCreate(jetstream.ConsumerConfig{AckWait: ackWait}), WithPollWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var calls sync.Map
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		n, _ := calls.LoadOrStore(string(m.Body), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		if string(m.Body) == "poison" {
			return errors.New("cannot ship\nto nowhere")
		}
		return nil
	})
	count := func(body string) int64 {
		n, ok := calls.Load(body)
		if !ok {
			return 0
		}
		return n.(*atomic.Int64).Load()
	}
	runUntil(t, src, h, "the poison message terminated", func() bool { return src.Stats().Terms == 1 },
		consumer.WithDeadLetter(dlq), consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}))
	ms, err := e.readAll(e.ctx(), name+"_dlq", "")
	if err != nil || len(ms) != 1 {
		t.Fatalf("dead-letter stream holds %d messages (%v), want 1", len(ms), err)
	}
	hd, err := copyHeaders(ms[0])
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		adapters.HeaderAttempts:      "3",
		adapters.HeaderOriginalQueue: name,
		adapters.HeaderOriginalID:    name + ":1",
		adapters.HeaderError:         `cannot ship\nto nowhere`,
		HeaderOriginalSubject:        name + ".orders.eu",
		"origin":                     "test",
		"Nats-Msg-Id":                "publisher-id", // kept, in custody-original-headers
	}
	for k, v := range want {
		if hd[k] != v {
			t.Errorf("dead-letter copy header %s = %q, want %q (headers %v)", k, hd[k], v, hd)
		}
	}
	if got := ms[0].Headers().Get("Nats-Msg-Id"); got == "publisher-id" || got == "" {
		t.Errorf("the copy's own Nats-Msg-Id is %q; want one of its own, not the publisher's", got)
	}
	if string(ms[0].Data()) != "poison" {
		t.Errorf("copy body %q", ms[0].Data())
	}
	if n := count("poison"); n != 3 {
		t.Errorf("poison message handled %d times, want 3", n)
	}
	ci, err := src.cons.Info(e.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if ci.NumAckPending != 0 || ci.NumPending != 0 {
		t.Errorf("consumer holds %d unacked and %d pending messages after the dead letter, want none", ci.NumAckPending, ci.NumPending)
	}
	if st := src.Stats(); st.Acks != 1 || st.Naks != 2 {
		t.Errorf("acks %d, naks %d: want the good message acked and the poison one nacked twice, then terminated", st.Acks, st.Naks)
	}
	// Not delivered again, to this consumer or another.
	src2, err := New(e.ctx(), e.js, name, "poison", WithPollWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	runUntil(t, src2, h, "a quiet period past AckWait", func() bool { time.Sleep(ackWait + 500*time.Millisecond); return true })
	if n := count("poison"); n != 3 {
		t.Errorf("poison message handled %d times after its dead letter, want 3", n)
	}
}

// TestDeadLetterPublishFailureKeepsOriginal: while the dead-letter subject
// has no stream, the publish fails and the original stays with the
// consumer (not acked, not terminated); once the stream is back the copy
// is stored and the original terminated.
func TestDeadLetterPublishFailureKeepsOriginal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	dlqStream := name + "_dlq"
	e.stream(dlqStream, false)
	dlq, err := NewDeadLetter(e.ctx(), e.js, dlqStream+".x")
	if err != nil {
		t.Fatal(err)
	}
	if err := e.js.DeleteStream(e.ctx(), dlqStream); err != nil {
		t.Fatal(err)
	}
	e.publish(name+".a", []byte("poison"), nil)
	src, err := New(e.ctx(), e.js, name, "dlfail", WithCreate(jetstream.ConsumerConfig{AckWait: 2 * time.Second}), WithPollWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int64
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		return consumer.Permanent(errors.New("malformed"))
	})
	c, err := consumer.New(src, h, consumer.WithLogger(testlog.New(t)), consumer.WithDeadLetter(dlq),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(50 * time.Millisecond)}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	time.Sleep(3 * time.Second) // dead-letter writes fail meanwhile
	if st := src.Stats(); st.Acks != 0 || st.Terms != 0 {
		t.Errorf("with the dead-letter stream gone: %d acks, %d terms, want none", st.Acks, st.Terms)
	}
	e.stream(dlqStream, false)
	waitFor(t, "the copy stored and the original terminated", func() bool { return src.Stats().Terms == 1 })
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	ms, err := e.readAll(e.ctx(), dlqStream, "")
	if err != nil || len(ms) != 1 || string(ms[0].Data()) != "poison" {
		t.Fatalf("dead-letter stream holds %d messages (%v), want the poison one", len(ms), err)
	}
	t.Logf("handler calls: %d (a permanent error is not retried; the failed writes waited in place)", calls.Load())
}

// TestDeadLetterStreamAndSettlement: NewDeadLetter finds the stream that
// captures its subject, or creates it with WithCreateStream, and says what
// to do when neither works. After Send, the original of a Source's delivery
// is terminated and SettlesOriginal says so (the runtime does not ack it);
// another broker's delivery is only copied, and left to the runtime.
func TestDeadLetterStreamAndSettlement(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	dlqStream := name + "_dlq"
	subject := dlqStream + ".copies"
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		e.js.DeleteStream(ctx, dlqStream)
	})
	if _, err := NewDeadLetter(e.ctx(), e.js, subject); err == nil || !strings.Contains(err.Error(), "WithCreateStream") {
		t.Errorf("NewDeadLetter with no stream capturing the subject: %v, want an error naming WithCreateStream", err)
	}
	if _, err := NewDeadLetter(e.ctx(), e.js, subject, WithCreateStream(jetstream.StreamConfig{})); err == nil || !strings.Contains(err.Error(), "Name") {
		t.Errorf("WithCreateStream without a name: %v, want an error asking for one", err)
	}
	if _, err := NewDeadLetter(e.ctx(), e.js, subject, WithCreateStream(jetstream.StreamConfig{Name: dlqStream, Subjects: []string{dlqStream + ".other"}})); err == nil || !strings.Contains(err.Error(), "Subjects") {
		t.Errorf("WithCreateStream with subjects leaving the dead-letter subject out: %v, want an error saying so", err)
	}
	e.js.DeleteStream(e.ctx(), dlqStream)
	dl, err := NewDeadLetter(e.ctx(), e.js, subject, WithCreateStream(jetstream.StreamConfig{Name: dlqStream, Storage: jetstream.MemoryStorage}))
	if err != nil {
		t.Fatal(err)
	}
	if dl.Stream() != dlqStream {
		t.Errorf("Stream() = %q, want the stream created, %q", dl.Stream(), dlqStream)
	}
	again, err := NewDeadLetter(e.ctx(), e.js, subject, WithCreateStream(jetstream.StreamConfig{Name: dlqStream, Subjects: []string{"ignored"}}))
	if err != nil || again.Stream() != dlqStream {
		t.Errorf("NewDeadLetter with the stream already there: %v, %v; want it used as it is", again, err)
	}

	e.publish(name+".a", []byte("poison"), nil)
	src, err := New(e.ctx(), e.js, name, "settle", WithCreate(jetstream.ConsumerConfig{AckWait: 30 * time.Second}))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveN(t, src, 1)
	foreign := &adapters.Delivery{ID: "sqs-1", Body: []byte("foreign"), Queue: "orders"}
	f := adapters.Failure{Err: errors.New("malformed"), Attempts: 1}
	for _, d := range []*adapters.Delivery{ds[0], foreign} {
		if err := dl.Send(e.ctx(), d, f); err != nil {
			t.Fatalf("Send %s: %v", d.ID, err)
		}
	}
	if !dl.SettlesOriginal(ds[0]) {
		t.Error("SettlesOriginal is false for the Source's delivery Send terminated: the runtime would ack it")
	}
	if dl.SettlesOriginal(foreign) {
		t.Error("SettlesOriginal is true for another broker's delivery: the runtime would not ack it")
	}
	if st := src.Stats(); st.Terms != 1 {
		t.Errorf("%d terms, want the original terminated", st.Terms)
	}
	ci, err := src.cons.Info(e.ctx())
	if err != nil || ci.NumAckPending != 0 {
		t.Errorf("consumer info %+v, %v: want nothing unacked after the term", ci, err)
	}
	ms, err := e.readAll(e.ctx(), dlqStream, "")
	if err != nil || len(ms) != 2 {
		t.Fatalf("the created stream holds %d copies (%v), want 2", len(ms), err)
	}
}

// ackFailures returns the runtime's custody.ack.failures as reader last
// collected it.
func ackFailures(t *testing.T, reader *sdkmetric.ManualReader) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if sum, ok := m.Data.(metricdata.Sum[int64]); ok && m.Name == "custody.ack.failures" {
				for _, dp := range sum.DataPoints {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// TestNativeDeadLetter: with the consumer's MaxDeliver equal to MaxAttempts,
// a poison message is left to the server, which stops delivering it and
// publishes its MAX_DELIVERIES advisory; a permanent error terminates at
// once, with a MSG_TERMINATED advisory.
func TestNativeDeadLetter(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	advisories := make(chan *nats.Msg, 16)
	sub, err := e.nc.ChanSubscribe("$JS.EVENT.ADVISORY.CONSUMER.*."+name+".native", advisories)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	e.publish(name+".a", []byte("retried"), nil)
	e.publish(name+".a", []byte("permanent"), nil)
	src, err := New(e.ctx(), e.js, name, "native", WithCreate(jetstream.ConsumerConfig{AckWait: 5 * time.Second, MaxDeliver: 3}),
		WithMaxAttempts(3), WithPollWait(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.NativeDeadLetter(4); err == nil {
		t.Error("NativeDeadLetter(4) on a consumer with MaxDeliver 3 did not fail")
	}
	dl, err := src.NativeDeadLetter(3)
	if err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	var calls sync.Map
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		n, _ := calls.LoadOrStore(string(m.Body), new(atomic.Int64))
		n.(*atomic.Int64).Add(1)
		if string(m.Body) == "permanent" {
			return consumer.Permanent(errors.New("malformed"))
		}
		return errors.New("fails")
	})
	seen := map[string]bool{}
	runUntil(t, src, h, "both advisories", func() bool {
		for {
			select {
			case m := <-advisories:
				for _, kind := range []string{"MAX_DELIVERIES", "MSG_TERMINATED"} {
					if strings.Contains(m.Subject, kind) {
						seen[kind] = true
					}
				}
			default:
				return seen["MAX_DELIVERIES"] && seen["MSG_TERMINATED"]
			}
		}
	}, consumer.WithDeadLetter(dl), consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}),
		consumer.WithMeterProvider(mp))
	if n := ackFailures(t, reader); n != 0 {
		t.Errorf("%d acks failed: the runtime acked messages the native dead letter had settled", n)
	}
	for body, want := range map[string]int64{"retried": 3, "permanent": 1} {
		n, _ := calls.Load(body)
		if got := n.(*atomic.Int64).Load(); got != want {
			t.Errorf("%s handled %d times, want %d", body, got, want)
		}
	}
	if st := src.Stats(); st.Acks != 0 {
		t.Errorf("%d acks: the native dead letter leaves messages to the server, unacked", st.Acks)
	}
	info, err := e.js.Stream(e.ctx(), name)
	if err != nil || info.CachedInfo().State.Msgs != 2 {
		t.Errorf("the stream holds %v messages (%v), want both still there", info.CachedInfo().State.Msgs, err)
	}
}

// TestTraceContextFromHeaders: a producer's W3C trace context, sent as the
// traceparent header, is the parent of the processing span.
func TestTraceContextFromHeaders(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	const traceID, parentSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	e.publish(name+".t", []byte("traced"), map[string]string{"traceparent": "00-" + traceID + "-" + parentSpan + "-01"})
	src, err := New(e.ctx(), e.js, name, "trace", WithCreate(jetstream.ConsumerConfig{}), WithPollWait(200*time.Millisecond))
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
	}), "the message handled", handled.Load, consumer.WithTracerProvider(tp), consumer.WithPropagator(propagation.TraceContext{}))
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID().String() == traceID && s.Parent().SpanID().String() == parentSpan {
			return
		}
	}
	t.Errorf("no span continues trace %s from span %s", traceID, parentSpan)
}

// TestMetrics: the backlog gauge follows the consumer's pending count, and
// requests are counted by kind.
func TestMetrics(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	for range 5 {
		e.publish(name+".m", []byte("x"), nil)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	src, err := New(e.ctx(), e.js, name, "metrics", WithCreate(jetstream.ConsumerConfig{}), WithMeterProvider(mp))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	read := func() (pending int64, requests map[string]int64) {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		requests = map[string]int64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				switch data := m.Data.(type) {
				case metricdata.Gauge[int64]:
					if m.Name == "custody.jetstream.pending" {
						pending = data.DataPoints[0].Value
					}
				case metricdata.Sum[int64]:
					for _, dp := range data.DataPoints {
						kind, _ := dp.Attributes.Value("custody.jetstream.request")
						requests[kind.AsString()] += dp.Value
					}
				}
			}
		}
		return pending, requests
	}
	if p, _ := read(); p != 5 {
		t.Errorf("pending before any fetch = %d, want 5", p)
	}
	ds := receiveN(t, src, 2)
	if p, _ := read(); p != 3 {
		t.Errorf("pending after fetching 2 of 5 = %d, want 3", p)
	}
	if err := src.Ack(e.ctx(), ds); err != nil {
		t.Fatal(err)
	}
	if _, r := read(); r["ack"] != 2 || r["fetch"] < 1 {
		t.Errorf("requests counted %v, want 2 acks and a fetch", r)
	}
}

// receiveN receives until it holds n deliveries, asking for at most n.
func receiveN(t *testing.T, src *Source, n int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var ds []*adapters.Delivery
	for len(ds) < n {
		got, err := src.Receive(ctx, n-len(ds))
		if err != nil {
			t.Fatalf("Receive: %v", err)
		}
		ds = append(ds, got...)
	}
	return ds
}

// TestAckAfterNackFails: an ack names its message by stream sequence, so
// the server would take a stale consumer's ack of a message it gave back
// (nak) for the redelivery another consumer now runs, and a failure of that
// run would then find nothing to redeliver. The Source refuses the stale
// ack instead: the message is still redelivered after the other consumer's
// nak.
func TestAckAfterNackFails(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	e.publish(name+".a", []byte("once"), nil)
	open := func() *Source {
		src, err := New(e.ctx(), e.js, name, "stale", WithCreate(jetstream.ConsumerConfig{AckWait: 30 * time.Second}), WithPollWait(200*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { src.Close() })
		return src
	}
	a, b := open(), open()
	ctx := e.ctx()
	first := receiveN(t, a, 1)
	if err := a.Nack(ctx, adapters.NackAll(first, 0)); err != nil {
		t.Fatal(err)
	}
	second := receiveN(t, b, 1)
	if err := a.Ack(ctx, first); adapters.EntryError(err, 0) == nil {
		t.Fatal("Ack of a delivery already given back succeeded")
	}
	if err := b.Nack(ctx, adapters.NackAll(second, 0)); err != nil {
		t.Fatal(err)
	}
	third := receiveN(t, b, 1)
	if string(third[0].Body) != "once" || third[0].Attempt != 3 {
		t.Fatalf("third delivery %q, attempt %d; want the message again, attempt 3", third[0].Body, third[0].Attempt)
	}
	if err := b.Ack(ctx, third); err != nil {
		t.Fatal(err)
	}
}

// TestNackAfterLeaseRanOutIsNotSent: a nak names its message by stream
// sequence, so one sent by a consumer whose lease ran out would act on the
// redelivery another consumer now holds, handing it to a third while the
// second runs it. The Source refuses it (adapters.ErrLeaseLost) instead.
func TestNackAfterLeaseRanOutIsNotSent(t *testing.T) {
	e := newEnv(t)
	name := uniqueName(t)
	e.stream(name, false)
	e.publish(name+".a", []byte("held"), nil)
	const ackWait = time.Second
	open := func() *Source {
		src, err := New(e.ctx(), e.js, name, "late", WithCreate(jetstream.ConsumerConfig{AckWait: ackWait}), WithPollWait(200*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { src.Close() })
		return src
	}
	a, b, c := open(), open(), open()
	ctx := e.ctx()
	stale := receiveN(t, a, 1)
	held := receiveN(t, b, 1) // after A's lease ran out
	err := a.Nack(ctx, adapters.NackAll(stale, 0))
	if e := adapters.EntryError(err, 0); !errors.Is(e, adapters.ErrLeaseLost) {
		t.Fatalf("Nack of a delivery whose lease ran out: %v, want adapters.ErrLeaseLost", err)
	}
	// B holds the message for its whole AckWait: nobody else gets it.
	rctx, cancel := context.WithTimeout(ctx, ackWait/2)
	defer cancel()
	if got, _ := c.Receive(rctx, 1); len(got) > 0 {
		t.Fatalf("a third consumer received %q (delivery %d) while the second held it", got[0].Body, got[0].Attempt)
	}
	if err := b.Ack(ctx, held); err != nil {
		t.Fatal(err)
	}
}

// TestOrderByKeySerialisesPerSubject: Key is the subject (or the
// WithKeyHeader header), so consumer.OrderByKey runs one message per
// subject at a time, in stream order, while subjects run concurrently.
func TestOrderByKeySerialisesPerSubject(t *testing.T) {
	for _, byHeader := range []bool{false, true} {
		t.Run(map[bool]string{false: "subject", true: "header"}[byHeader], func(t *testing.T) {
			e := newEnv(t)
			name := uniqueName(t)
			e.stream(name, false)
			const perKey = 20
			keys := []string{"a", "b", "c"}
			for i := range perKey {
				for _, k := range keys {
					body := []byte(k + "-" + strconv.Itoa(i))
					if byHeader {
						// One subject for all: only the header tells keys apart.
						e.publish(name+".all", body, map[string]string{"customer": k})
					} else {
						e.publish(name+"."+k, body, nil)
					}
				}
			}
			opts := []Option{WithCreate(jetstream.ConsumerConfig{}), WithPollWait(200 * time.Millisecond)}
			if byHeader {
				opts = append(opts, WithKeyHeader("customer"))
			}
			src, err := New(e.ctx(), e.js, name, "ordered", opts...)
			if err != nil {
				t.Fatal(err)
			}
			var (
				mu       sync.Mutex
				running  = map[string]bool{}
				seen     = map[string][]int{}
				parallel int // most keys running at once
				bad      []string
				total    int
			)
			h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
				k, n, _ := strings.Cut(string(m.Body), "-")
				i, _ := strconv.Atoi(n)
				mu.Lock()
				if running[m.Key] {
					bad = append(bad, "concurrent "+string(m.Body))
				}
				running[m.Key] = true
				parallel = max(parallel, len(running))
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
				mu.Lock()
				delete(running, m.Key)
				seen[k] = append(seen[k], i)
				total++
				mu.Unlock()
				return nil
			})
			runUntil(t, src, h, "every message handled", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return total == perKey*len(keys)
			}, consumer.WithConcurrency(8), consumer.WithOrdering(consumer.OrderByKey))
			mu.Lock()
			defer mu.Unlock()
			if len(bad) > 0 {
				t.Fatalf("messages of one key ran concurrently: %v", bad)
			}
			for _, k := range keys {
				for i, got := range seen[k] {
					if got != i {
						t.Fatalf("key %s handled out of stream order: %v", k, seen[k])
					}
				}
			}
			if parallel < 2 {
				t.Errorf("at most %d key ran at once; keys should run concurrently", parallel)
			}
		})
	}
}
