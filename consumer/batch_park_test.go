package consumer_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// failingOnceDeadLetter refuses its first write, as a destination with a
// short outage does, and passes the later ones on.
type failingOnceDeadLetter struct {
	adapters.DeadLetter
	calls atomic.Int32
}

func (f *failingOnceDeadLetter) Send(ctx context.Context, d *adapters.Delivery, fl adapters.Failure) error {
	if f.calls.Add(1) == 1 {
		return errors.New("dead-letter destination briefly unavailable")
	}
	return f.DeadLetter.Send(ctx, d, fl)
}

// stopWithin stops r and fails the test if Run has not returned within d.
func stopWithin(t *testing.T, r *running, d time.Duration) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- r.stop() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(d):
		t.Fatalf("Run did not return within %v of the shutdown: a message it held was never settled", d)
	}
}

// A message of a batch whose dead-letter write failed waits in place for
// the next write; once that one is confirmed, the original is acked, as it
// is for a Handler's message.
func TestBatchDeadLetterRetriedInPlaceIsAcked(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("poison", "ok")
	dl := &failingOnceDeadLetter{DeadLetter: e.dlq()}
	r := runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		for _, m := range b.Messages {
			if string(m.Body) == "poison" {
				b.Fail(m, consumer.Permanent(errors.New("cannot parse")))
				continue
			}
			b.Done(m)
		}
		return nil
	}, fastRetry(3), consumer.WithDeadLetter(dl))
	waitFor(t, "the dead-letter copy, after a failed write", func() bool { return e.stats("dlq").Visible == 1 })
	waitFor(t, "the original acked once its copy was confirmed", func() bool { return e.stats("q").Acked == 2 })
	stopWithin(t, r, 5*time.Second)
	if s := e.stats("q"); s.InFlight != 0 || s.Visible != 0 {
		t.Fatalf("queue %+v after the run: the dead-lettered original was not acked", s)
	}
}

// A lane's message of a batch that waits in place for its retry, when the
// shutdown begins, is given back, and so are the lane's messages queued
// behind it: the drain ends.
func TestBatchLaneWaitingForARetryDrains(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("a", "a1", "a2", "a3")
	var calls atomic.Int32
	r := runBatch(t, e.source(), func(ctx context.Context, b *consumer.Batch) error {
		calls.Add(1)
		for _, m := range b.Messages {
			b.Fail(m, errors.New("not yet"))
		}
		return nil
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 10, Backoff: consumer.ConstantBackoff(time.Hour)}),
		consumer.WithOrdering(consumer.OrderByKey), consumer.WithBatchLinger(20*time.Millisecond))
	waitFor(t, "the first batch", func() bool { return calls.Load() > 0 })
	waitFor(t, "a1 waiting for its retry", func() bool { return e.stats("q").InFlight == 3 })
	stopWithin(t, r, 5*time.Second)
	if s := e.stats("q"); s.Visible != 3 || s.Acked != 0 {
		t.Fatalf("queue %+v after the shutdown, want the lane's three messages given back", s)
	}
}
