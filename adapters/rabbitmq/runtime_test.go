package rabbitmq

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// Tests that run the adapter under the real runtime.

// running is a consumer.Consumer running in the background.
type running struct {
	c      *consumer.Consumer
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

func runConsumer(t *testing.T, src adapters.Source, h consumer.Handler, opts ...consumer.Option) *running {
	t.Helper()
	c, err := consumer.New(src, h, append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { r.stop(t) })
	return r
}

func (r *running) stop(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		r.cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Error("Run did not return after cancellation")
		}
	})
}

// handled records which message ids a handler saw, and how often.
type handled struct {
	mu     sync.Mutex
	counts map[string]int
}

func (h *handled) add(id string) {
	h.mu.Lock()
	if h.counts == nil {
		h.counts = map[string]int{}
	}
	h.counts[id]++
	h.mu.Unlock()
}

func (h *handled) distinct() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.counts)
}

func (h *handled) snapshot() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make(map[string]int, len(h.counts))
	for k, v := range h.counts {
		out[k] = v
	}
	return out
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The connection is closed by the broker mid-stream while eight handlers
// run. Half of them notice (their context is cancelled with
// ErrConnectionLost); the other half finish after the reconnect, and their
// acks, for tags that now name other messages on the new channel, must be
// dropped. Every message is still handled (an ack landing on the wrong
// message would make one never show up), consumption resumes, and the queue
// ends empty.
func TestReconnectMidStreamLosesNothing(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	const n, workers = 400, 8
	ids := names("m", n)
	a.publish(q, ids...)
	src := openSource(t, q, WithPrefetch(32), WithReconnectBackoff(20*time.Millisecond, 200*time.Millisecond))
	var (
		seen      handled
		cancelled sync.Map
		// The handler decides when to start holding, not the test: a fast
		// consumer can handle every message between two polls of the test,
		// leaving none to hold.
		calls    atomic.Int32
		released atomic.Bool // set before the gate opens
		blocked  atomic.Int32
		gate     = make(chan struct{})
	)
	r := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if !released.Load() && calls.Add(1) > n/3 {
			blocked.Add(1)
			if num, _ := strconv.Atoi(m.ID[1:]); num%2 == 0 {
				<-gate // finishes after the reconnect, context or not
			} else {
				select {
				case <-gate:
				case <-ctx.Done():
					cancelled.Store(m.ID, context.Cause(ctx))
					return context.Cause(ctx)
				}
			}
		}
		seen.add(m.ID)
		return nil
	}), consumer.WithConcurrency(workers))
	waitUntil(t, "every worker in a handler", func() bool { return blocked.Load() >= workers })
	killConnection(t, src)
	waitGenerations(t, src, 2)
	released.Store(true)
	close(gate)
	waitUntil(t, "every message handled", func() bool { return seen.distinct() == n })
	r.stop(t)
	counts := seen.snapshot()
	dups := 0
	for _, id := range ids {
		switch c := counts[id]; {
		case c == 0:
			t.Errorf("message %s was never handled", id)
		case c > 1:
			dups += c - 1
		}
	}
	st := src.Stats()
	// The handlers that finish after the reconnect are not acked: the
	// runtime sees their deliveries lost and does not send what the adapter
	// would drop (an ack racing the loss still may be, as DroppedAcks).
	if st.Lost == 0 {
		t.Errorf("stats %+v: want deliveries lost with the channel", st)
	}
	// Only what the dead channel held (the prefetch window) can come twice.
	if dups > 32 {
		t.Errorf("%d duplicates, more than the prefetch window of the dead channel", dups)
	}
	ncancelled := 0
	cancelled.Range(func(k, v any) bool {
		ncancelled++
		if err, _ := v.(error); !errors.Is(err, adapters.ErrConnectionLost) {
			t.Errorf("handler of %v cancelled with %v, want ErrConnectionLost", k, v)
		}
		return true
	})
	if ncancelled == 0 {
		t.Error("no handler saw its context cancelled when the channel died")
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if left := a.ready(q); left != 0 {
		t.Fatalf("%d messages left on the queue after everything was handled", left)
	}
	t.Logf("%d handlers cancelled, %d duplicates; stats %+v", ncancelled, dups, st)
}

// After MaxAttempts the native mode rejects the poison message into the
// queue's dead-letter exchange (x-death on the copy); the messages around it
// are all handled once.
func TestNativeDeadLetterAfterMaxAttemptsUnderRuntime(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	q := uniqueName(t, "classic")
	t.Cleanup(func() { deleteQueues(q) })
	src := openSource(t, q, WithPrefetch(16), WithDeclare(ClassicQueue, amqp.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq,
	}))
	native, err := src.NativeDeadLetter()
	if err != nil {
		t.Fatal(err)
	}
	good := names("good", 20)
	a.publish(q, good[:10]...)
	a.publish(q, "poison")
	a.publish(q, good[10:]...)
	var seen handled
	r := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		seen.add(m.ID)
		if m.ID == "poison" {
			return errors.New("cannot handle poison")
		}
		return nil
	}), consumer.WithConcurrency(4), consumer.WithDeadLetter(native),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}))
	a.waitReady(dlq, 1)
	waitUntil(t, "good messages handled", func() bool { return seen.distinct() == len(good)+1 })
	r.stop(t)
	counts := seen.snapshot()
	if counts["poison"] != 3 {
		t.Errorf("poison handled %d times, want MaxAttempts=3", counts["poison"])
	}
	for _, id := range good {
		if counts[id] != 1 {
			t.Errorf("%s handled %d times, want 1", id, counts[id])
		}
	}
	m := a.drain(dlq)[0]
	if m.MessageId != "poison" || !strings.Contains(stringHeaders(m.Headers)["x-death"], `"reason":"rejected"`) {
		t.Fatalf("dead-lettered %q with x-death %s", m.MessageId, stringHeaders(m.Headers)["x-death"])
	}
	if st := src.Stats(); st.Generations != 1 {
		t.Fatalf("the channel was replaced (%+v): something settled a tag twice", st)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if left := a.ready(q); left != 0 {
		t.Fatalf("%d messages left on the source queue", left)
	}
}

