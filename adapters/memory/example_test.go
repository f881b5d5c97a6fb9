package memory_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// quiet keeps the runtime's warnings out of the examples' output.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// waitFor polls cond, as a handler test waits for the consumer to get
// somewhere.
func waitFor(cond func() bool) {
	for deadline := time.Now().Add(10 * time.Second); !cond() && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
}

// A handler test with an injected fault: the first ack is lost on its way
// to the broker, so the message comes back once its lease runs out and the
// handler runs twice. This is at-least-once delivery; put the idempotency
// middleware in front of handlers whose effect must not repeat.
func ExampleWithFaults() {
	ctx := context.Background()
	b := memory.NewBroker()
	_ = b.CreateQueue("orders", memory.QueueOptions{Lease: 300 * time.Millisecond})
	_ = b.Publish(ctx, "orders", memory.Message{ID: "order-1"})

	var lost atomic.Bool
	src, _ := b.Source("orders", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Ack: func(*adapters.Delivery) error {
			if lost.CompareAndSwap(false, true) {
				return errors.New("connection reset")
			}
			return nil
		},
	}))
	var runs atomic.Int32
	c, _ := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		runs.Add(1)
		return nil
	}), consumer.WithLogger(quiet))
	go func() { _ = c.Run(ctx) }()

	waitFor(func() bool { s, _ := b.Stats("orders"); return s.Acked == 1 })
	_ = c.Shutdown(ctx)
	s, _ := b.Stats("orders")
	fmt.Printf("handler runs: %d, receives: %d, acked: %d\n", runs.Load(), s.Received, s.Acked)
	// Output: handler runs: 2, receives: 2, acked: 1
}

// A queue with a redrive policy moves a message to its dead-letter queue
// once it has been received MaxReceiveCount times, as SQS does, whatever the
// consumer does with it.
func ExampleQueueOptions_redrive() {
	ctx := context.Background()
	b := memory.NewBroker()
	_ = b.CreateQueue("orders-dlq", memory.QueueOptions{})
	_ = b.CreateQueue("orders", memory.QueueOptions{MaxReceiveCount: 2, DeadLetterQueue: "orders-dlq"})
	_ = b.Publish(ctx, "orders", memory.Message{ID: "order-7", Body: []byte("poison")})

	src, _ := b.Source("orders", memory.WithPollWait(10*time.Millisecond))
	c, _ := consumer.New(src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		return errors.New("downstream refused it")
	}), consumer.WithRetry(consumer.Retry{MaxAttempts: 10, Backoff: consumer.ConstantBackoff(time.Millisecond)}),
		consumer.WithLogger(quiet))
	go func() { _ = c.Run(ctx) }()

	waitFor(func() bool { s, _ := b.Stats("orders-dlq"); return s.Visible == 1 })
	_ = c.Shutdown(ctx)
	dead, _ := b.Messages("orders-dlq")
	fmt.Printf("%s %q from %s after %s receives\n", dead[0].ID, dead[0].Body,
		dead[0].Headers[adapters.HeaderOriginalQueue], dead[0].Headers[adapters.HeaderAttempts])
	// Output: order-7 "poison" from orders after 2 receives
}

// Testing your own handler: publish the messages the test needs, run the
// handler under a real consumer until the queue is empty, then check its
// effects and the dead-letter queue. The broker runs in the process, so the
// test needs no infrastructure; in a test, report with t.Errorf instead of
// printing.
func Example_handlerTest() {
	ctx := context.Background()
	b := memory.NewBroker()
	_ = b.CreateQueue("signups", memory.QueueOptions{})
	_ = b.CreateQueue("signups-dlq", memory.QueueOptions{})
	_ = b.Publish(ctx, "signups",
		memory.Message{Body: []byte("ada@example.com")},
		memory.Message{Body: []byte("not an address")},
	)
	src, _ := b.Source("signups", memory.WithPollWait(10*time.Millisecond))
	dlq, _ := b.DeadLetterQueue("signups-dlq")

	// The handler under test, normally from your own package.
	var mu sync.Mutex
	var registered []string
	signup := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		addr := string(m.Body)
		if !strings.Contains(addr, "@") {
			return consumer.Permanent(fmt.Errorf("%q is no email address", addr))
		}
		mu.Lock()
		defer mu.Unlock()
		registered = append(registered, addr)
		return nil
	})

	c, err := consumer.New(src, signup,
		consumer.WithDeadLetter(dlq),
		// A test need not wait out production backoffs.
		consumer.WithRetry(consumer.Retry{Backoff: consumer.ConstantBackoff(time.Millisecond)}),
	)
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _ = c.Run(ctx) }()
	// Acked or dead-lettered, every message has then left the queue. The
	// deadline fails a test whose message is never settled.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := b.WaitEmpty(wctx, "signups"); err != nil {
		fmt.Println(err)
	}
	_ = c.Shutdown(ctx)

	fmt.Println("registered:", registered)
	dead, _ := b.Messages("signups-dlq")
	for _, m := range dead {
		fmt.Printf("dead-lettered %q: %s\n", m.Body, m.Headers[adapters.HeaderError])
	}
	// Output:
	// registered: [ada@example.com]
	// dead-lettered "not an address": permanent: "not an address" is no email address
}
