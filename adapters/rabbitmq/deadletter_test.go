package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

func openSink(t *testing.T, exchange, key string) *DeadLetter {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	x, err := NewDeadLetter(ctx, exchange, key, WithURL(brokerURL))
	if err != nil {
		t.Fatalf("NewDeadLetter: %v", err)
	}
	t.Cleanup(func() { x.Close() })
	return x
}

// The sink publishes the original body and properties with the shared
// diagnostics and the original route, confirmed, and persistent.
func TestDeadLetterWritesDiagnostics(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	a.publishMsg(q, amqp.Publishing{
		MessageId: "id-7", Body: []byte("poison"), ContentType: "application/json",
		Expiration: "60000", Headers: amqp.Table{"tenant": "acme", HeaderAttempt: int64(3)},
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
	if v, ok := h[HeaderAttempt]; ok {
		// Replayed into its queue, the copy would start at attempt 3 and
		// be dead-lettered again after one failure.
		t.Errorf("copy carries the retry counter %s = %q", HeaderAttempt, v)
	}
}

// A dead letter the broker cannot route is an error, so the runtime keeps
// the original instead of acking it into nowhere.
func TestDeadLetterUnroutableFails(t *testing.T) {
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

func TestNewDeadLetterChecks(t *testing.T) {
	newAdmin(t)
	ctx := context.Background()
	// A wrong name fails here, saying what to do, rather than at the first
	// poison message, which would then be retried for ever.
	if _, err := NewDeadLetter(ctx, "custody-no-such-exchange", "k", WithURL(brokerURL)); err == nil || !strings.Contains(err.Error(), "custody-no-such-exchange") || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("missing exchange: %v", err)
	}
	if _, err := NewDeadLetter(ctx, "", "custody-no-such-queue", WithURL(brokerURL)); err == nil || !strings.Contains(err.Error(), "custody-no-such-queue") || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("missing queue: %v", err)
	}
	if _, err := NewDeadLetter(ctx, "", "q1", WithURL(brokerURL), WithDeclareDeadLetter("q2", ClassicQueue, nil)); err == nil || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("declared queue other than the default exchange's routing key: %v", err)
	}
	if _, err := NewDeadLetter(ctx, "x", "k", WithURL(brokerURL), WithDeclareDeadLetter("", ClassicQueue, nil)); err == nil || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("no queue to bind to a named exchange: %v", err)
	}
	if _, err := NewDeadLetter(ctx, "x", "k", WithURL(brokerURL), WithDeclareDeadLetter("q", QuorumQueue, amqp.Table{"x-queue-type": "classic"})); err == nil || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("contradicting queue type: %v", err)
	}
	if _, err := New(ctx, "q", WithURL(brokerURL), WithDeclareDeadLetter("q.dlq", ClassicQueue, nil)); err == nil || !strings.Contains(err.Error(), "WithDeclareDeadLetter") {
		t.Fatalf("sink option on a Source: %v", err)
	}
	if _, err := NewDeadLetter(ctx, "", "q", WithURL(brokerURL), WithPrefetch(10)); err == nil || !strings.Contains(err.Error(), "WithPrefetch") {
		t.Fatalf("source option on a sink: %v", err)
	}
}

