package adaptertest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
)

// testWaitingDeliveriesKeepTheirLease checks that the runtime keeps alive the
// lease of every delivery it holds, not only of those whose handler runs: a
// consumer with one worker takes several messages at once, and while the
// first runs for three leases the others wait for the worker. A second
// consumer on the queue must not be handed the waiting ones: every message is
// handled once, on its first delivery where the broker counts deliveries.
// NoConcurrentDuplicateUnderLongHandler does not show this: there every
// message held has a worker of its own.
func testWaitingDeliveriesKeepTheirLease(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	bodies := publishN(t, q, 4, "")
	rec := newRecorder()
	var (
		mu       sync.Mutex
		slow     string // the body the first handler call got
		slowDone bool
	)
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		mu.Lock()
		first := slow == ""
		if first {
			slow = string(m.Body)
		}
		mu.Unlock()
		if !first {
			return nil
		}
		select {
		case <-time.After(3 * q.Lease):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		mu.Lock()
		slowDone = true
		mu.Unlock()
		return nil
	})
	srcA := q.Open(t)
	counts := srcA.Capabilities().CountsDeliveries
	// In-flight room for twice the messages: the runtime asks for all of them
	// in its first Receive, so they are held before the first handler runs.
	a := start(t, srcA, handler, consumer.WithConcurrency(1), consumer.WithMaxInFlight(2*len(bodies)))
	waitFor(t, "the first handler running", func() bool { return rec.total() >= 1 })
	b := start(t, q.Open(t), handler, consumer.WithConcurrency(len(bodies)))
	waitFor(t, "every message handled and the long handler done", func() bool {
		mu.Lock()
		done := slowDone
		mu.Unlock()
		return done && rec.distinct() == len(bodies)
	})
	stopAndExpectOnce(t, rec, bodies, counts, "while it waited for a worker", a, b)
}

// stopAndExpectOnce stops the consumers, then checks that every one of
// bodies was handled exactly once, and, where the broker counts deliveries,
// on its first. A second handling means the message's lease ran out at the
// moment where names ("while it waited for a worker").
func stopAndExpectOnce(t *testing.T, rec *recorder, bodies []string, counts bool, where string, consumers ...*started) {
	t.Helper()
	for _, c := range consumers {
		if err := c.stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for _, body := range bodies {
		got := rec.attempts[body]
		if len(got) != 1 {
			t.Errorf("message %q handled %d times (attempts %v), want once: its lease ran out %s", body, len(got), got, where)
			continue
		}
		if counts && got[0] != 1 {
			t.Errorf("message %q handled on delivery %d, want 1: its lease ran out %s, and the broker delivered it again", body, got[0], where)
		}
	}
}

// testShutdownKeepsLeasesWhileDraining checks that the drain keeps leases
// alive: once shutdown begins, a handler still running is let finish, and
// until it does its lease must be renewed as before, or the broker hands the
// message to another consumer while it runs. ShutdownDrains does not show
// this: its handlers finish well within a lease.
func testShutdownKeepsLeasesWhileDraining(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	bodies := publishN(t, q, 1, "")
	rec := newRecorder()
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if rec.record(m) > 1 {
			return nil
		}
		select {
		case <-time.After(3 * q.Lease):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	srcA := q.Open(t)
	counts := srcA.Capabilities().CountsDeliveries
	a := start(t, srcA, handler, consumer.WithShutdownTimeout(patience))
	waitFor(t, "the handler running", func() bool { return rec.total() >= 1 })
	stopped := make(chan error, 1)
	go func() { stopped <- a.stop() }()
	// Another consumer on the queue, as during a rolling deploy: it must not
	// get the message while the first consumer's drain runs its handler.
	b := start(t, q.Open(t), handler)
	if err := <-stopped; err != nil {
		t.Errorf("Run: %v", err)
	}
	if err := b.stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	got := rec.attempts[bodies[0]]
	if len(got) != 1 {
		t.Fatalf("message handled %d times (attempts %v), want once: its lease ran out while the shutdown drained its handler", len(got), got)
	}
	if counts && got[0] != 1 {
		t.Errorf("message handled on delivery %d, want 1", got[0])
	}
}
