package consumer_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
)

var errStoreDown = errors.New("store: connection refused")

// recordingBackoff records the retry numbers it is asked for.
type recordingBackoff struct {
	mu sync.Mutex
	ns []int
}

func (b *recordingBackoff) Delay(n int) time.Duration {
	b.mu.Lock()
	b.ns = append(b.ns, n)
	b.mu.Unlock()
	return time.Millisecond
}

func (b *recordingBackoff) asked() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]int(nil), b.ns...)
}

// An outage that outlasts MaxAttempts neither uses up the message's
// attempts nor dead-letters it: the message waits in place (no redelivery,
// so the broker's receive count stays at one) and is acked once the
// dependency answers again.
func TestUnavailableDependencyUsesUpNoAttempt(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second, MaxReceiveCount: 2})
	e.publish("order-1")
	const outage = 12 // attempts that find the dependency down: far past MaxAttempts
	var calls atomic.Int32
	attempts := make(chan int, outage+1)
	done := make(chan struct{})
	bo := &recordingBackoff{}
	run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		attempts <- m.Attempt
		if calls.Add(1) <= outage {
			return consumer.Unavailable(errStoreDown)
		}
		close(done)
		return nil
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 2, Backoff: bo}), consumer.WithDeadLetter(e.dlq()))
	await(t, "the handler to succeed after the outage", done)
	if err := e.b.WaitEmpty(context.Background(), "q"); err != nil {
		t.Fatal(err)
	}
	close(attempts)
	for a := range attempts {
		if a != 1 {
			t.Fatalf("Message.Attempt = %d during the outage, want 1 throughout: an unavailable attempt used up an attempt", a)
		}
	}
	if n := e.stats("dlq").Visible; n != 0 {
		t.Fatalf("%d dead letters: a dependency outage dead-lettered a good message", n)
	}
	// The backoff grows with each consecutive unavailable attempt.
	got := bo.asked()
	if len(got) != outage {
		t.Fatalf("backoff asked %d times (%v), want %d", len(got), got, outage)
	}
	for i, n := range got {
		if n != i+1 {
			t.Fatalf("backoff asked for retries %v, want 1, 2, 3, ...", got)
		}
	}
}

// The waits of one outage do not count as failures of the message: once
// the dependency is back, a failure of the message's own still has every
// attempt of the policy.
func TestUnavailableThenOwnFailuresGetEveryAttempt(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("m")
	var calls atomic.Int32
	run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) <= 5 {
			return consumer.Unavailable(errStoreDown)
		}
		return errors.New("the message's own failure")
	}, fastRetry(3), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	msgs, err := e.b.Messages("dlq")
	if err != nil {
		t.Fatal(err)
	}
	if got := msgs[0].Headers[adapters.HeaderAttempts]; got != "3" {
		t.Fatalf("dead letter says %s attempts, want 3: the unavailable attempts were counted", got)
	}
	if got := calls.Load(); got != 5+3 {
		t.Fatalf("handler called %d times, want 5 unavailable + 3 failed", got)
	}
}

// Unavailable wins over Permanent: a message is never dead-lettered for a
// dependency's fault.
func TestUnavailableAndPermanentIsUnavailable(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("m")
	var calls atomic.Int32
	run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) <= 3 {
			return consumer.Permanent(consumer.Unavailable(errStoreDown))
		}
		return nil
	}, fastRetry(1), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the ack", func() bool { return e.stats("q").Acked == 1 })
	if n := e.stats("dlq").Visible; n != 0 {
		t.Fatalf("%d dead letters, want none", n)
	}
}

// A message waiting out an outage is given back at shutdown, at once.
func TestUnavailableWaitIsGivenBackAtShutdown(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("m")
	waiting := make(chan struct{}, 1)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		select {
		case waiting <- struct{}{}:
		default:
		}
		return consumer.RetryAfter(consumer.Unavailable(errStoreDown), time.Hour)
	}, consumer.WithDeadLetter(e.dlq()))
	await(t, "the first attempt", waiting)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Visible != 1 || s.InFlight != 0 {
		t.Fatalf("after shutdown: %+v, want the message ready again (given back, not left to its one-minute lease)", s)
	}
}

// A dead-letter destination that fails is tried again in place: the handler
// does not run again and the broker does not redeliver (its receive count
// would climb), and the copy is written once the destination recovers.
func TestFailingDeadLetterWaitsInPlace(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("poison")
	dlq := e.dlq()
	var writes atomic.Int32
	dlq.SetFault(func(*adapters.Delivery) error {
		if writes.Add(1) <= 4 {
			return errors.New("dead-letter queue unreachable")
		}
		return nil
	})
	var calls atomic.Int32
	run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		if m.Attempt != 1 {
			t.Errorf("Message.Attempt = %d: the message was redelivered while its dead-letter write failed", m.Attempt)
		}
		return consumer.Permanent(errors.New("cannot parse"))
	}, fastRetry(3), consumer.WithDeadLetter(dlq))
	waitFor(t, "the dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	if got := calls.Load(); got != 1 {
		t.Fatalf("handler ran %d times, want once: a failed dead-letter write ran it again", got)
	}
	if got := writes.Load(); got != 5 {
		t.Fatalf("%d dead-letter writes, want 5 (4 failed, then one)", got)
	}
}
