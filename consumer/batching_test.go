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

// lingeringSource is a memory source that asks the runtime to linger to
// fill its ack batches, as the SQS adapter does.
type lingeringSource struct {
	*memory.Source
	linger   time.Duration
	maxBatch int
}

func (s lingeringSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.Ack = adapters.Batching{MaxEntries: s.maxBatch, Linger: s.linger, MaxCalls: 4}
	return c
}

// TestAckLingerBoundsTheWaitOfTheFirstAck: an ack waits at most the
// adapter's Capabilities.Ack.Linger for others to fill its batch, however many others
// trickle in meanwhile. The linger started again with every ack that joined
// the batch, so under a steady trickle the first ack waited until the batch
// was full: here, with acks coming faster than the linger, until the stream
// stopped.
func TestAckLingerBoundsTheWaitOfTheFirstAck(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const n = 300
	for i := 0; i < n; i++ {
		e.publish(fmt.Sprint(i))
	}
	const linger = 200 * time.Millisecond
	src := lingeringSource{Source: e.source(), linger: linger, maxBatch: 1000}
	tick := make(chan struct{})
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-tick:
		case <-ctx.Done():
			return ctx.Err()
		}
		return nil
	}, consumer.WithMaxInFlight(1000))
	// Finish a message every 5 ms, far more often than the linger, and stop
	// as soon as one ack has gone out.
	acked := int64(0)
	for i := 0; i < n && acked == 0; i++ {
		tick <- struct{}{}
		time.Sleep(linger / 40)
		acked = e.stats("q").Acked
	}
	close(tick) // let the running handler finish
	r.stop()
	if acked == 0 {
		t.Fatalf("no ack sent while %d messages finished over more than %v: a ready ack waited longer than the %v linger", n, n*linger/40, linger)
	}
}

// failingAckCalls is a memory source whose first failures Ack calls fail
// as a whole, without reaching the broker, as a dropped connection does.
type failingAckCalls struct {
	*memory.Source
	failures atomic.Int32
}

func (s *failingAckCalls) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	if s.failures.Add(-1) >= 0 {
		return errors.New("connection reset by peer")
	}
	return s.Source.Ack(ctx, ds)
}

// TestAckFailingAsAWholeIsTriedAgain: an ack call that fails as a whole
// (no entry succeeded, so repeating it repeats nothing) is tried again, up
// to three calls, before the runtime gives up on it and counts a failure:
// a brief network error does not turn a handled message into a duplicate.
func TestAckFailingAsAWholeIsTriedAgain(t *testing.T) {
	reader, mp := newMeter()
	// Given up on, the ack would bring the message back once this lease
	// ran out, to be handled twice.
	e := newEnv(t, memory.QueueOptions{Lease: 2 * time.Second})
	e.publish("x")
	src := &failingAckCalls{Source: e.source()}
	src.failures.Store(2)
	calls := newCounter()
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		calls.inc(m.Body)
		return nil
	}, consumer.WithName("acks"), consumer.WithMeterProvider(mp))
	waitFor(t, "the message acked", func() bool { return e.stats("q").Acked == 1 })
	c := stopAndCollect(t, r, reader, "acks")
	c.want(map[string]int64{
		"custody.messages.settled/acked": 1,
		"custody.ack.failures":           0,
	})
	if n := calls.get("x"); n != 1 {
		t.Errorf("handled %d times, want once", n)
	}
}

// batchLimitSource is a memory source with an ack batch limit and no linger
// (the runtime's workers group the acks), whose first Ack call waits until
// the handler has started hold times, so that acks pile up behind it.
type batchLimitSource struct {
	*memory.Source
	t       *testing.T
	limit   int
	hold    int32
	started atomic.Int32

	mu      sync.Mutex
	calls   int
	largest int
}

func (s *batchLimitSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.Ack.MaxEntries = s.limit
	return c
}

func (s *batchLimitSource) Ack(ctx context.Context, ds []*adapters.Delivery) error {
	s.mu.Lock()
	s.calls++
	first := s.calls == 1
	s.largest = max(s.largest, len(ds))
	s.mu.Unlock()
	if first {
		// At most one worker waits here; the other goes on handling and
		// queueing acks behind this call.
		deadline := time.Now().Add(patience)
		for s.started.Load() < s.hold {
			if time.Now().After(deadline) {
				s.t.Errorf("only %d handlers started while the first ack call waited, want %d", s.started.Load(), s.hold)
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	return s.Source.Ack(ctx, ds)
}

// TestAcksPiledUpBehindACallKeepTheBatchLimit: acks that gather while an
// ack call is on the wire are sent in calls of at most the adapter's
// Ack.MaxEntries (SQS: ten per DeleteMessageBatch), not in one call.
func TestAcksPiledUpBehindACallKeepTheBatchLimit(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	const n = 10
	for i := 0; i < n; i++ {
		e.publish(fmt.Sprint(i))
	}
	// With 8 handlers started, at least 6 have returned and queued their
	// acks (at most one per worker still runs); at most 2 are in the first
	// call, so at least 4 are left for the calls after it.
	src := &batchLimitSource{Source: e.source(), t: t, limit: 2, hold: 8}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		src.started.Add(1)
		return nil
	}, consumer.WithConcurrency(2))
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == n })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	src.mu.Lock()
	defer src.mu.Unlock()
	if src.largest > src.limit {
		t.Fatalf("an ack call carried %d deliveries; the adapter takes at most %d", src.largest, src.limit)
	}
}
