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

// stuckDeadLetter is a dead-letter destination whose first write hangs until
// its context ends, as one behind an unreachable destination does; later
// writes go through.
type stuckDeadLetter struct {
	adapters.DeadLetter
	calls atomic.Int32
	cause chan error // the first write's context's cause
}

func (dl *stuckDeadLetter) Send(ctx context.Context, d *adapters.Delivery, f adapters.Failure) error {
	if dl.calls.Add(1) > 1 {
		return dl.DeadLetter.Send(ctx, d, f)
	}
	select {
	case <-ctx.Done():
		dl.cause <- context.Cause(ctx)
		return ctx.Err()
	case <-time.After(patience):
		dl.cause <- errors.New("the write's context was never cancelled")
		return errors.New("stuck")
	}
}

// A dead-letter write under way when the delivery is lost is cut short, as a
// handler is: the broker hands the message out again, and the copy must not
// be written behind the new holder's back.
func TestDeadLetterWriteEndsWhenTheDeliveryIsLost(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("poison")
	var failRenewals atomic.Bool
	failRenewals.Store(true)
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		if failRenewals.Load() {
			return errors.New("renewal refused")
		}
		return nil
	}}))
	dl := &stuckDeadLetter{DeadLetter: e.dlq(), cause: make(chan error, 1)}
	reader, mp := newMeter()
	r := run(t, src, func(context.Context, *consumer.Message) error {
		return consumer.Permanent(errors.New("poison"))
	}, consumer.WithDeadLetter(dl), consumer.WithName("lost"), consumer.WithMeterProvider(mp))

	if cause := await(t, "the first dead-letter write to end", dl.cause); !errors.Is(cause, adapters.ErrLeaseLost) {
		t.Fatalf("the write's context ended with %v, want the lost lease", cause)
	}
	failRenewals.Store(false)
	// The redelivery is dead-lettered once, by the consumer that holds it.
	waitFor(t, "the redelivery's dead-letter copy", func() bool { return e.stats("dlq").Visible == 1 })
	waitFor(t, "the original to be acked", func() bool { return e.stats("q").Acked == 1 })
	if n := dl.calls.Load(); n != 2 {
		t.Errorf("%d dead-letter writes, want 2 (the cut one, then the redelivery's)", n)
	}
	// The cut write is no dead-letter failure: the destination did not
	// fail it, the consumer stopped waiting.
	stopAndCollect(t, r, reader, "lost").want(map[string]int64{
		"custody.messages.settled/lost":          1,
		"custody.messages.settled/dead_lettered": 1,
		"custody.deadletter.failures":            0,
	})
}
