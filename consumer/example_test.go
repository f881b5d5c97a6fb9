package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// A consumer on the embedded memory broker: decode, apply, and let the
// runtime ack, retry or dead-letter.
func Example() {
	ctx := context.Background()
	broker := memory.NewBroker()
	_ = broker.CreateQueue("payments-dlq", memory.QueueOptions{})
	_ = broker.CreateQueue("payments", memory.QueueOptions{Lease: 30 * time.Second})
	_ = broker.Publish(ctx, "payments",
		memory.Message{Body: []byte(`{"amount": 42}`)},
		memory.Message{Body: []byte(`not json`)},
	)

	src, _ := broker.Source("payments", memory.WithPollWait(10*time.Millisecond))
	dlq, _ := broker.DeadLetterQueue("payments-dlq")
	applied := make(chan int, 1)
	c, err := consumer.New(src,
		consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			var p struct{ Amount int }
			if err := json.Unmarshal(m.Body, &p); err != nil {
				return consumer.Permanent(err) // straight to the dead-letter queue
			}
			applied <- p.Amount // the effect; returning nil acks the message
			return nil
		}),
		consumer.WithConcurrency(8),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- c.Run(runCtx) }()

	fmt.Println("applied", <-applied)
	for {
		if s, _ := broker.Stats("payments-dlq"); s.Visible == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	stop()
	fmt.Println("run:", <-done)
	dead, _ := broker.Messages("payments-dlq")
	fmt.Printf("dead-lettered %q: permanent=%s\n", dead[0].Body, dead[0].Headers["custody-permanent"])
	// Output:
	// applied 42
	// run: <nil>
	// dead-lettered "not json": permanent=true
}

// Middleware wraps every attempt; Chain puts the first one outermost.
func ExampleChain() {
	logging := func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			err := next.Handle(ctx, m)
			fmt.Printf("message %s attempt %d: %v\n", m.ID, m.Attempt, err)
			return err
		})
	}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), logging)
	_ = h.Handle(context.Background(), &consumer.Message{ID: "m1", Attempt: 1})
	// Output: message m1 attempt 1: <nil>
}

// Shutdown drains: it stops receiving, lets running handlers finish (for as
// long as its context allows), acks them and waits for Run to return.
// Services call it from their own shutdown path, such as on SIGTERM.
func ExampleConsumer_Shutdown() {
	ctx := context.Background()
	broker := memory.NewBroker()
	_ = broker.CreateQueue("emails", memory.QueueOptions{})
	_ = broker.Publish(ctx, "emails", memory.Message{Body: []byte("welcome")})
	src, _ := broker.Source("emails", memory.WithPollWait(10*time.Millisecond))

	sending := make(chan struct{})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		close(sending)
		time.Sleep(20 * time.Millisecond) // the effect, still running when Shutdown begins
		return nil
	}))
	if err != nil {
		fmt.Println(err)
		return
	}
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()

	<-sending
	shutdownCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	fmt.Println("shutdown:", c.Shutdown(shutdownCtx))
	fmt.Println("run:", <-ran)
	s, _ := broker.Stats("emails")
	fmt.Println("acked:", s.Acked)
	// Output:
	// shutdown: <nil>
	// run: <nil>
	// acked: 1
}
