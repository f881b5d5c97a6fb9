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

	"github.com/custody-go/custody/adapters"
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

	var handlerFaults, ackFaults, crashes atomic.Int64
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

	faults := memory.Faults{Ack: func(*adapters.Delivery) error {
		if rand.N(20) == 0 {
			ackFaults.Add(1)
			return errors.New("injected ack failure")
		}
		return nil
	}}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))

	// A process is one consumer over its own Source. Crashing it makes the
	// Source refuse everything (acks included) and stops the consumer.
	type process struct {
		src    *memory.Source
		cancel context.CancelFunc
		done   chan error
	}
	start := func() *process {
		src, err := broker.Source(queue, memory.WithPollWait(50*time.Millisecond), memory.WithFaults(faults))
		if err != nil {
			t.Fatal(err)
		}
		c, err := consumer.New(src, h,
			consumer.WithConcurrency(8),
			consumer.WithRetry(consumer.Retry{MaxAttempts: 1000, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}),
			consumer.WithShutdownTimeout(10*time.Second),
			consumer.WithLogger(quiet),
		)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		p := &process{src: src, cancel: cancel, done: make(chan error, 1)}
		go func() { p.done <- c.Run(rctx) }()
		return p
	}
	stop := func(p *process) {
		p.cancel()
		select {
		case <-p.done:
		case <-time.After(60 * time.Second):
			t.Fatal("a consumer did not stop within 60s")
		}
	}

	procs := []*process{start(), start(), start()}
	drained := func() bool {
		st, err := broker.Stats(queue)
		if err != nil {
			t.Fatal(err)
		}
		return st.Visible == 0 && st.InFlight == 0
	}
	deadline := time.Now().Add(5 * time.Minute)
	for i := 0; !drained(); i++ {
		if time.Now().After(deadline) {
			st, _ := broker.Stats(queue)
			t.Fatalf("queue not drained after 5 minutes: %+v", st)
		}
		time.Sleep(20 * time.Millisecond)
		// Every 250ms, for the first dozen times, one process dies
		// holding its deliveries and a new one takes its place.
		if i%12 == 11 && crashes.Load() < 12 {
			victim := procs[0]
			procs = append(procs[1:], start())
			victim.src.Crash()
			crashes.Add(1)
			stop(victim)
		}
	}
	for _, p := range procs {
		stop(p)
	}

	var rows, distinct int
	if err := f.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT message_id) FROM `+f.effects).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	seq := f.duplicates(t, "sequential")
	t.Logf("%d messages: %d handler faults, %d ack faults, %d crashes; %d sequential and %d overlapping duplicates absorbed",
		n, handlerFaults.Load(), ackFaults.Load(), crashes.Load(), seq, f.duplicates(t, "overlapping"))
	if rows != n || distinct != n {
		t.Fatalf("effect table has %d rows for %d distinct messages, want exactly %d", rows, distinct, n)
	}
	if f.rows(t, f.processed) != n {
		t.Fatalf("processed table has %d keys, want %d", f.rows(t, f.processed), n)
	}
	// The faults must have happened and produced redeliveries, or the test
	// proved nothing.
	if handlerFaults.Load() == 0 || ackFaults.Load() == 0 || crashes.Load() == 0 || seq == 0 {
		t.Fatalf("faults did not bite: %d handler faults, %d ack faults, %d crashes, %d sequential duplicates",
			handlerFaults.Load(), ackFaults.Load(), crashes.Load(), seq)
	}
}
