package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

// A message retried in place (the broker cannot delay a redelivery, so the
// runtime waits with the lease kept alive) reaches the dead-letter
// destination with the time of its first failure, not of its last: the
// header must fall between the first attempt's return and the second
// attempt's start. TestDeadLetterFirstFailureSpansRedeliveries covers
// retries the broker redelivers, where the broker's first receive bounds it.
func TestDeadLetterFirstFailureOfInPlaceRetries(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("poison")
	var (
		mu     sync.Mutex
		starts []time.Time // when each attempt began
		ends   []time.Time // just before each attempt returned its error
	)
	r := runOn(t, noNackDelay{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		starts = append(starts, time.Now())
		ends = append(ends, time.Now())
		return errors.New("bad input")
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}),
		consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Received != 1 || s.Acked != 1 {
		t.Fatalf("stats %+v: want one delivery, retried in place and acked once dead-lettered", s)
	}
	ms, err := e.b.Messages("dlq")
	if err != nil || len(ms) != 1 {
		t.Fatalf("dead-letter queue holds %d messages (%v), want 1", len(ms), err)
	}
	h := ms[0].Headers
	if h[adapters.HeaderAttempts] != "3" {
		t.Errorf("%s = %q, want 3", adapters.HeaderAttempts, h[adapters.HeaderAttempts])
	}
	first, err1 := time.Parse(time.RFC3339Nano, h[adapters.HeaderFirstFailure])
	last, err2 := time.Parse(time.RFC3339Nano, h[adapters.HeaderLastFailure])
	if err1 != nil || err2 != nil {
		t.Fatalf("failure times: %v, %v (headers %v)", err1, err2, h)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(starts) != 3 {
		t.Fatalf("handler ran %d times, want MaxAttempts=3", len(starts))
	}
	if first.Before(ends[0]) || first.After(starts[1]) {
		t.Errorf("first failure at %v; the first attempt failed at %v and the second began at %v",
			first.Format(time.RFC3339Nano), ends[0].Format(time.RFC3339Nano), starts[1].Format(time.RFC3339Nano))
	}
	if last.Before(ends[2]) {
		t.Errorf("last failure at %v, before the last attempt failed at %v",
			last.Format(time.RFC3339Nano), ends[2].Format(time.RFC3339Nano))
	}
}

// A deferral (consumer.Defer) is no failure of the message, so it does not
// start the first-failure time a dead letter carries: here the message is
// deferred once in place (an ordered lane), then fails for good, and its
// first failure is that second attempt's, not the deferral's.
func TestDeadLetterFirstFailureIsNotADeferral(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("k", "x")
	var (
		mu     sync.Mutex
		starts []time.Time // when each call began
	)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		starts = append(starts, time.Now())
		if len(starts) == 1 {
			return consumer.Defer(errors.New("the original still runs"), 20*time.Millisecond)
		}
		return consumer.Permanent(errors.New("bad input"))
	}, consumer.WithOrdering(consumer.OrderByKey), fastRetry(3), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	ms, err := e.b.Messages("dlq")
	if err != nil || len(ms) != 1 {
		t.Fatalf("dead-letter queue holds %d messages (%v), want 1", len(ms), err)
	}
	first, err := time.Parse(time.RFC3339Nano, ms[0].Headers[adapters.HeaderFirstFailure])
	if err != nil {
		t.Fatalf("first failure header: %v (headers %v)", err, ms[0].Headers)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(starts) != 2 {
		t.Fatalf("handler ran %d times, want twice: deferred, then failed for good", len(starts))
	}
	if first.Before(starts[1]) {
		t.Errorf("first failure at %v, before the failing attempt began at %v: the deferral was taken for a failure",
			first.Format(time.RFC3339Nano), starts[1].Format(time.RFC3339Nano))
	}
}
