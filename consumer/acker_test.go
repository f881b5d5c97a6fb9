package consumer_test

import (
	"context"
	"fmt"
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
	c.AckLinger = s.linger
	c.MaxAckBatch = s.maxBatch
	return c
}

// TestAckLingerBoundsTheWaitOfTheFirstAck: an ack waits at most the
// adapter's AckLinger for others to fill its batch, however many others
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
