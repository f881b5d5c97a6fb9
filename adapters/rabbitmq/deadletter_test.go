package rabbitmq

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

func openSink(t *testing.T, exchange, key string) *DeadLetterExchange {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	x, err := NewDeadLetterExchange(ctx, exchange, key, WithURL(brokerURL))
	if err != nil {
		t.Fatalf("NewDeadLetterExchange: %v", err)
	}
	t.Cleanup(func() { x.Close() })
	return x
}

// The sink publishes the original body and properties with the shared
// diagnostics and the original route, confirmed, and persistent.
func TestDeadLetterExchangeWritesDiagnostics(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	a.publishMsg(q, amqp.Publishing{
		MessageId: "id-7", Body: []byte("poison"), ContentType: "application/json",
		Expiration: "60000", Headers: amqp.Table{"tenant": "acme"},
		Timestamp: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
	})
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, "", dlq)
	d := receiveN(t, s, 1)[0]
	first := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	f := adapters.Failure{Err: errors.New("cannot parse order"), Permanent: true, Attempts: 3,
		FirstFailure: first, LastFailure: first.Add(time.Minute), Consumer: "orders-service"}
	if err := x.Send(context.Background(), d, f); err != nil {
		t.Fatal(err)
	}
	got := a.drain(dlq)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
	m := got[0]
	if string(m.Body) != "poison" || m.MessageId != "id-7" || m.ContentType != "application/json" || m.DeliveryMode != amqp.Persistent {
		t.Fatalf("copy lost the original: body %q id %q type %q mode %d", m.Body, m.MessageId, m.ContentType, m.DeliveryMode)
	}
	if m.Expiration != "" {
		t.Fatalf("copy carries expiration %q: it could expire in the dead-letter queue", m.Expiration)
	}
	h := stringHeaders(m.Headers)
	want := map[string]string{
		"tenant":                     "acme",
		adapters.HeaderError:         "cannot parse order",
		adapters.HeaderPermanent:     "true",
		adapters.HeaderAttempts:      "3",
		adapters.HeaderFirstFailure:  "2026-11-01T10:00:00Z",
		adapters.HeaderLastFailure:   "2026-11-01T10:01:00Z",
		adapters.HeaderOriginalQueue: q,
		adapters.HeaderOriginalID:    "id-7",
		adapters.HeaderOriginalTime:  "2026-01-02T03:04:05Z",
		adapters.HeaderConsumer:      "orders-service",
		HeaderOriginalExchange:       "",
		HeaderOriginalRoutingKey:     q,
		HeaderOriginalExpiration:     "60000",
	}
	for k, v := range want {
		if got, ok := h[k]; !ok || got != v {
			t.Errorf("header %s = %q (present %v), want %q", k, got, ok, v)
		}
	}
}

// A dead letter the broker cannot route is an error, so the runtime keeps
// the original instead of acking it into nowhere.
func TestDeadLetterExchangeUnroutableFails(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	ex := uniqueName(t, "ex")
	if err := a.ch.ExchangeDeclare(ex, "direct", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.ch.ExchangeDelete(ex, false, false) })
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, ex, "nobody-binds-this")
	d := receiveN(t, s, 1)[0]
	err := x.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1})
	if !errors.Is(err, errUnroutable) {
		t.Fatalf("Send to an unbound exchange returned %v, want an unroutable error", err)
	}
	// The sink recovers for the next message.
	dlq := a.queue(ClassicQueue, nil)
	if err := a.ch.QueueBind(dlq, "nobody-binds-this", ex, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := x.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(dlq); n != 1 {
		t.Fatalf("dead-letter queue holds %d", n)
	}
}

func TestNewDeadLetterExchangeChecks(t *testing.T) {
	newAdmin(t)
	ctx := context.Background()
	if _, err := NewDeadLetterExchange(ctx, "custody-no-such-exchange", "k", WithURL(brokerURL)); err == nil || !strings.Contains(err.Error(), "custody-no-such-exchange") {
		t.Fatalf("missing exchange: %v", err)
	}
	if _, err := NewDeadLetterExchange(ctx, "", "custody-no-such-queue", WithURL(brokerURL)); err == nil || !strings.Contains(err.Error(), "custody-no-such-queue") {
		t.Fatalf("missing queue: %v", err)
	}
	if _, err := NewDeadLetterExchange(ctx, "", "q", WithURL(brokerURL), WithPrefetch(10)); err == nil || !strings.Contains(err.Error(), "WithPrefetch") {
		t.Fatalf("source option on a sink: %v", err)
	}
}

// Native mode rejects into the queue's own dead-letter exchange; the broker
// adds x-death, and the delivery is marked settled so the runtime does not
// ack it.
func TestNativeDeadLetterRejectsIntoQueueDLX(t *testing.T) {
	for _, typ := range []QueueType{ClassicQueue, QuorumQueue} {
		t.Run(typ.String(), func(t *testing.T) {
			a := newAdmin(t)
			dlq := a.queue(ClassicQueue, nil)
			q := uniqueName(t, typ.String())
			t.Cleanup(func() { deleteQueues(q) })
			s := openSource(t, q, WithPrefetch(10), WithDeclare(typ, amqp.Table{
				"x-dead-letter-exchange":    "",
				"x-dead-letter-routing-key": dlq,
			}))
			a.publish(q, "poison", "fine")
			dl, err := s.NativeDeadLetter()
			if err != nil {
				t.Fatal(err)
			}
			ds := receiveN(t, s, 2)
			if err := dl.Send(context.Background(), ds[0], adapters.Failure{Err: errors.New("bad"), Attempts: 5}); err != nil {
				t.Fatal(err)
			}
			if !ds[0].Settled() {
				t.Fatal("native dead letter did not mark the delivery settled")
			}
			if err := s.Ack(context.Background(), ds[1:]); err != nil {
				t.Fatal(err)
			}
			a.waitReady(dlq, 1)
			m := a.drain(dlq)[0]
			if string(m.Body) != "poison" {
				t.Fatalf("dead-lettered %q", m.Body)
			}
			xd := stringHeaders(m.Headers)["x-death"]
			if !strings.Contains(xd, `"reason":"rejected"`) || !strings.Contains(xd, q) {
				t.Fatalf("x-death %s does not say it was rejected from %s", xd, q)
			}
			waitUnacked(t, q, 0)
			if n := a.ready(q); n != 0 {
				t.Fatalf("%d left on the source queue", n)
			}
		})
	}
}

func TestNativeDeadLetterNeedsADeadLetterExchange(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	s := openSource(t, q)
	if _, err := s.NativeDeadLetter(); err == nil || !strings.Contains(err.Error(), "x-dead-letter-exchange") {
		t.Fatalf("NativeDeadLetter on a queue without a known DLX: %v", err)
	}
	s2 := openSource(t, q, WithDeadLetterByPolicy())
	if _, err := s2.NativeDeadLetter(); err != nil {
		t.Fatal(err)
	}
}

// TestDeadLetterRefusedByTheBrokerFails: a dead-letter publish the broker
// refuses (basic.nack: here a full queue with reject-publish overflow) is not
// a confirmed write; Send must fail so the runtime keeps the original.
func TestDeadLetterRefusedByTheBrokerFails(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"})
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, "", dlq)
	d := receiveN(t, s, 1)[0]
	err := x.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 3})
	if err == nil {
		t.Fatal("Send returned nil although the broker refused the dead-letter copy; the original would be acked and lost")
	}
}
