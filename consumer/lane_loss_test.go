package consumer_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// TestLostMessageKeepsItsGroupInOrder: on a FIFO queue, when the lease of a
// group's running message is lost, the messages of that group received with
// it are given back rather than run: the lost one comes back first, and the
// group's effects happen in order. Run instead, they finished before the
// lost message's redelivery (a2, a3, a1).
func TestLostMessageKeepsItsGroupInOrder(t *testing.T) {
	b := memory.NewBroker()
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: 300 * time.Millisecond, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	var msgs []memory.Message
	for i := 1; i <= 3; i++ {
		msgs = append(msgs, memory.Message{Key: "a", Body: []byte(fmt.Sprintf("a%d", i))})
	}
	if err := b.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	var refused atomic.Bool
	src, err := b.Source("q", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(d *adapters.Delivery) error {
			// The first renewal of a1's first delivery: its lease is lost.
			if string(d.Body) == "a1" && refused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var done []string
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a1" && m.Attempt == 1 {
			<-ctx.Done() // runs until its lease is lost
			return ctx.Err()
		}
		mu.Lock()
		done = append(done, string(m.Body))
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(4))
	defer r.stop()
	waitFor(t, "all three done", func() bool {
		s, _ := b.Stats("q")
		return s.Acked == 3
	})
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(done, []string{"a1", "a2", "a3"}) {
		t.Fatalf("group a's effects ran in the order %v, want a1 a2 a3", done)
	}
}

// nackRecorder records the deliveries a source is asked to nack and the
// delays asked for.
type nackRecorder struct {
	*memory.Source
	mu     sync.Mutex
	bodies []string
	delays []time.Duration
}

func (s *nackRecorder) Nack(ctx context.Context, ds []*adapters.Delivery, after time.Duration) error {
	s.mu.Lock()
	for _, d := range ds {
		s.bodies = append(s.bodies, string(d.Body))
		s.delays = append(s.delays, after)
	}
	s.mu.Unlock()
	return s.Source.Nack(ctx, ds, after)
}

func (s *nackRecorder) nacked() ([]string, []time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.bodies), slices.Clone(s.delays)
}

// TestLaneLossGivesBackAlsoWhenLeavingUnfinishedOnShutdown: the messages of a
// group queued behind a lost one are given back at once even with
// WithLeaveUnfinishedOnShutdown, which is about shutdown only. Left to their
// leases instead (and counted as "left"), they held the whole group, the lost
// message included, until those leases ran out: on SQS a visibility timeout.
func TestLaneLossGivesBackAlsoWhenLeavingUnfinishedOnShutdown(t *testing.T) {
	b := memory.NewBroker()
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: 300 * time.Millisecond, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	var msgs []memory.Message
	for i := 1; i <= 3; i++ {
		msgs = append(msgs, memory.Message{Key: "a", Body: []byte(fmt.Sprintf("a%d", i))})
	}
	if err := b.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	var refused atomic.Bool
	mem, err := b.Source("q", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(d *adapters.Delivery) error {
			if string(d.Body) == "a1" && refused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	src := &nackRecorder{Source: mem}
	var mu sync.Mutex
	var done []string
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a1" && m.Attempt == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
		mu.Lock()
		done = append(done, string(m.Body))
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(4), consumer.WithLeaveUnfinishedOnShutdown())
	defer r.stop()
	waitFor(t, "all three done", func() bool {
		s, _ := b.Stats("q")
		return s.Acked == 3
	})
	if bodies, _ := src.nacked(); !slices.Equal(bodies, []string{"a2", "a3"}) {
		t.Fatalf("nacked %v; want a2 and a3, queued behind the lost a1, given back at once", bodies)
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(done, []string{"a1", "a2", "a3"}) {
		t.Fatalf("group a's effects ran in the order %v, want a1 a2 a3", done)
	}
}

// TestLostMessageKeepsItsGroupInOrderMidRun: the jobs of a lane are handed
// on in runs (taken together when the one before finishes); when a message
// in the middle of such a run is lost, the rest of the run is given back
// too, and the group's effects still happen in order.
func TestLostMessageKeepsItsGroupInOrderMidRun(t *testing.T) {
	b := memory.NewBroker()
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: 300 * time.Millisecond, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	var msgs []memory.Message
	for i := 1; i <= 4; i++ {
		msgs = append(msgs, memory.Message{Key: "a", Body: []byte(fmt.Sprintf("a%d", i))})
	}
	if err := b.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	var refused atomic.Bool
	src, err := b.Source("q", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(d *adapters.Delivery) error {
			// The first renewal of a2's first delivery: its lease is lost.
			if string(d.Body) == "a2" && refused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var done []string
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a2" && m.Attempt == 1 {
			<-ctx.Done() // runs until its lease is lost
			return ctx.Err()
		}
		mu.Lock()
		done = append(done, string(m.Body))
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(4))
	defer r.stop()
	waitFor(t, "all four done", func() bool {
		s, _ := b.Stats("q")
		return s.Acked == 4
	})
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(done, []string{"a1", "a2", "a3", "a4"}) {
		t.Fatalf("group a's effects ran in the order %v, want a1 a2 a3 a4", done)
	}
}
