package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The window and the total bound work apart: queued deliveries leave room
// in the window, but no more is taken once everything held, queued or not,
// nears the total.
func TestCreditKeepsQueuedOutOfTheWindowWithinTheTotal(t *testing.T) {
	c := newCredit(4, 10, 2)
	take := func() int {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		n, _ := c.acquire(ctx)
		return n
	}
	// Each step: what is in the window and queued before the take, and
	// what the take gets.
	steps := []struct {
		queue, release, releaseQueued int
		want                          int
	}{
		{want: 2},                       // 0+0: a batch
		{want: 2},                       // 2+0: at the window's low water, a batch
		{want: 0},                       // 4+0: the window is full
		{queue: 3, want: 2},             // 1+3: three wait behind their lanes
		{queue: 2, want: 2},             // 1+5
		{queue: 2, want: 2},             // 1+7: at the total's low water, a batch
		{queue: 2, want: 0},             // 1+9 is above the total's low water
		{queue: -1, want: 0},            // 2+8: one taken to run counts in the window again
		{releaseQueued: 3, want: 2},     // 2+5: three given back from their lanes' queues
		{release: 3, queue: 1, want: 2}, // 0+6
	}
	for i, s := range steps {
		c.queue(s.queue)
		c.release(s.release)
		c.releaseQueued(s.releaseQueued)
		if n := take(); n != s.want {
			c.mu.Lock()
			t.Fatalf("step %d: took %d with %d in the window and %d queued, want %d", i, n, c.held, c.queued, s.want)
		}
	}
}

// freeSource is a memory source declared, like Kafka by key, without a
// lease and with queued deliveries free (Capabilities.FreeWhileQueued).
type freeSource struct{ *memory.Source }

func (s freeSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.Lease, c.MaxUnacked, c.FreeWhileQueued = 0, 50, true
	return c
}

// Every job queued behind its lane and taken from it again, by a worker
// or into a batch, put back at the front of its lane by a batch that
// failed, moves its credit out of the window and back: once every message
// is acked, the credit holds nothing, in the window or queued.
func TestQueuedCreditReturnsToZero(t *testing.T) {
	for _, batched := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batched), func(t *testing.T) {
			b := memory.NewBroker()
			if err := b.CreateQueue("q", memory.QueueOptions{Lease: time.Minute}); err != nil {
				t.Fatal(err)
			}
			const keys, perKey = 3, 20
			for i := 0; i < perKey; i++ {
				for k := 0; k < keys; k++ {
					m := memory.Message{Key: fmt.Sprintf("k%d", k), Body: fmt.Appendf(nil, "k%d-%02d", k, i)}
					if err := b.Publish(context.Background(), "q", m); err != nil {
						t.Fatal(err)
					}
				}
			}
			ms, err := b.Source("q", memory.WithPollWait(10*time.Millisecond))
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			failed := map[string]bool{}
			failOnce := func(m *Message) error {
				mu.Lock()
				defer mu.Unlock()
				if body := string(m.Body); body[len(body)-2:] == "04" && !failed[body] {
					failed[body] = true
					return errors.New("once")
				}
				return nil
			}
			opts := []Option{
				WithLogger(testlog.New(t)), WithOrdering(OrderByKey), WithConcurrency(2), WithMaxInFlight(4),
				WithRetry(Retry{MaxAttempts: 3, Backoff: ConstantBackoff(5 * time.Millisecond)}),
			}
			var c *Consumer
			if batched {
				c, err = NewBatch(freeSource{ms}, BatchHandlerFunc(func(ctx context.Context, bt *Batch) error {
					for _, m := range bt.Messages {
						if err := failOnce(m); err != nil {
							bt.Fail(m, err)
						} else {
							bt.Done(m)
						}
					}
					return nil
				}), append(opts, WithBatchSize(5))...)
			} else {
				c, err = New(freeSource{ms}, HandlerFunc(func(ctx context.Context, m *Message) error { return failOnce(m) }), opts...)
			}
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			deadline := time.Now().Add(30 * time.Second)
			for {
				st, err := b.Stats("q")
				if err != nil {
					t.Fatal(err)
				}
				if st.Acked == keys*perKey {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("acked %d of %d", st.Acked, keys*perKey)
				}
				time.Sleep(2 * time.Millisecond)
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			cr := c.cur.Load().credit
			cr.mu.Lock()
			defer cr.mu.Unlock()
			if cr.held != 0 || cr.queued != 0 {
				t.Fatalf("credit holds %d in the window and %d queued once everything is acked, want none", cr.held, cr.queued)
			}
		})
	}
}
