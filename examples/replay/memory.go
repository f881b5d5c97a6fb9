package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// The memory demo: orders, of which the refunds (negative amounts) fail on
// a validation bug and a few payments fail on an outage that outlasts their
// retries. Both end in the dead-letter queue; the replay brings them back
// once the bug is fixed and the outage over.
const (
	demoOrders  = 12
	demoQueue   = "orders"
	demoDLQ     = "orders-dlq"
	maxAttempts = 3
)

type order struct {
	ID     int `json:"id"`
	Amount int `json:"amount"`
}

func refund(id int) bool { return id == 3 || id == 7 }
func outage(id int) bool { return id == 5 || id == 10 || id == 11 }

func demoAmount(id int) int {
	if refund(id) {
		return -10 * id
	}
	return 10 * id
}

var errOutage = errors.New("payment service unavailable")

// openMemory sets the demo up: publishes the orders, runs the consumer
// with its bug and its outage until the queue is empty (everything handled
// or dead-lettered), and returns the dead-letter queue; the consumer, fixed,
// runs again after the replay.
func openMemory(ctx context.Context, cfg config, out io.Writer) (*destination, error) {
	if cfg.dlq != "" {
		return nil, fmt.Errorf("-dlq %q: the memory demo makes its own queues; leave -dlq out", cfg.dlq)
	}
	b := memory.NewBroker()
	for _, q := range []string{demoDLQ, demoQueue} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: time.Second}); err != nil {
			return nil, err
		}
	}
	for id := 1; id <= demoOrders; id++ {
		body, _ := json.Marshal(order{ID: id, Amount: demoAmount(id)})
		m := memory.Message{ID: fmt.Sprintf("order-%d", id), Body: body, Headers: map[string]string{"tenant": "acme"}}
		if err := b.Publish(ctx, demoQueue, m); err != nil {
			return nil, err
		}
	}
	first, err := consume(ctx, b, false)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "published %d orders; handled %d, dead-lettered %d (refunds refused by a bug, payments cut by an outage)\n",
		demoOrders, len(first), demoOrders-len(first))
	r, err := b.Replay(demoDLQ)
	if err != nil {
		return nil, err
	}
	dst := &destination{replayer: r, name: "memory queue " + demoDLQ}
	dst.after = func(ctx context.Context, out io.Writer) error {
		if !cfg.replay {
			return nil
		}
		second, err := consume(ctx, b, true)
		if err != nil {
			return err
		}
		left, err := b.Messages(demoDLQ)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "after the replay, with the bug fixed and the outage over, the consumer handled orders %v", sortedKeys(second))
		for _, n := range second {
			if n != 1 {
				return fmt.Errorf("an order was handled %d times after the replay", n)
			}
		}
		fmt.Fprintf(out, ", each once; %d dead letters left in %s\n", len(left), demoDLQ)
		return nil
	}
	return dst, nil
}

// consume runs the orders consumer until its queue is empty and returns how
// often it handled each order. fixed says whether the bug is fixed and the
// outage over.
func consume(ctx context.Context, b *memory.Broker, fixed bool) (map[int]int, error) {
	src, err := b.Source(demoQueue, memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		return nil, err
	}
	dlq, err := b.DeadLetterQueue(demoDLQ)
	if err != nil {
		return nil, err
	}
	var (
		mu      sync.Mutex
		handled = map[int]int{}
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("decoding order: %w", err))
		}
		if !fixed && o.Amount < 0 {
			return consumer.Permanent(errors.New("invalid order: negative amount"))
		}
		if !fixed && outage(o.ID) {
			return errOutage
		}
		mu.Lock()
		handled[o.ID]++
		mu.Unlock()
		return nil
	})
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	c, err := consumer.New(src, h,
		consumer.WithName("orders"),
		consumer.WithConcurrency(4),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(quiet))
	if err != nil {
		return nil, err
	}
	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- c.Run(runCtx) }()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	waitErr := b.WaitEmpty(waitCtx, demoQueue)
	cancel()
	stop()
	if err := <-ran; err != nil {
		return nil, err
	}
	if waitErr != nil {
		return nil, waitErr
	}
	mu.Lock()
	defer mu.Unlock()
	return handled, nil
}
