package idempotency_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// runUntilDrained runs a consumer of queue with h until the queue holds no
// message, then stops it.
func runUntilDrained(t testing.TB, b *memory.Broker, queue string, h consumer.Handler, opts ...consumer.Option) {
	t.Helper()
	src, err := b.Source(queue, memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	opts = append([]consumer.Option{consumer.WithLogger(quiet)}, opts...)
	c, err := consumer.New(src, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	end := time.Now().Add(2 * time.Minute)
	for {
		st, err := b.Stats(queue)
		if err != nil {
			t.Fatal(err)
		}
		if st.Visible == 0 && st.InFlight == 0 {
			break
		}
		if time.Now().After(end) {
			cancel()
			t.Fatalf("queue %s not drained: %+v", queue, st)
		}
		time.Sleep(2 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// The same message delivered 32 times at once through the runtime: the
// effect runs once, the copies are retried while it runs and skipped after.
func TestDuplicatesThroughTheRuntime(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			const n = 32
			m := newMeter(t)
			b := memory.NewBroker()
			if err := b.CreateQueue("q", memory.QueueOptions{Lease: 5 * time.Second}); err != nil {
				t.Fatal(err)
			}
			for range n {
				if err := b.Publish(context.Background(), "q", memory.Message{ID: "order-7", Body: []byte("x")}); err != nil {
					t.Fatal(err)
				}
			}
			var runs atomic.Int32
			h := newGuard(t, st.New(t), func(ctx context.Context, _ *consumer.Message) error {
				runs.Add(1)
				end := time.Now().Add(30 * time.Second)
				for m.overlapping(t) < n-1 {
					if time.Now().After(end) {
						return errors.New("the copies never overlapped")
					}
					time.Sleep(time.Millisecond)
				}
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithOverlapRetryDelay(10*time.Millisecond))
			runUntilDrained(t, b, "q", h, consumer.WithConcurrency(n))
			if runs.Load() != 1 {
				t.Fatalf("effect ran %d times, want 1", runs.Load())
			}
			if got := m.sequential(t); got != n-1 {
				t.Fatalf("sequential duplicates %d, want %d (each copy skipped once after the effect)", got, n-1)
			}
			if got := m.overlapping(t); got < n-1 {
				t.Fatalf("overlapping duplicates %d, want at least %d", got, n-1)
			}
		})
	}
}

// A duplicate whose original runs far longer than MaxAttempts × the overlap
// delay waits for it instead of being dead-lettered: the deferrals do not use
// up its attempts.
func TestOverlappingDuplicateOutwaitsASlowOriginal(t *testing.T) {
	b := memory.NewBroker()
	for _, q := range []string{"q", "dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: 5 * time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if err := b.Publish(context.Background(), "q", memory.Message{ID: "order-8", Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	h := newGuard(t, newMemory(t), func(ctx context.Context, _ *consumer.Message) error {
		runs.Add(1)
		time.Sleep(300 * time.Millisecond) // 30 overlap delays
		return nil
	}, idempotency.WithOverlapRetryDelay(10*time.Millisecond))
	runUntilDrained(t, b, "q", h, consumer.WithConcurrency(2), consumer.WithDeadLetter(dlq),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}))
	if n := runs.Load(); n != 1 {
		t.Fatalf("effect ran %d times, want 1", n)
	}
	st, err := b.Stats("dlq")
	if err != nil {
		t.Fatal(err)
	}
	if st.Visible != 0 {
		t.Fatalf("%d copies dead-lettered while the original ran", st.Visible)
	}
}

// An idempotency store outlives the embedded broker (a process restarts with
// a fresh memory broker and the same Redis or PostgreSQL store): the new
// broker's messages, published without IDs, are new work and must run, not
// be taken for the old broker's messages and skipped.
func TestNewBrokersMessagesAreNotTakenForAnEarlierOnes(t *testing.T) {
	store := newMemory(t)
	var runs atomic.Int32
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		runs.Add(1)
		return nil
	})
	const perBroker = 3
	for range 2 {
		b := memory.NewBroker()
		if err := b.CreateQueue("q", memory.QueueOptions{Lease: time.Minute}); err != nil {
			t.Fatal(err)
		}
		for range perBroker {
			if err := b.Publish(context.Background(), "q", memory.Message{Body: []byte("x")}); err != nil {
				t.Fatal(err)
			}
		}
		runUntilDrained(t, b, "q", h)
	}
	if got := runs.Load(); got != 2*perBroker {
		t.Fatalf("the handler ran %d times for %d distinct messages: the second broker's were skipped as duplicates of the first's", got, 2*perBroker)
	}
}
