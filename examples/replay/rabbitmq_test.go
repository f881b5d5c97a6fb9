package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/rabbitmq"
	"github.com/custody-go/custody/internal/testkit/testbroker"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The RabbitMQ mode against the local broker: five dead letters written by
// the runtime through a DeadLetter sink, listed by error, and the outage's
// three replayed to their queue.
func TestRabbitMQ(t *testing.T) {
	addr := testbroker.Addr("CUSTODY_RABBITMQ_ADDR", "127.0.0.1:5672")
	url := "amqp://guest:guest@" + addr + "/"
	testbroker.Dial(t, "RabbitMQ", addr)
	conn, err := amqp.Dial(url)
	if err != nil {
		testbroker.Unavailable(t, "RabbitMQ at "+addr, err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	q := "custody-test-examples-replay-" + hex.EncodeToString(b[:])
	dlq := q + ".dlq"
	for _, name := range []string{q, dlq} {
		if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ch.QueueDelete(name, false, false, false) })
	}
	count := func(name string) int {
		t.Helper()
		info, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return info.Messages
	}
	for i := range 5 {
		if err := ch.Publish("", q, false, false, amqp.Publishing{MessageId: fmt.Sprint("order-", i), Body: []byte(fmt.Sprint(i)), DeliveryMode: amqp.Persistent}); err != nil {
			t.Fatal(err)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src, err := rabbitmq.New(ctx, q, rabbitmq.WithURL(url), rabbitmq.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	sink, err := rabbitmq.NewDeadLetter(ctx, "", dlq, rabbitmq.WithURL(url))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	deadLetterOrders(t, ctx, src, sink, func() bool { return count(dlq) >= 5 })

	out, err := runWith(t, "-broker", "rabbitmq", "-url", url, "-dlq", dlq, "-list", "-error", "unavailable")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"5 dead letters in RabbitMQ queue " + dlq, "3      3 ", "2      0 ", "orders", "payment service unavailable", "invalid order"} {
		if !strings.Contains(out, want) {
			t.Errorf("-list output lacks %q", want)
		}
	}
	if n, m := count(q), count(dlq); n != 0 || m != 5 {
		t.Fatalf("after -list the queue holds %d and the dead-letter queue %d; want 0 and 5", n, m)
	}

	out, err = runWith(t, "-broker", "rabbitmq", "-url", url, "-dlq", dlq, "-replay", "-error", "unavailable", "-rate", "50")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "replayed 3, skipped 2") {
		t.Errorf("-replay output lacks the counts")
	}
	if n, m := count(q), count(dlq); n != 3 || m != 2 {
		t.Fatalf("after the replay the queue holds %d and the dead-letter queue %d; want 3 and 2", n, m)
	}
	for range 3 {
		m, ok, err := ch.Get(q, true)
		if err != nil || !ok {
			t.Fatalf("get: %v %v", ok, err)
		}
		if string(m.Body) >= "3" || m.Headers[adapters.HeaderReplayOf] == nil || m.Headers[adapters.HeaderError] != nil {
			t.Errorf("replayed %q (message-id %s) with headers %v", m.Body, m.MessageId, m.Headers)
		}
	}
}
