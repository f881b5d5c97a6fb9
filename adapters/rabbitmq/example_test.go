package rabbitmq_test

import (
	"context"
	"log"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
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

// A look at the dead letters of orders.dlq, grouped by error, then a replay
// of those that failed on a timeout, 50 a second, back to the queue each
// came from.
func ExampleNewReplay() {
	ctx := context.Background()
	r, err := rabbitmq.NewReplay(ctx, "orders.dlq", rabbitmq.WithURL("amqp://guest:guest@127.0.0.1:5672/"))
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()
	recs, err := r.List(ctx, 1000) // a dry run: nothing leaves the queue
	if err != nil {
		log.Fatal(err)
	}
	for _, g := range adapters.GroupDeadLetters(recs) {
		log.Printf("%d × %q (consumer %s, %s)", g.Count, g.Error, g.Consumer, g.Hour.Format(time.RFC3339))
	}
	res, err := r.Replay(ctx, adapters.ReplayOptions{
		Select: func(d adapters.DeadLetterRecord) bool { return strings.Contains(d.Error, "timeout") },
		Rate:   50,
	})
	log.Printf("replayed %d, left %d: %v", res.Replayed, res.Skipped, err)
}
