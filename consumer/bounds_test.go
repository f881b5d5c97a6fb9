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
	"github.com/custody-go/custody/internal/testkit/testlog"
	"github.com/custody-go/custody/lease"
)

// boundedSource is a memory source that, like SQS, receives at most
// maxReceive per call, and counts the deliveries handed to the runtime that
// were not yet acked or nacked.
type boundedSource struct {
	*memory.Source
	maxReceive int

	mu         sync.Mutex
	held, peak int
}

func (s *boundedSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.MaxReceive = s.maxReceive
	return c
}

func (s *boundedSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, n)
	s.mu.Lock()
	s.held += len(ds)
	s.peak = max(s.peak, s.held)
	s.mu.Unlock()
	return ds, err
}

func (s *boundedSource) settled(n int) {
	s.mu.Lock()
	s.held -= n
	s.mu.Unlock()
}

func (s *boundedSource) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	s.settled(len(ds))
	return s.Source.Ack(ctx, ds)
}

func (s *boundedSource) Nack(ctx context.Context, ns []adapters.Nack) error {
	s.settled(len(ns))
	return s.Source.Nack(ctx, ns)
}

// TestInFlightNeverExceedsMaxInFlight: with a source whose receive batch is
// as large as the in-flight bound, the runtime never holds more deliveries
// than WithMaxInFlight allows, however the acks free room.
func TestInFlightNeverExceedsMaxInFlight(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 5 * time.Second})
	for i := 0; i < 60; i++ {
		e.publish(string(rune('a' + i%26)))
	}
	src := &boundedSource{Source: e.source(), maxReceive: 4}
	var handled atomic.Int32
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		time.Sleep(time.Duration(1+handled.Add(1)%3) * 5 * time.Millisecond)
		return nil
	}), consumer.WithLogger(testlog.New(t)), consumer.WithConcurrency(4), consumer.WithMaxInFlight(4))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, "all handled", func() bool { return e.stats("q").Acked == 60 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if src.peak > 4 {
		t.Fatalf("the runtime held %d deliveries at once, above WithMaxInFlight(4)", src.peak)
	}
}

// TestMaxInFlightOfOneReceivesAfterEachAck: with room for one delivery, the
// ack that frees it wakes the receiver for the next. The room it frees
// brings the runtime down to its wake-up mark exactly (none held): a wake
// only below that mark left the receiver waiting for good after the first
// message.
func TestMaxInFlightOfOneReceivesAfterEachAck(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("a", "b", "c")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		return nil
	}, consumer.WithMaxInFlight(1))
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == 3 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
}

// TestAtMostOnceFailedEarlyAckIsNotHandled: in at-most-once mode a delivery
// whose early ack failed comes back from the broker; handling it now as well
// would run it twice, which the mode promised never to do.
func TestAtMostOnceFailedEarlyAckIsNotHandled(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 50 * time.Millisecond})
	e.publish("a")
	src := e.sourceLosingFirstAck()
	cnt := newCounter()
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		cnt.inc(m.Body)
		return nil
	}, consumer.WithAtMostOnceAckBeforeProcessingUnsafe())
	waitFor(t, "acked on the redelivery", func() bool { return e.stats("q").Acked == 1 })
	waitFor(t, "handled", func() bool { return cnt.get("a") >= 1 })
	time.Sleep(150 * time.Millisecond) // room for a second, wrong, run
	r.stop()
	if n := cnt.get("a"); n != 1 {
		t.Fatalf("handled %d times in at-most-once mode, want 1", n)
	}
}