// WithDeclareDeadLetter declares the exchange (unless it exists, of any
// type, or is the default one), the queue and the binding, so a new user
// needs no raw amqp091 to set up a dead-letter queue; and declares them
// again after a copy came back unroutable (the queue was deleted), so the
// next Send stores it.
func TestDeadLetterDeclaresItsDestination(t *testing.T) {
	for _, tc := range []struct {
		name     string
		exchange string // "new": a fresh name; "topic": an existing topic exchange
		typ      QueueType
	}{
		{"new exchange, quorum queue", "new", QuorumQueue},
		{"existing topic exchange", "topic", ClassicQueue},
		{"default exchange", "", ClassicQueue},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(ClassicQueue, nil)
			dlq := uniqueName(t, "dlq")
			t.Cleanup(func() { deleteQueues(dlq) })
			ex, key := "", dlq
			switch tc.exchange {
			case "new":
				ex, key = uniqueName(t, "dlx"), "poison"
			case "topic":
				ex, key = uniqueName(t, "dlx"), "orders.poison"
				if err := a.ch.ExchangeDeclare(ex, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
					t.Fatal(err)
				}
			}
			if ex != "" {
				t.Cleanup(func() { deleteExchange(ex) })
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			x, err := NewDeadLetter(ctx, ex, key, WithURL(brokerURL), WithDeclareDeadLetter(dlq, tc.typ, nil))
			if err != nil {
				t.Fatal(err)
			}
			defer x.Close()
			a.publish(q, "m1", "m2")
			s := openSource(t, q, WithPrefetch(10))
			ds := receiveN(t, s, 2)
			f := adapters.Failure{Err: errors.New("boom"), Attempts: 1}
			if err := x.Send(ctx, ds[0], f); err != nil {
				t.Fatal(err)
			}
			if n := a.ready(dlq); n != 1 {
				t.Fatalf("dead-letter queue holds %d, want 1", n)
			}
			if _, err := a.ch.QueueDelete(dlq, false, false, false); err != nil {
				t.Fatal(err)
			}
			if err := x.Send(ctx, ds[1], f); !errors.Is(err, errUnroutable) {
				t.Fatalf("Send with the dead-letter queue deleted returned %v, want it unroutable", err)
			}
			if err := x.Send(ctx, ds[1], f); err != nil {
				t.Fatalf("Send after the unroutable one did not declare the queue again: %v", err)
			}
			if n := a.ready(dlq); n != 1 {
				t.Fatalf("dead-letter queue declared again holds %d, want 1", n)
			}
		})
	}
}

// deleteExchange deletes exchange on a connection of its own.
func deleteExchange(exchange string) {
	conn, err := amqp.Dial(brokerURL)
	if err != nil {
		return
	}
	defer conn.Close()
	if ch, err := conn.Channel(); err == nil {
		_ = ch.ExchangeDelete(exchange, false, false)
	}
}

