package rabbitmq_test

import (
	"context"
	"log"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters/rabbitmq"
	"github.com/custody-go/custody/consumer"
)

// A quorum queue consumed at concurrency 64, with failed messages
// dead-lettered through publisher confirms to the queue orders.dlq, which
// the sink declares (with the default exchange, the routing key names it).
func ExampleNew() {
	ctx := context.Background()
	url := "amqp://guest:guest@127.0.0.1:5672/"
	src, err := rabbitmq.New(ctx, "orders",
		rabbitmq.WithURL(url),
		rabbitmq.WithPrefetch(128), // at least the concurrency
		rabbitmq.WithDeclare(rabbitmq.QuorumQueue, amqp.Table{"x-delivery-limit": int64(20)}))
	if err != nil {
		log.Fatal(err)
	}
	dlq, err := rabbitmq.NewDeadLetter(ctx, "", "orders.dlq", rabbitmq.WithURL(url),
		rabbitmq.WithDeclareDeadLetter("", rabbitmq.QuorumQueue, nil))
	if err != nil {
		log.Fatal(err)
	}
	defer dlq.Close()
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var d amqp.Delivery
		if m.As(&d) {
			log.Printf("order %s from exchange %q, attempt %d", m.ID, d.Exchange, m.Attempt)
		}
		return nil
	}),
		consumer.WithConcurrency(64),
		consumer.WithDeadLetter(dlq),
		consumer.WithShutdownTimeout(30*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil { // blocks until ctx is cancelled; closes src
		log.Fatal(err)
	}
}

// The native mode: rejected messages go to the queue's own dead-letter
// exchange, which the broker marks with x-death.
func ExampleSource_NativeDeadLetter() {
	ctx := context.Background()
	src, err := rabbitmq.New(ctx, "payments", rabbitmq.WithDeclare(rabbitmq.ClassicQueue, amqp.Table{
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": "payments.dlq",
	}))
	if err != nil {
		log.Fatal(err)
	}
	dl, err := src.NativeDeadLetter()
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return nil
	}), consumer.WithDeadLetter(dl))
	if err != nil {
		log.Fatal(err)
	}
	_ = c.Run(ctx)
}
