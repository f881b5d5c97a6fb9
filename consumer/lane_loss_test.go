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

// groupWithLoss is a FIFO memory queue holding the group "a": a1..an, on
// which the first renewal of lost's first delivery is refused as lost.
type groupWithLoss struct {
	b    *memory.Broker
	src  *nackRecorder
	lost string

	mu   sync.Mutex
	done []string // the effects, in the order they ran
}

func newGroupWithLoss(t *testing.T, n int, lost string) *groupWithLoss {
	t.Helper()
	g := &groupWithLoss{b: memory.NewBroker(), lost: lost}
	if err := g.b.CreateQueue("q", memory.QueueOptions{Lease: 300 * time.Millisecond, FIFO: true}); err != nil {
		t.Fatal(err)
	}
	var msgs []memory.Message
	for i := 1; i <= n; i++ {
		msgs = append(msgs, memory.Message{Key: "a", Body: []byte(fmt.Sprintf("a%d", i))})
	}
	if err := g.b.Publish(context.Background(), "q", msgs...); err != nil {
		t.Fatal(err)
	}
	var refused atomic.Bool
	mem, err := g.b.Source("q", memory.WithPollWait(10*time.Millisecond), memory.WithFaults(memory.Faults{
		Extend: func(d *adapters.Delivery) error {
			if string(d.Body) == lost && refused.CompareAndSwap(false, true) {
				return fmt.Errorf("receipt expired: %w", adapters.ErrLeaseLost)
			}
			return nil
		},
	}))
	if err != nil {
		t.Fatal(err)
	}
	g.src = &nackRecorder{Source: mem}
	return g
}

// handle runs the lost message's first delivery until its lease is lost,
// and records every other effect.
func (g *groupWithLoss) handle(ctx context.Context, m *consumer.Message) error {
	if string(m.Body) == g.lost && m.Attempt == 1 {
		<-ctx.Done()
		return ctx.Err()
	}
	g.mu.Lock()
	g.done = append(g.done, string(m.Body))
	g.mu.Unlock()
	return nil
}

// run consumes until all n messages are acked and checks the effects ran in
// publish order.
func (g *groupWithLoss) run(t *testing.T, n int, opts ...consumer.Option) {
	t.Helper()
	r := runOn(t, g.src, g.handle, append([]consumer.Option{consumer.WithConcurrency(4)}, opts...)...)
	defer r.stop()
	waitFor(t, "every message done", func() bool {
		s, _ := g.b.Stats("q")
		return s.Acked == int64(n)
	})
	var want []string
	for i := 1; i <= n; i++ {
		want = append(want, fmt.Sprintf("a%d", i))
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if !slices.Equal(g.done, want) {
		t.Fatalf("group a's effects ran in the order %v, want %v", g.done, want)
	}
}

// TestLostMessageKeepsItsGroupInOrder: on a FIFO queue, when the lease of a
// group's running message is lost, the messages of that group received with
// it are given back rather than run: the lost one comes back first, and the
// group's effects happen in order. Run instead, they finished before the
// lost message's redelivery (a2, a3, a1).
func TestLostMessageKeepsItsGroupInOrder(t *testing.T) {
	newGroupWithLoss(t, 3, "a1").run(t, 3)
}

// TestLostMessageKeepsItsGroupInOrderMidRun: the jobs of a lane are handed
// on in runs (taken together when the one before finishes); when a message
// in the middle of such a run is lost, the rest of the run is given back
// too, and the group's effects still happen in order.
func TestLostMessageKeepsItsGroupInOrderMidRun(t *testing.T) {
	newGroupWithLoss(t, 4, "a2").run(t, 4)
}

// nackRecorder records the deliveries a source is asked to nack and the
// delays asked for.
type nackRecorder struct {
	*memory.Source
	mu     sync.Mutex
	bodies []string
	delays []time.Duration
}

func (s *nackRecorder) Nack(ctx context.Context, ns []adapters.Nack) error {
	s.mu.Lock()
	for _, n := range ns {
		s.bodies = append(s.bodies, string(n.Delivery.Body))
		s.delays = append(s.delays, n.After)
	}
	s.mu.Unlock()
	return s.Source.Nack(ctx, ns)
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
	g := newGroupWithLoss(t, 3, "a1")
	g.run(t, 3, consumer.WithLeaveUnfinishedOnShutdown())
	if bodies, _ := g.src.nacked(); !slices.Equal(bodies, []string{"a2", "a3"}) {
		t.Fatalf("nacked %v; want a2 and a3, queued behind the lost a1, given back at once", bodies)
	}
}
