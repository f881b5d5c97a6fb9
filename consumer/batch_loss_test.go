package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// When one message of a running batch is lost (here its lease: the broker
// refuses its renewal), the batch's context is cancelled with the loss as
// its cause, as a Handler's is: the broker hands the message to another
// consumer, and the batch's effect must not run on beside it. The lost
// message comes back from the broker; its batch-mates, whose attempt the
// cut spoiled through no fault of theirs, run again without using up an
// attempt: with MaxAttempts 1 they would otherwise be dead-lettered.
func TestBatchContextEndsWhenAMessageIsLost(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("a", "lost", "c")
	var refuse atomic.Bool
	refuse.Store(true)
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(d *adapters.Delivery) error {
		if refuse.Load() && string(d.Body) == "lost" {
			return fmt.Errorf("taken back by the broker: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
	causes := make(chan error, 1)
	var (
		mu       sync.Mutex
		attempts = map[string][]int{}
		batches  int
	)
	runBatch(t, src, func(ctx context.Context, b *consumer.Batch) error {
		mu.Lock()
		batches++
		first := batches == 1
		for _, m := range b.Messages {
			attempts[string(m.Body)] = append(attempts[string(m.Body)], m.Attempt)
		}
		mu.Unlock()
		if !first {
			b.DoneAll()
			return nil
		}
		select {
		case <-ctx.Done():
			causes <- context.Cause(ctx)
			return context.Cause(ctx)
		case <-time.After(patience):
			causes <- errors.New("the batch's context was not cancelled")
			return nil
		}
	}, fastRetry(1), consumer.WithDeadLetter(e.dlq()), consumer.WithBatchLinger(100*time.Millisecond))
	if cause := await(t, "the first batch to end", causes); !errors.Is(cause, adapters.ErrLeaseLost) {
		t.Fatalf("the batch's context ended with %v, want a cause wrapping adapters.ErrLeaseLost", cause)
	}
	refuse.Store(false)
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == 3 })
	if n := e.stats("dlq").Visible; n != 0 {
		t.Fatalf("%d dead letters: the batch-mates of a lost message used up their attempts", n)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, body := range []string{"a", "c"} {
		if got := fmt.Sprint(attempts[body]); got != "[1 1]" {
			t.Errorf("%s ran as attempts %s, want [1 1]: run again in place, with no attempt used up", body, got)
		}
	}
	if got := attempts["lost"]; len(got) != 2 || got[1] != 2 {
		t.Errorf("the lost message ran as attempts %v, want [1 2]: redelivered by the broker", got)
	}
}
