package consumer

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
)

// A retry whose backoff ends as the drain begins must not start: once the
// drain has begun, a message no handler runs for is given back (see
// process), however its wait ended.
func TestRetryDueAsTheDrainBeginsIsGivenBack(t *testing.T) {
	br := memory.NewBroker()
	if err := br.CreateQueue("q", memory.QueueOptions{Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := br.Publish(ctx, "q", memory.Message{Body: []byte("m")}); err != nil {
		t.Fatal(err)
	}
	src, err := br.Source("q")
	if err != nil {
		t.Fatal(err)
	}
	var started atomic.Int32
	c, err := New(src, HandlerFunc(func(context.Context, *Message) error { started.Add(1); return nil }))
	if err != nil {
		t.Fatal(err)
	}
	r := newRun(c, ctx)
	for i := range 200 {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ds, err := src.Receive(rctx, 1)
		cancel()
		if err != nil || len(ds) != 1 {
			t.Fatalf("Receive = %d deliveries, %v; want the message given back", len(ds), err)
		}
		r.giveSignals(ds)
		j := &job{d: ds[0], fail: &failures{err: errors.New("failed"), retryIn: time.Nanosecond}}
		r.held.Add(1)
		r.credit.mu.Lock()
		r.credit.held++ // as the receiver would have taken it
		r.credit.mu.Unlock()
		r.park(j, time.Nanosecond)
		if i%2 == 0 {
			time.Sleep(time.Millisecond) // the wait ends first, or the drain does
		}
		r.draining.Store(true)
		r.process(<-r.work)
		r.draining.Store(false)
		r.nacks.flush()
	}
	if n := started.Load(); n > 0 {
		t.Errorf("%d of 200 retries started after the drain had begun, want none", n)
	}
}
