package rabbitmq

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// Backlog reports the queue's ready messages as the broker counts them,
// not those delivered and unacked; no unacked count (-1) and no age, which
// AMQP does not tell.
func TestBacklogIsTheBrokersReadyCount(t *testing.T) {
	for _, typ := range []QueueType{ClassicQueue, QuorumQueue} {
		t.Run(typ.String(), func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(typ, nil)
			a.publish(q, names("m", 10)...)
			s := openSource(t, q, WithPrefetch(3))
			held := receiveN(t, s, 3)
			waitUnacked(t, q, 3)
			b, err := s.Backlog(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if ready := queueInfo(t, q, "messages_ready"); b.Waiting != int64(ready) || ready != 7 {
				t.Errorf("Backlog().Waiting = %d; the broker counts %d ready (want 7: 10 less the 3 held)", b.Waiting, ready)
			}
			if b.InFlight != -1 || b.OldestAge != 0 {
				t.Errorf("Backlog() = %+v: want InFlight -1 and no age, which AMQP does not tell", b)
			}
			if err := s.Ack(context.Background(), held); err != nil {
				t.Fatal(err)
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := s.Backlog(context.Background()); !errors.Is(err, adapters.ErrClosed) {
				t.Errorf("Backlog after Close: %v, want ErrClosed", err)
			}
		})
	}
}

// A Backlog that cannot be asked while the Source reconnects says so.
func TestBacklogWhileReconnecting(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var refuse atomic.Bool
	s, err := New(context.Background(), q, refusingDial(&refuse), WithReconnectBackoff(10*time.Millisecond, 50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	refuse.Store(true)
	killConnection(t, s)
	waitUntil(t, "the Source to reconnect", func() bool { return s.Stats().Generations == 1 && s.Connection().LastError != nil })
	if _, err := s.Backlog(context.Background()); !errors.Is(err, adapters.ErrConnectionLost) {
		t.Fatalf("Backlog while reconnecting: %v, want ErrConnectionLost", err)
	}
	refuse.Store(false)
	waitGenerations(t, s, 2)
	if _, err := s.Backlog(context.Background()); err != nil {
		t.Fatalf("Backlog after the reconnection: %v", err)
	}
}

// gauge returns the value of the named int64 gauge, and whether it has a
// point.
func gauge(t *testing.T, r *sdkmetric.ManualReader, name string) (int64, bool) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := r.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			g, ok := m.Data.(metricdata.Gauge[int64])
			if !ok {
				t.Fatalf("%s is a %T, want an int64 gauge", name, m.Data)
			}
			if len(g.DataPoints) != 1 {
				t.Fatalf("%s has %d points, want 1", name, len(g.DataPoints))
			}
			p := g.DataPoints[0]
			if v, _ := p.Attributes.Value(attribute.Key("custody.consumer")); v.AsString() == "" {
				t.Errorf("%s point %v has no custody.consumer", name, p.Attributes.ToSlice())
			}
			return p.Value, true
		}
	}
	return 0, false
}

// Under the runtime, the backlog gauge and Status show the broker's own
// ready count while the consumer holds part of the queue, and follow it
// down to zero once everything is handled; no in-flight gauge, which
// RabbitMQ does not tell without its management API.
func TestBacklogGaugeMatchesTheBroker(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 12)...)
	s := openSource(t, q, WithPrefetch(4))
	reader, mp := newMeter(t)
	gate := make(chan struct{})
	var h handled
	r := runConsumer(t, s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
		h.add(m.ID)
		return nil
	}), consumer.WithConcurrency(2), consumer.WithBacklogInterval(time.Second), consumer.WithMeterProvider(mp))
	waitUnacked(t, q, 4)
	var st consumer.Status
	waitUntil(t, "a backlog poll with the window full", func() bool {
		st = r.c.Status()
		return !st.BacklogAt.IsZero() && st.Backlog.Waiting == 8
	})
	ready := queueInfo(t, q, "messages_ready")
	if ready != 8 || st.Backlog.InFlight != -1 {
		t.Fatalf("Status().Backlog = %+v; the broker counts %d ready (want 8: 12 less the 4 held)", st.Backlog, ready)
	}
	if v, ok := gauge(t, reader, "custody.backlog.waiting"); !ok || v != int64(ready) {
		t.Fatalf("custody.backlog.waiting = %d (reported: %v), want the broker's %d", v, ok, ready)
	}
	if _, ok := gauge(t, reader, "custody.backlog.in_flight"); ok {
		t.Error("custody.backlog.in_flight is reported; RabbitMQ does not tell it without the management API")
	}
	close(gate)
	waitUntil(t, "every message handled", func() bool { return h.distinct() == 12 })
	polled := st.BacklogAt
	waitUntil(t, "a backlog poll of the empty queue", func() bool {
		st = r.c.Status()
		return st.BacklogAt.After(polled) && st.Backlog.Waiting == 0
	})
	if v, ok := gauge(t, reader, "custody.backlog.waiting"); !ok || v != 0 {
		t.Fatalf("custody.backlog.waiting = %d (reported: %v) once the queue is empty, want 0", v, ok)
	}
	if ready := queueInfo(t, q, "messages_ready"); ready != 0 {
		t.Fatalf("the broker counts %d ready after every message was handled", ready)
	}
}
