package pgtx_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// 10,000 messages, a fifth of them published twice, bulk-inserted in
// batches of up to 100 through the runtime on the memory broker while
// functions fail single messages before writing and whole batches after
// writing, acks fail, and consumers die without acking. The effect table
// (no unique constraint) must hold exactly one row per message.
func TestBatchExactlyOnceUnderFaults(t *testing.T) {
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
	var msgs []memory.Message
	for i := range n {
		m := memory.Message{ID: fmt.Sprintf("pay-%05d", i), Body: []byte(fmt.Sprintf("amount=%d", i))}
		msgs = append(msgs, m)
		if i%5 == 0 {
			msgs = append(msgs, m) // a producer's retry
		}
	}
	if err := broker.Publish(ctx, queue, msgs...); err != nil {
		t.Fatal(err)
	}

	var batchFaults, messageFaults atomic.Int64
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		var write []*consumer.Message
		for _, m := range b.Messages {
			if rand.N(40) == 0 { // before its write: the others commit
				messageFaults.Add(1)
				b.Fail(m, errors.New("injected message failure"))
				continue
			}
			write = append(write, m)
		}
		if err := f.bulkInsert(ctx, tx, write); err != nil {
			return err
		}
		if rand.N(20) == 0 { // after the writes, which must roll back
			batchFaults.Add(1)
			return errors.New("injected batch failure")
		}
		return nil
	}, pgtx.WithOverlapRetryDelay(20*time.Millisecond))

	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	ackFaults, crashes := crashRun(t, ctx, broker, queue, 2, func(src *memory.Source) (*consumer.Consumer, error) {
		return consumer.NewBatch(src, h,
			consumer.WithBatchSize(100),
			consumer.WithConcurrency(4),
			consumer.WithRetry(consumer.Retry{MaxAttempts: 1000, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}),
			consumer.WithShutdownTimeout(10*time.Second),
			consumer.WithLogger(quiet),
		)
	})
	seq := f.expectEachEffectOnce(t, ctx, n)
	t.Logf("%d messages (%d deliveries published): %d message faults, %d batch faults, %d ack faults, %d crashes; %d sequential and %d overlapping duplicates absorbed",
		n, len(msgs), messageFaults.Load(), batchFaults.Load(), ackFaults, crashes, seq, f.duplicates(t, "overlapping"))
	if messageFaults.Load() == 0 || batchFaults.Load() == 0 || ackFaults == 0 || crashes == 0 || seq == 0 {
		t.Fatalf("faults did not bite: %d message faults, %d batch faults, %d ack faults, %d crashes, %d sequential duplicates",
			messageFaults.Load(), batchFaults.Load(), ackFaults, crashes, seq)
	}
}

// An outage of the database under a batch consumer dead-letters nothing
// and redelivers nothing (Message.Attempt stays 1), however far past
// MaxAttempts its transactions fail; every effect commits once when the
// database is back.
func TestBatchDatabaseOutageDeadLettersNothing(t *testing.T) {
	const (
		n           = 20
		maxAttempts = 3
	)
	f := newFixture(t)
	f.batchHandler(t, f.insertAll) // the schema, through the direct pool
	pool, link := teststores.PostgresVia(t)
	var (
		mu       sync.Mutex
		attempts []int
	)
	h, err := pgtx.NewBatch(pool, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		mu.Lock()
		for _, m := range b.Messages {
			attempts = append(attempts, m.Attempt)
		}
		mu.Unlock()
		return f.insertAll(ctx, tx, b)
	}, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
	if err != nil {
		t.Fatal(err)
	}
	link.Cut()

	b := memory.NewBroker()
	for _, q := range []string{"q", "dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		if err := b.Publish(context.Background(), "q", memory.Message{ID: fmt.Sprintf("pay-%d", i), Body: []byte("a")}); err != nil {
			t.Fatal(err)
		}
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.NewBatch(src, h, consumer.WithBatchSize(8), consumer.WithConcurrency(2), consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	deadLettered := func() int {
		s, err := b.Stats("dlq")
		if err != nil {
			t.Fatal(err)
		}
		return s.Visible
	}
	end := time.Now().Add(30 * time.Second)
	for deadLettered() == 0 && f.claimStoreErrors(t) < 2*n*maxAttempts {
		if time.Now().After(end) {
			t.Fatalf("only %d failed claims in 30 s", f.claimStoreErrors(t))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if k := deadLettered(); k > 0 {
		t.Fatalf("%d of %d valid messages dead-lettered while the database was down", k, n)
	}
	link.Restore()
	wctx, wcancel := context.WithTimeout(context.Background(), time.Minute)
	defer wcancel()
	if err := b.WaitEmpty(wctx, "q"); err != nil {
		t.Fatalf("the queue did not drain once the database was back: %v", err)
	}
	if k := deadLettered(); k > 0 {
		t.Fatalf("%d of %d valid messages dead-lettered", k, n)
	}
	if rows := f.rows(t, f.effects); rows != n {
		t.Fatalf("%d effect rows for %d messages, want one each", rows, n)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, a := range attempts {
		if a != 1 {
			t.Fatalf("a function saw Attempt %d, want 1: the outage used up attempts", a)
		}
	}
	if s, _ := b.Stats("q"); s.Received != n {
		t.Fatalf("%d receives for %d messages, want each received once", s.Received, n)
	}
}
