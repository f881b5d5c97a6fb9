package rabbitmq

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/adapters"
)

// newMeter returns a meter provider whose metrics the reader collects, shut
// down with the test.
func newMeter(t *testing.T) (*sdkmetric.ManualReader, *sdkmetric.MeterProvider) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	return reader, mp
}

// metricSums returns, for the named counter, its value by the value of
// attribute key ("" for all points together), and checks that every point
// carries messaging.destination.name dest.
func metricSums(t *testing.T, r *sdkmetric.ManualReader, name, key, dest string) map[string]int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			sum, ok := m.Data.(metricdata.Sum[int64])
			if !ok {
				t.Fatalf("%s is a %T, want a counter", name, m.Data)
			}
			for _, p := range sum.DataPoints {
				if v, _ := p.Attributes.Value("messaging.destination.name"); v.AsString() != dest {
					t.Errorf("%s point %v: want messaging.destination.name %q", name, p.Attributes.ToSlice(), dest)
				}
				v, _ := p.Attributes.Value(attribute.Key(key))
				out[v.Emit()] += p.Value
			}
		}
	}
	return out
}

// The Source reports what it writes and what it loses: a multiple ack and a
// single one, a requeue, a retry's copy through a delay queue, and after a
// lost connection, the deliveries lost, the reconnection and the acks that
// arrive too late.
func TestSourceTelemetry(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 6)...)
	reader, mp := newMeter(t)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(), WithMeterProvider(mp),
		WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	ctx := context.Background()
	ds := receiveN(t, s, 6)
	if err := s.Ack(ctx, ds[:3]); err != nil { // one multiple ack
		t.Fatal(err)
	}
	if err := s.Ack(ctx, ds[4:5]); err != nil { // behind m4: a single ack
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[3:4], 0)); err != nil { // requeued
		t.Fatal(err)
	}
	if err := s.Nack(ctx, adapters.NackAll(ds[5:6], 100*time.Millisecond)); err != nil { // a copy to a delay queue
		t.Fatal(err)
	}
	back := receiveN(t, s, 2)
	killConnection(t, s)
	waitGenerations(t, s, 2)
	if err := s.Ack(ctx, back); err == nil {
		t.Fatal("Ack of deliveries of a dead channel succeeded")
	}

	// m1-m3 in one frame; m5, and m6 retired by its copy, one each.
	if got := metricSums(t, reader, "custody.rabbitmq.acked", "", q)[""]; got != 5 {
		t.Errorf("acked %d, want 5", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.ack.frames", "rabbitmq.multiple", q); got["true"] != 1 || got["false"] != 2 {
		t.Errorf("ack frames by multiple %v, want one multiple and two single", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.rejects", "rabbitmq.requeue", q); got["true"] != 1 || len(got) != 1 {
		t.Errorf("rejects by requeue %v, want one requeue", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.publishes", "custody.rabbitmq.copy", q); got[copyDelayQueue] != 1 || len(got) != 1 {
		t.Errorf("publishes by copy %v, want one to a delay queue", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.deliveries.lost", "", q)[""]; got != 2 {
		t.Errorf("deliveries lost %d, want the 2 held when the connection closed", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.reconnects", "", q)[""]; got != 1 {
		t.Errorf("reconnects %d, want 1", got)
	}
	if got := metricSums(t, reader, "custody.rabbitmq.acks.dropped", "", q)[""]; got != 2 {
		t.Errorf("acks dropped %d, want the 2 late ones", got)
	}
}

// The sink reports its copies, confirmed or not, under its exchange.
func TestDeadLetterTelemetry(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	ex := a.exchangeTo(q, "bound")
	reader, mp := newMeter(t)
	ctx := context.Background()
	d := &adapters.Delivery{ID: "f-1", Body: []byte("b"), Queue: "kafka/orders", Partition: 0, Offset: 1}
	for _, key := range []string{"bound", "unbound"} {
		x, err := NewDeadLetter(ctx, ex, key, WithURL(brokerURL), WithMeterProvider(mp))
		if err != nil {
			t.Fatal(err)
		}
		err = x.Send(ctx, d, foreignFailure())
		x.Close()
		if (err == nil) != (key == "bound") {
			t.Fatalf("Send with routing key %s: %v", key, err)
		}
	}
	if got := metricSums(t, reader, "custody.rabbitmq.publishes", "error", ex); got["false"] != 1 || got["true"] != 1 {
		t.Errorf("dead-letter publishes by error %v, want one confirmed and one not", got)
	}
}

// recordHandler records the messages of the records it handles.
type recordHandler struct{ msgs chan string }

func (h recordHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h recordHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h recordHandler) WithGroup(string) slog.Handler            { return h }
func (h recordHandler) Handle(_ context.Context, r slog.Record) error {
	select {
	case h.msgs <- r.Message:
	default:
	}
	return nil
}

// Without WithLogger the Source logs where the consumer does by default:
// slog.Default().
func TestLoggerDefaultsToSlogDefault(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	rec := recordHandler{msgs: make(chan string, 64)}
	was := slog.Default()
	slog.SetDefault(slog.New(rec))
	t.Cleanup(func() { slog.SetDefault(was) })
	s := openSource(t, q, WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	killConnection(t, s)
	waitGenerations(t, s, 2)
	deadline := time.After(30 * time.Second)
	for {
		select {
		case m := <-rec.msgs:
			if m == "rabbitmq: lost the channel; reconnecting" {
				return
			}
		case <-deadline:
			t.Fatal("the lost channel was not logged to slog.Default()")
		}
	}
}