// TestDeadLetterFirstFailureSpansRedeliveries: when the retries went through
// the broker (one delivery per attempt), the dead letter's first-failure time
// is the first attempt's, not the last delivery's.
func TestDeadLetterFirstFailureSpansRedeliveries(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("poison")
	var first atomic.Int64
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		first.CompareAndSwap(0, time.Now().UnixNano())
		return errors.New("bad input")
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(150 * time.Millisecond)}),
		consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	ms, _ := e.b.Messages("dlq")
	h := ms[0].Headers
	ff, err1 := time.Parse(time.RFC3339Nano, h[adapters.HeaderFirstFailure])
	lf, err2 := time.Parse(time.RFC3339Nano, h[adapters.HeaderLastFailure])
	if err1 != nil || err2 != nil {
		t.Fatalf("diagnostic times: %v %v (%v)", err1, err2, h)
	}
	if lf.Sub(ff) < 250*time.Millisecond {
		t.Fatalf("first failure %v, last %v: three attempts 150ms apart must span at least 300ms", ff, lf)
	}
	if d := ff.Sub(time.Unix(0, first.Load())); d > 100*time.Millisecond || d < -time.Second {
		t.Fatalf("first failure is %v after the first attempt", d)
	}
}

// A delivery whose lease is lost while it waits out a retry's backoff in
// place (here an ordered lane, which never nacks) stops waiting at once: it
// is settled as lost, frees its lane and its in-flight slot, and the broker's
// redelivery runs instead of queuing behind an hour-long wait.
func TestLeaseLostDuringABackoffEndsTheWait(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 150 * time.Millisecond})
	if err := e.b.Publish(context.Background(), "q", memory.Message{Key: "k", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(d *adapters.Delivery) error {
		if d.Attempt == 1 {
			return fmt.Errorf("taken back: %w", adapters.ErrLeaseLost)
		}
		return nil
	}}))
	var attempts atomic.Int32
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		if attempts.Add(1) == 1 {
			return consumer.RetryAfter(errors.New("try much later"), time.Hour)
		}
		return nil
	}, consumer.WithOrdering(consumer.OrderByKey))
	waitFor(t, "the redelivery handled", func() bool { return e.stats("q").Acked == 1 })
	r.stop()
	if n := attempts.Load(); n != 2 {
		t.Fatalf("%d handler calls, want the first and the broker's redelivery", n)
	}
}

// partialFailureSource returns an error with every batch of deliveries, as a
// Kafka source does when one partition fails among others that deliver.
type partialFailureSource struct {
	*memory.Source
}

func (s partialFailureSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.MaxReceive = 1
	return c
}

func (s partialFailureSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, n)
	if err == nil && len(ds) > 0 {
		err = errors.New("partition 7: not authorised")
	}
	return ds, err
}

// TestPartialReceiveFailuresDoNotStallTheRest: deliveries a source returns
// together with an error are handled, and the error does not make the
// runtime back off as from a failed receive: with the backoff, each of these
// 40 receives waited longer than the last, up to 5 s, and the queue took
// minutes to drain.
func TestPartialReceiveFailuresDoNotStallTheRest(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 5 * time.Second})
	for i := 0; i < 40; i++ {
		e.publish(fmt.Sprint(i))
	}
	var handled atomic.Int32
	r := runOn(t, partialFailureSource{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		handled.Add(1)
		return nil
	})
	defer r.stop()
	waitFor(t, "every delivery handled", func() bool { return e.stats("q").Acked == 40 })
	if n := handled.Load(); n != 40 {
		t.Errorf("handled %d deliveries; want 40", n)
	}
}

// TestDeferAndRetryAfterWaitAtLeastTheFloor: a delay asked for with Defer or
// RetryAfter is floored like the policy's backoff. A deferral never runs out
// of attempts, so Defer(err, time.Nanosecond) (an idempotency
// WithOverlapRetryDelay of 1ns) otherwise had the broker redeliver the
// message at once, in a loop, for as long as the original ran elsewhere.
func TestDeferAndRetryAfterWaitAtLeastTheFloor(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("deferred", "retried")
	src := &nackRecorder{Source: e.source()}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt > 3 {
			return nil
		}
		if string(m.Body) == "deferred" {
			return consumer.Defer(errors.New("original still running"), time.Nanosecond)
		}
		return consumer.RetryAfter(errors.New("busy"), time.Nanosecond)
	})
	defer r.stop()
	waitFor(t, "both acked", func() bool { return e.stats("q").Acked == 2 })
	bodies, delays := src.nacked()
	if len(delays) != 6 {
		t.Fatalf("nacked %v, want each message three times", bodies)
	}
	for i, d := range delays {
		if d < time.Millisecond {
			t.Fatalf("%s nacked with a redelivery delay of %v: retries hot-loop through the broker", bodies[i], d)
		}
	}
}