// At shutdown the runtime acks what finished and gives back what did not:
// the unfinished messages are on the queue again, and only they.
func TestShutdownAcksFinishedAndGivesBackTheRest(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	ids := names("m", 8)
	a.publish(q, ids...)
	src := openSource(t, q, WithPrefetch(16))
	var (
		seen    handled
		started handled
	)
	slow := map[string]bool{"m2": true, "m5": true, "m7": true}
	r := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		started.add(m.ID)
		if slow[m.ID] {
			<-ctx.Done() // outlives the shutdown timeout
			return context.Cause(ctx)
		}
		seen.add(m.ID)
		return nil
	}), consumer.WithConcurrency(len(ids)), consumer.WithShutdownTimeout(300*time.Millisecond))
	waitUntil(t, "fast ones done and slow ones running", func() bool {
		return seen.distinct() == len(ids)-len(slow) && started.distinct() == len(ids)
	})
	r.stop(t)
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(q, len(slow))
	for _, m := range a.drain(q) {
		if !slow[m.MessageId] {
			t.Errorf("finished message %s came back", m.MessageId)
		}
	}
}

// W3C trace context published in AMQP headers becomes the parent of the
// runtime's processing span.
func TestTraceContextFromAMQPHeaders(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	const traceID = "0af7651916cd43dd8448eb211c80319c"
	a.publishMsg(q, amqp.Publishing{MessageId: "traced", Body: []byte("x"), Headers: amqp.Table{
		// Publishers send text headers as longstr; some send bytes.
		"traceparent": []byte("00-" + traceID + "-b7ad6b7169203331-01"),
	}})
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	src := openSource(t, q, WithPrefetch(8))
	var got atomic.Value
	r := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		got.Store(trace.SpanContextFromContext(ctx).TraceID().String())
		return nil
	}), consumer.WithTracerProvider(tp), consumer.WithPropagator(propagation.TraceContext{}))
	waitUntil(t, "the message handled", func() bool { return got.Load() != nil })
	r.stop(t)
	if id := got.Load().(string); id != traceID {
		t.Fatalf("handler span has trace id %s, want the published %s", id, traceID)
	}
}

// hiddenSettler passes dead letters to a destination and hides whether it
// settles the original, as a user's wrapper (logging, metrics) does.
type hiddenSettler struct{ dl adapters.DeadLetter }

func (h hiddenSettler) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	return h.dl.Send(ctx, d, f)
}

// Behind a wrapper that hides adapters.OriginalSettler, the runtime acks
// the original the native dead letter already rejected: that ack succeeds
// without effect, so nothing reports an ack failure (nor a redelivery to
// expect) for a message that left the queue.
func TestNativeDeadLetterBehindAWrapperUnderRuntime(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	q := uniqueName(t, "classic")
	t.Cleanup(func() { deleteQueues(q) })
	src := openSource(t, q, WithPrefetch(16), WithDeclare(ClassicQueue, amqp.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq,
	}))
	native, err := src.NativeDeadLetter()
	if err != nil {
		t.Fatal(err)
	}
	a.publish(q, "poison", "good")
	logs := &recordLog{}
	reader, mp := newMeter(t)
	var seen handled
	r := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		seen.add(m.ID)
		if m.ID == "poison" {
			return consumer.Permanent(errors.New("cannot handle poison"))
		}
		return nil
	}), consumer.WithDeadLetter(hiddenSettler{native}), consumer.WithLogger(slog.New(logs)), consumer.WithMeterProvider(mp))
	a.waitReady(dlq, 1)
	waitUntil(t, "both handled", func() bool { return seen.distinct() == 2 })
	r.stop(t)
	if failed := logs.with("ack failed"); len(failed) > 0 {
		t.Errorf("the runtime reports a failed ack:\n%s", strings.Join(failed, "\n"))
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != "custody.ack.failures" {
				continue
			}
			for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if p.Value != 0 {
					t.Errorf("custody.ack.failures = %d, want 0", p.Value)
				}
			}
		}
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	if left := a.ready(q); left != 0 {
		t.Fatalf("%d messages left on the source queue", left)
	}
	if m := a.drain(dlq); len(m) != 1 || m[0].MessageId != "poison" {
		t.Fatalf("dead-letter queue holds %d messages, want poison once", len(m))
	}
	if st := src.Stats(); st.Rejects != 1 || st.Generations != 1 {
		t.Fatalf("stats %+v: want one reject on one channel", st)
	}
}
