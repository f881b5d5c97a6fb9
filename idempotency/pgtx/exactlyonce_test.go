package pgtx_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// 10,000 messages go through the runtime on the memory broker while
// handlers fail after writing, acks fail, and consumers die without acking.
// Every kind of fault produces redeliveries; the effect table must still
// hold exactly one row per message.
func TestExactlyOnceUnderFaults(t *testing.T) {
	n := 10_000
	if testing.Short() {
		n = 1_000
	}
	f := newFixture(t)
	ctx := context.Background()

	broker := memory.NewBroker()
	const queue = "payments"
	if err := broker.CreateQueue(queue, memory.QueueOptions{Lease: 300 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	msgs := make([]memory.Message, n)
	for i := range msgs {
		msgs[i] = memory.Message{ID: fmt.Sprintf("pay-%05d", i), Body: []byte(fmt.Sprintf("amount=%d", i))}
	}
	if err := broker.Publish(ctx, queue, msgs...); err != nil {
		t.Fatal(err)
	}

	var handlerFaults atomic.Int64
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := f.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if rand.N(20) == 0 { // after the write, which must roll back
			handlerFaults.Add(1)
			return errors.New("injected handler failure")
		}
		return nil
	}, pgtx.WithOverlapRetryDelay(20*time.Millisecond))

	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ackFaults, crashes := crashRun(t, ctx, broker, queue, 3, func(src *memory.Source) (*consumer.Consumer, error) {
		return consumer.New(src, h,
			consumer.WithConcurrency(8),
			consumer.WithRetry(consumer.Retry{MaxAttempts: 1000, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}),
			consumer.WithShutdownTimeout(10*time.Second),
			consumer.WithLogger(quiet),
		)
	})
	seq := f.expectEachEffectOnce(t, ctx, n)
	t.Logf("%d messages: %d handler faults, %d ack faults, %d crashes; %d sequential and %d overlapping duplicates absorbed",
		n, handlerFaults.Load(), ackFaults, crashes, seq, f.duplicates(t, "overlapping"))
	// The faults must have happened and produced redeliveries, or the test
	// proved nothing.
	if handlerFaults.Load() == 0 || ackFaults == 0 || crashes == 0 || seq == 0 {
		t.Fatalf("faults did not bite: %d handler faults, %d ack faults, %d crashes, %d sequential duplicates",
			handlerFaults.Load(), ackFaults, crashes, seq)
	}
}