// TestFailedReceivesAreRetriedWithBackoff: a Receive that fails (the broker
// unreachable for a while) is tried again after a growing, jittered wait
// (50 ms doubling, up to half taken off), not in a loop that floods the
// broker and the log; once it answers again, everything is handled.
func TestFailedReceivesAreRetriedWithBackoff(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 5 * time.Second})
	e.publish("a", "b", "c")
	const failures = 3
	var mu sync.Mutex
	var calls []time.Time
	src := e.source(memory.WithFaults(memory.Faults{Receive: func() error {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, time.Now())
		if len(calls) <= failures {
			return errors.New("connection refused")
		}
		return nil
	}}))
	r := runOn(t, src, func(context.Context, *consumer.Message) error { return nil })
	defer r.stop()
	waitFor(t, "every message acked once the broker answers", func() bool { return e.stats("q").Acked == 3 })
	mu.Lock()
	defer mu.Unlock()
	// The n-th failure waits at least half of 50ms·2^(n-1) before the next
	// try. Lower bounds only: a slow machine can only make the gaps longer.
	for n := 1; n <= failures; n++ {
		least := 25 * time.Millisecond << (n - 1)
		if gap := calls[n].Sub(calls[n-1]); gap < least {
			t.Errorf("try %d came %v after failure %d; want at least %v", n+1, gap, n, least)
		}
	}
}

// leaseAgeSource is a memory source whose broker caps how long a delivery
// may be held (as SQS caps it at 12 hours from the receive).
type leaseAgeSource struct {
	*memory.Source
	maxAge time.Duration
}

func (s leaseAgeSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.MaxLeaseAge = s.maxAge
	return c
}

// TestProcessingTimeIsCappedByTheOptionAndTheBroker: a handler that runs past
// the maximum processing time has its context cancelled with a lost lease
// as the cause (lease.ErrMaxHold), and its message is redelivered. The cap
// is WithMaxProcessingTime, or the broker's own (Capabilities.MaxLeaseAge)
// where that is shorter.
func TestProcessingTimeIsCappedByTheOptionAndTheBroker(t *testing.T) {
	const held = 300 * time.Millisecond
	for _, tc := range []struct {
		name   string
		maxAge time.Duration
		opts   []consumer.Option
	}{
		{"option", 0, []consumer.Option{consumer.WithMaxProcessingTime(held)}},
		{"broker", held, []consumer.Option{consumer.WithMaxProcessingTime(time.Hour)}},
		{"broker with the default", held, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Second})
			e.publish("long")
			causes := make(chan error, 1)
			r := runOn(t, leaseAgeSource{Source: e.source(), maxAge: tc.maxAge}, func(ctx context.Context, m *consumer.Message) error {
				if m.Attempt > 1 {
					return nil
				}
				select {
				case <-ctx.Done():
					causes <- context.Cause(ctx)
				case <-time.After(patience):
					causes <- errors.New("the handler's context outlived the cap")
				}
				return ctx.Err()
			}, tc.opts...)
			if cause := await(t, "the first attempt to end", causes); !errors.Is(cause, lease.ErrMaxHold) {
				t.Fatalf("handler's context cause = %v, want lease.ErrMaxHold", cause)
			}
			waitFor(t, "the redelivery acked", func() bool { return e.stats("q").Acked == 1 })
			if err := r.stop(); err != nil {
				t.Fatal(err)
			}
		})
	}
}
