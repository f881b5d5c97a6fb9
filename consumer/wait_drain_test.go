package consumer

import (
	"context"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
)

// A retry whose backoff ends as the drain begins must not start: once the
// drain has begun, a message no handler runs for is given back (see
// process). With the timer and the drain both ready when the worker reaches
// its select, the select picks one at random, so wait must look at the drain
// again after the timer.
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
	c, err := New(src, HandlerFunc(func(context.Context, *Message) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	r := newRun(c, ctx)
	r.draining.Store(true)
	close(r.drainCh)
	started := 0
	for range 200 {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ds, err := src.Receive(rctx, 1)
		cancel()
		if err != nil || len(ds) != 1 {
			t.Fatalf("Receive = %d deliveries, %v; want the message given back", len(ds), err)
		}
		j := &job{d: ds[0]}
		r.held.Add(1)
		r.credit.mu.Lock()
		r.credit.held++ // as the receiver would have taken it
		r.credit.mu.Unlock()
		if r.wait(j, time.Nanosecond) {
			started++
			r.settle(j, released(whyShutdown))
		}
	}
	if started > 0 {
		t.Errorf("%d of 200 retries started after the drain had begun, want none", started)
	}
}