// Native mode rejects into the queue's own dead-letter exchange; the broker
// adds x-death, and the destination says it settles the original so the
// runtime does not ack it. An Ack or a Nack of it all the same (a wrapper
// around the destination hides that) succeeds and sends nothing: a second
// frame for the tag would close the channel.
func TestNativeDeadLetterRejectsIntoQueueDLX(t *testing.T) {
	for _, v := range []struct {
		typ   QueueType
		delay bool // with delay queues, where a Nack with a delay publishes a copy
	}{{ClassicQueue, false}, {QuorumQueue, false}, {QuorumQueue, true}} {
		name := v.typ.String()
		if v.delay {
			name += "-delay-queues"
		}
		t.Run(name, func(t *testing.T) {
			typ := v.typ
			a := newAdmin(t)
			dlq := a.queue(ClassicQueue, nil)
			q := uniqueName(t, typ.String())
			t.Cleanup(func() { deleteQueues(q) })
			opts := []Option{WithPrefetch(10), WithDeclare(typ, amqp.Table{
				"x-dead-letter-exchange":    "",
				"x-dead-letter-routing-key": dlq,
			})}
			if v.delay {
				opts = append(opts, WithDelayQueues())
			}
			s := openSource(t, q, opts...)
			a.publish(q, "poison", "fine")
			dl, err := s.NativeDeadLetter()
			if err != nil {
				t.Fatal(err)
			}
			ds := receiveN(t, s, 2)
			if err := dl.Send(context.Background(), ds[0], adapters.Failure{Err: errors.New("bad"), Attempts: 5}); err != nil {
				t.Fatal(err)
			}
			if os, ok := dl.(adapters.OriginalSettler); !ok || !os.SettlesOriginal(ds[0]) {
				t.Fatal("the native dead letter does not say it settles the original")
			}
			ctx := context.Background()
			if err := s.Ack(ctx, ds[:1]); err != nil {
				t.Fatalf("Ack after the native dead letter: %v, want nil", err)
			}
			if err := s.Nack(ctx, adapters.NackAll(ds[:1], 0)); err != nil {
				t.Fatalf("Nack after the native dead letter: %v, want nil", err)
			}
			if err := s.Nack(ctx, adapters.NackAll(ds[:1], time.Second)); err != nil {
				t.Fatalf("Nack with a delay after the native dead letter: %v, want nil", err)
			}
			if err := s.Ack(ctx, ds[1:]); err != nil {
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
			if st := s.Stats(); st.Generations != 1 || st.Rejects != 1 || st.Acked != 1 || st.DelayQueued != 0 || st.RetriedAtOnce != 0 {
				t.Fatalf("stats %+v: want one reject and one ack on one channel, no retry copy", st)
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

// Sender-selected distribution: the broker also routes a message published
// with a CC header to the queues it names. A retry's copy or a dead letter
// still carrying it would land there once more each time; the adapter keeps
// the header aside instead.
func TestCopiesDoNotRouteByCCAgain(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	other := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	a.publishMsg(q, amqp.Publishing{MessageId: "m1", Body: []byte("m1"), Headers: amqp.Table{"CC": []any{other}}})
	if n := a.ready(other); n != 1 {
		t.Fatalf("the broker routed %d copies by CC, want 1", n)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	x := openSink(t, "", dlq)
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	if d.Attempt != 2 || d.Headers[HeaderOriginalCC] == "" {
		t.Fatalf("retry copy: attempt %d, headers %v; want attempt 2 and the CC header kept aside", d.Attempt, d.Headers)
	}
	if err := x.Send(ctx, d, adapters.Failure{Err: errors.New("boom"), Attempts: 2}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	if n := a.ready(other); n != 1 {
		t.Fatalf("queue %s named by CC holds %d copies after a retry and a dead letter, want the original 1", other, n)
	}
	if got := a.drain(dlq); len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
}

// A dead letter from another adapter may carry a header named CC or BCC as
// text (an e-mail field, say). RabbitMQ refuses a publish whose CC or BCC
// header is not an array, so Send would fail every time and the message
// would never leave its stream; the sink keeps such headers aside.
func TestDeadLetterKeepsForeignCCHeaderAside(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	x := openSink(t, "", dlq)
	d := &adapters.Delivery{ID: "k-1", Body: []byte("b"), Queue: "orders", Partition: 3, Offset: 7,
		Headers: map[string]string{"CC": "boss@example.com", "BCC": "audit@example.com", "tenant": "acme"}}
	if err := x.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1}); err != nil {
		t.Fatalf("Send of a delivery with a text CC header: %v", err)
	}
	got := a.drain(dlq)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
	h := stringHeaders(got[0].Headers)
	if h[HeaderOriginalCC] != "boss@example.com" || h[HeaderOriginalBCC] != "audit@example.com" || h["tenant"] != "acme" {
		t.Fatalf("dead letter headers %v: want CC and BCC kept aside and the rest unchanged", h)
	}
	if _, ok := got[0].Headers["CC"]; ok {
		t.Fatalf("dead letter still carries CC: %v", h)
	}
}

// tempUser creates a broker user allowed everything on the default vhost,
// deletes it when the test ends, and returns its name and URL.
func tempUser(t *testing.T) (name, url string) {
	t.Helper()
	name = uniqueName(t, "user")
	const pass = "custody-test"
	if out, err := exec.Command("rabbitmqctl", "add_user", name, pass).CombinedOutput(); err != nil {
		testbroker.Unavailable(t, "rabbitmqctl (to add a user)", fmt.Errorf("%v: %s", err, out))
	}
	t.Cleanup(func() { _ = exec.Command("rabbitmqctl", "delete_user", name).Run() })
	if out, err := exec.Command("rabbitmqctl", "set_permissions", "-p", "/", name, ".*", ".*", ".*").CombinedOutput(); err != nil {
		t.Fatalf("rabbitmqctl set_permissions: %v: %s", err, out)
	}
	return name, "amqp://" + name + ":" + pass + "@" + brokerAddr + "/"
}

// RabbitMQ refuses a publish whose user-id property is not the publishing
// connection's user. A message another user published with its user-id
// must still be retried and dead-lettered: its copies keep the user-id aside
// in a header. A user-id that is the adapter's own user stays on the copy.
func TestCopiesOfAnotherUsersMessage(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	user, url := tempUser(t)
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirm("", q, true, false, amqp.Publishing{MessageId: "theirs", UserId: user, Body: []byte("theirs")})
	if err != nil || !dc.Wait() {
		t.Fatalf("publish as %s: %v", user, err)
	}
	a.publishMsg(q, amqp.Publishing{MessageId: "ours", UserId: "guest", Body: []byte("ours")})

	s := openSource(t, q, WithPrefetch(10), WithDelayQueues()) // as guest
	x := openSink(t, "", dlq)                                  // as guest
	ctx := context.Background()
	ds := receiveN(t, s, 2)
	if err := s.Nack(ctx, adapters.NackAll(ds, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	again := receiveN(t, s, 2)
	if st := s.Stats(); st.DelayQueued != 2 || st.RetryFailures != 0 {
		t.Fatalf("stats %+v: want both retries republished, none refused", st)
	}
	for _, d := range again {
		var m amqp.Delivery
		if !d.As(&m) || d.Attempt != 2 {
			t.Fatalf("retry of %s: attempt %d", d.ID, d.Attempt)
		}
		switch d.ID {
		case "theirs":
			if m.UserId != "" || d.Headers[HeaderOriginalUserID] != user {
				t.Fatalf("copy of another user's message: user-id %q, %s %q", m.UserId, HeaderOriginalUserID, d.Headers[HeaderOriginalUserID])
			}
			if err := x.Send(ctx, d, adapters.Failure{Err: errors.New("boom"), Attempts: 2}); err != nil {
				t.Fatalf("dead letter of another user's message: %v", err)
			}
		case "ours":
			if m.UserId != "guest" || d.Headers[HeaderOriginalUserID] != "" {
				t.Fatalf("copy of our own message: user-id %q, %s %q", m.UserId, HeaderOriginalUserID, d.Headers[HeaderOriginalUserID])
			}
		}
	}
	if err := s.Ack(ctx, again); err != nil {
		t.Fatal(err)
	}
	got := a.drain(dlq)
	if len(got) != 1 || got[0].UserId != "" || stringHeaders(got[0].Headers)[HeaderOriginalUserID] != user {
		t.Fatalf("dead-letter queue holds %d messages, want the one with the user-id kept aside", len(got))
	}
	waitUnacked(t, q, 0)
}

// A dead-letter publish the broker refuses by closing the channel (here: the
// exchange was deleted) is reported with the broker's reason, not as an
// unroutable message: amqp091 closes the return channel with the channel,
// and a receive from a closed channel is not a basic.return.
func TestDeadLetterReportsWhyThePublishWasRefused(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	ex := uniqueName(t, "ex")
	if err := a.ch.ExchangeDeclare(ex, "direct", false, true, false, false, nil); err != nil {
		t.Fatal(err)
	}
	a.publish(q, "m1")
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, ex, "k")
	if err := a.ch.ExchangeDelete(ex, false, false); err != nil {
		t.Fatal(err)
	}
	d := receiveN(t, s, 1)[0]
	err := x.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1})
	if err == nil || errors.Is(err, errUnroutable) || !strings.Contains(err.Error(), "NOT_FOUND") {
		t.Fatalf("Send to a deleted exchange returned %v, want the broker's NOT_FOUND reason", err)
	}
}
