package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
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

// newOrders returns a memory broker whose queue "orders" holds msgs, a
// source on that queue, and a dead-letter destination writing to the
// queue "orders-dlq".
func newOrders(msgs ...memory.Message) (*memory.Broker, *memory.Source, *memory.DeadLetterQueue) {
	b := memory.NewBroker()
	_ = b.CreateQueue("orders", memory.QueueOptions{})
	_ = b.CreateQueue("orders-dlq", memory.QueueOptions{})
	_ = b.Publish(context.Background(), "orders", msgs...)
	src, _ := b.Source("orders", memory.WithPollWait(10*time.Millisecond))
	dlq, _ := b.DeadLetterQueue("orders-dlq")
	return b, src, dlq
}

// runUntilEmpty runs c until the queue "orders" holds nothing more (every
// message acked or dead-lettered), then shuts it down.
func runUntilEmpty(b *memory.Broker, c *consumer.Consumer) {
	go func() { _ = c.Run(context.Background()) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.WaitEmpty(ctx, "orders"); err != nil {
		fmt.Println(err)
	}
	_ = c.Shutdown(context.Background())
}

// A message that can never succeed is dead-lettered on its first attempt,
// whatever the retry policy allows, with headers that say why.
func ExamplePermanent() {
	b, src, dlq := newOrders(memory.Message{Body: []byte("forty-two")})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Println("attempt", m.Attempt)
		if _, err := strconv.Atoi(string(m.Body)); err != nil {
			return consumer.Permanent(err) // retrying cannot fix the payload
		}
		return nil
	}), consumer.WithDeadLetter(dlq))
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)

	dead, _ := b.Messages("orders-dlq")
	h := dead[0].Headers
	fmt.Println(adapters.HeaderPermanent+":", h[adapters.HeaderPermanent])
	fmt.Println(adapters.HeaderAttempts+":", h[adapters.HeaderAttempts])
	fmt.Println(adapters.HeaderError+":", h[adapters.HeaderError])
	// Output:
	// attempt 1
	// custody-permanent: true
	// custody-attempts: 1
	// custody-error: permanent: strconv.Atoi: parsing "forty-two": invalid syntax
}

// A handler told by a rate-limited API when to come back asks for exactly
// that delay instead of the retry policy's backoff. The message is given
// back to the broker for the wait: no worker sits idle meanwhile.
func ExampleRetryAfter() {
	b, src, dlq := newOrders(memory.Message{Body: []byte("order-1")})
	var first time.Time
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			first = time.Now()
			// The API answered 429 Too Many Requests, Retry-After: 50ms.
			return consumer.RetryAfter(errors.New("rate limited"), 50*time.Millisecond)
		}
		fmt.Printf("attempt %d, at least 50ms later: %t\n", m.Attempt, time.Since(first) >= 50*time.Millisecond)
		return nil
	}),
		// The policy alone would retry after a millisecond.
		consumer.WithRetry(consumer.Retry{Backoff: consumer.ConstantBackoff(time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)
	// Output: attempt 2, at least 50ms later: true
}

// A message that cannot be handled yet, for a reason outside it, is
// deferred: it comes back later and is never dead-lettered for it, however
// often that happens. Here an order's payment arrives before the order
// itself, which shows up on the third look.
//
// The memory broker counts deliveries, so Attempt goes up with each
// deferral (see [Defer] for what that means for MaxAttempts).
func ExampleDefer() {
	b, src, dlq := newOrders(memory.Message{Body: []byte("payment for order-7")})
	var looks atomic.Int32
	orderExists := func() bool { return looks.Add(1) == 3 }

	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if !orderExists() {
			fmt.Println("attempt", m.Attempt, "deferred")
			return consumer.Defer(errors.New("order-7 not there yet"), 10*time.Millisecond)
		}
		fmt.Println("attempt", m.Attempt, "applied")
		return nil
	}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 2, Backoff: consumer.ConstantBackoff(time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)
	dead, _ := b.Messages("orders-dlq")
	fmt.Println("dead-lettered:", len(dead))
	// Output:
	// attempt 1 deferred
	// attempt 2 deferred
	// attempt 3 applied
	// dead-lettered: 0
}

