// Command quickstart runs custody on its embedded memory broker, with no
// setup: a few hundred orders, a flaky dependency that is retried with
// backoff, a poison message that is dead-lettered with its diagnostics, and a
// slow handler whose lease is kept alive while it works.
//
//	go run ./examples/quickstart
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	ID     int `json:"id"`
	Amount int `json:"amount"`
}

const (
	orders  = 300
	lease   = 300 * time.Millisecond // the broker redelivers after this unless the lease is renewed
	slowID  = 42                     // this order takes 1s: more than three leases
	flakyID = 7                      // every order whose id is a multiple fails on its first attempt
)

func main() {
	if err := run(); err != nil {
		log.Fatal(err)
	}
}

func run() error {
	ctx := context.Background()
	broker := memory.NewBroker()
	if err := broker.CreateQueue("orders-dlq", memory.QueueOptions{}); err != nil {
		return err
	}
	if err := broker.CreateQueue("orders", memory.QueueOptions{Lease: lease}); err != nil {
		return err
	}
	for i := 1; i <= orders; i++ {
		body, _ := json.Marshal(order{ID: i, Amount: i * 10})
		if i == 13 {
			body = []byte(`{"id": 13, "amount": "thirteen"`) // malformed: a poison message
		}
		// The producer names each message; left out, the broker would
		// generate an ID.
		msg := memory.Message{ID: fmt.Sprintf("order-%d", i), Body: body}
		if err := broker.Publish(ctx, "orders", msg); err != nil {
			return err
		}
	}

	var (
		mu       sync.Mutex
		effects  = map[int]int{} // order id -> times its effect was applied
		attempts atomic.Int64
		retried  atomic.Int64
	)
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		attempts.Add(1)
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			// No retry can fix a message that does not parse.
			return consumer.Permanent(fmt.Errorf("decoding order: %w", err))
		}
		if o.ID%flakyID == 0 && m.Attempt == 1 {
			retried.Add(1)
			return errors.New("payment service timed out")
		}
		if o.ID == slowID {
			select {
			case <-time.After(time.Second):
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
		mu.Lock()
		effects[o.ID]++
		mu.Unlock()
		return nil
	})

	src, err := broker.Source("orders", memory.WithPollWait(50*time.Millisecond))
	if err != nil {
		return err
	}
	dlq, err := broker.DeadLetterQueue("orders-dlq")
	if err != nil {
		return err
	}
	c, err := consumer.New(src, handler,
		consumer.WithName("quickstart"),
		consumer.WithConcurrency(16),
		consumer.WithRetry(consumer.Retry{
			MaxAttempts: 3,
			Backoff:     consumer.ExponentialBackoff{Initial: 50 * time.Millisecond, Max: time.Second, Multiplier: 2, Jitter: 0.5},
		}),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))),
	)
	if err != nil {
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- c.Run(runCtx) }()

	// Wait until every order is applied or dead-lettered, then shut down.
	deadline := time.After(30 * time.Second)
	for {
		mu.Lock()
		applied := len(effects)
		mu.Unlock()
		dl, _ := broker.Stats("orders-dlq")
		if applied+dl.Visible == orders {
			break
		}
		select {
		case <-deadline:
			stop()
			<-done
			return fmt.Errorf("gave up after 30s with %d of %d orders settled", applied+dl.Visible, orders)
		case <-time.After(20 * time.Millisecond):
		}
	}
	stop()
	if err := <-done; err != nil {
		return err
	}
	elapsed := time.Since(start)

	stats, _ := broker.Stats("orders")
	dead, _ := broker.Messages("orders-dlq")
	duplicates := 0
	for _, n := range effects {
		if n > 1 {
			duplicates++
		}
	}
	fmt.Printf("custody quickstart: %d orders on the memory broker (lease %v), 16 workers\n\n", orders, lease)
	fmt.Printf("  applied            %d orders in %v, %d handler attempts\n", len(effects), elapsed.Round(time.Millisecond), attempts.Load())
	fmt.Printf("  retried            %d flaky orders failed once, were retried with backoff, then applied\n", retried.Load())
	fmt.Printf("  slow order #%d     took 1s, over 3 leases: applied %d time(s); %d lease extensions in all kept it from being redelivered\n", slowID, effects[slowID], stats.Extended)
	fmt.Printf("  duplicates         %d orders applied more than once\n", duplicates)
	fmt.Printf("  left in the queue  %d visible, %d in flight; %d acked\n", stats.Visible, stats.InFlight, stats.Acked)
	fmt.Printf("  dead-lettered      %d message(s)\n", len(dead))
	for _, m := range dead {
		fmt.Printf("\n  dead letter %s: %s\n", m.ID, m.Body)
		keys := make([]string, 0, len(m.Headers))
		for k := range m.Headers {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Printf("    %-28s %s\n", k, m.Headers[k])
		}
	}
	if duplicates > 0 || effects[slowID] != 1 || len(dead) != 1 || stats.Visible+stats.InFlight != 0 {
		return errors.New("quickstart: unexpected outcome (see above)")
	}
	return nil
}
