package rabbitmq

import (
	"context"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// TestDelayedRetriesLeaveTheWindow: with delay queues, retries wait in a
// delay queue, not in the prefetch window, so that a burst of failures
// never stops the consumer from receiving new messages while they wait.
func TestDelayedRetriesLeaveTheWindow(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "bad1", "bad2", "bad3", "bad4")
	s := openSource(t, q, WithPrefetch(4), WithDelayQueues())
	ctx := context.Background()
	bad := receiveN(t, s, 4)
	for _, d := range bad {
		if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 3*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	a.publish(q, "good1", "good2")
	rctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	var got []*adapters.Delivery
	for len(got) < 2 {
		ds, err := s.Receive(rctx, 2-len(got))
		if err != nil {
			t.Fatalf("received %v within 1.5s while four retries wait 3s: the waiting retries fill the prefetch window (%v)", bodies(got), err)
		}
		got = append(got, ds...)
	}
	if err := s.Ack(ctx, got); err != nil {
		t.Fatal(err)
	}
}

// TestPrefetchOneWithDelayQueues: with a prefetch of 1 a retry waiting in
// place would be the whole window, and the broker would send nothing else
// until it ended. With delay queues, even a short retry goes through one.
func TestPrefetchOneWithDelayQueues(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, "bad", "good")
	s := openSource(t, q, WithPrefetch(1), WithDelayQueues())
	ctx := context.Background()
	bad := receiveN(t, s, 1)
	if err := s.Nack(ctx, adapters.NackAll(bad, 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 1 {
		t.Fatalf("stats %+v: with prefetch 1 the retry must go through a delay queue, not hold the only slot", st)
	}
	var got []*adapters.Delivery
	for len(got) < 2 { // the good one, then the retry's copy, one at a time
		d := receiveN(t, s, 1)
		if err := s.Ack(ctx, d); err != nil {
			t.Fatal(err)
		}
		got = append(got, d...)
	}
	if string(got[0].Body) != "good" || string(got[1].Body) != "bad" || got[1].Attempt != 2 {
		t.Fatalf("received %v (attempt of the second %d), want good, then bad at attempt 2", bodies(got), got[1].Attempt)
	}
	waitUnacked(t, q, 0)
}

// TestPrefetchBoundsWhatTheBrokerSends: the channel's QoS is the prefetch,
// so the broker never has more than that many deliveries unacked with the
// Source: the rest stay ready in the queue, for other consumers, until acks
// free the window.
func TestPrefetchBoundsWhatTheBrokerSends(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	a.publish(q, names("m", 20)...)
	s := openSource(t, q, WithPrefetch(4))
	within := func() {
		t.Helper()
		delivered := s.Stats().Delivered // before Acked, which only grows
		if acked := s.Stats().Acked; delivered > acked+4 {
			t.Fatalf("the broker sent %d deliveries with %d acked: more than the prefetch of 4 unacked", delivered, acked)
		}
	}
	waitUntil(t, "the window to fill", func() bool { return s.Stats().Delivered >= 4 })
	within()
	if n := a.ready(q); n != 16 {
		t.Fatalf("%d messages ready in the queue with the window full, want 16", n)
	}
	ctx := context.Background()
	for got := 0; got < 20; {
		ds := receiveN(t, s, 1)
		within()
		if err := s.Ack(ctx, ds); err != nil {
			t.Fatal(err)
		}
		got += len(ds)
	}
	waitUnacked(t, q, 0)
	within()
}