// A handler that keeps failing is retried after the backoff until
// MaxAttempts attempts have been made, then its message goes to the
// dead-letter destination with the last error and the attempt count.
func ExampleWithDeadLetter() {
	b, src, dlq := newOrders(memory.Message{Body: []byte("order-1")})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		fmt.Println("attempt", m.Attempt)
		return errors.New("warehouse API: connection refused")
	}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)

	dead, _ := b.Messages("orders-dlq")
	fmt.Printf("dead-lettered %s\n", dead[0].Body)
	fmt.Println(adapters.HeaderAttempts+":", dead[0].Headers[adapters.HeaderAttempts])
	fmt.Println(adapters.HeaderError+":", dead[0].Headers[adapters.HeaderError])
	// Output:
	// attempt 1
	// attempt 2
	// attempt 3
	// dead-lettered order-1
	// custody-attempts: 3
	// custody-error: warehouse API: connection refused
}

// With OrderByKey, messages with the same Key run one at a time, in the
// order received, while messages with different keys run at once. Here each
// customer's "created" takes longest to handle: without the option, that
// customer's next event could overtake it.
func ExampleWithOrdering() {
	event := func(customer, what string) memory.Message {
		return memory.Message{Key: customer, Body: []byte(what)}
	}
	b, src, dlq := newOrders(
		event("alice", "created"), event("bob", "created"),
		event("alice", "paid"), event("bob", "cancelled"),
		event("alice", "shipped"),
	)
	var mu sync.Mutex
	seen := map[string][]string{}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "created" {
			time.Sleep(5 * time.Millisecond)
		}
		mu.Lock()
		defer mu.Unlock()
		seen[m.Key] = append(seen[m.Key], string(m.Body))
		return nil
	}),
		consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithConcurrency(4),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)
	fmt.Println("alice:", seen["alice"])
	fmt.Println("bob:", seen["bob"])
	// Output:
	// alice: [created paid shipped]
	// bob: [created cancelled]
}

// A handler timeout bounds each attempt: the handler's context is
// cancelled, with ErrHandlerTimeout as its cause, and a handler that returns
// the error fails the attempt, to be retried like any other failure. Here
// the first call to a slow service hangs; the retry gets its answer.
func ExampleWithHandlerTimeout() {
	b, src, dlq := newOrders(memory.Message{Body: []byte("order-1")})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			<-ctx.Done() // a call that hangs until its context ends
			fmt.Println("attempt 1:", context.Cause(ctx))
			return ctx.Err()
		}
		fmt.Println("attempt 2: reserved")
		return nil
	}),
		consumer.WithHandlerTimeout(20*time.Millisecond),
		consumer.WithRetry(consumer.Retry{Backoff: consumer.ConstantBackoff(time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	runUntilEmpty(b, c)
	// Output:
	// attempt 1: custody: handler timeout reached
	// attempt 2: reserved
}

// A handler is a function of one message, so a unit test can call it
// directly, without a broker or a consumer, and check what it returns.
func ExampleHandlerFunc() {
	greet := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if len(m.Body) == 0 {
			return consumer.Permanent(errors.New("no name"))
		}
		fmt.Printf("hello, %s\n", m.Body)
		return nil
	})
	ctx := context.Background()
	fmt.Println(greet.Handle(ctx, &consumer.Message{Body: []byte("Ada"), Attempt: 1}))
	err := greet.Handle(ctx, &consumer.Message{Attempt: 1})
	fmt.Println(err, consumer.IsPermanent(err))
	// Output:
	// hello, Ada
	// <nil>
	// permanent: no name true
}
