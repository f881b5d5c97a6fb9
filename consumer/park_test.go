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

// A retry waiting in place holds no worker: with one worker, a message
// waiting out a long backoff (a broker without delayed redelivery) does not
// keep the next message from running, and its lease is kept alive all the
// while.
func TestRetryWaitingInPlaceHoldsNoWorker(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("slow-retry", "next")
	var retried atomic.Int32
	handled := make(chan string, 4)
	r := runOn(t, inPlaceSource{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "slow-retry" && retried.Add(1) == 1 {
			return consumer.RetryAfter(errors.New("not yet"), time.Hour)
		}
		handled <- string(m.Body)
		return nil
	}, consumer.WithConcurrency(1))
	if got := await(t, "the next message handled", handled); got != "next" {
		t.Fatalf("handled %q first, want next", got)
	}
	// Three leases later the waiting message is still held, not redelivered.
	time.Sleep(time.Second)
	if n := retried.Load(); n != 1 {
		t.Fatalf("the waiting message was attempted %d times, want once: its lease ran out", n)
	}
	if s := e.stats("q"); s.Received != 2 {
		t.Fatalf("%d receives, want 2: the waiting message was redelivered", s.Received)
	}
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Visible != 1 {
		t.Fatalf("after shutdown %+v, want the waiting message given back", s)
	}
}

// A parked job of an ordered lane keeps its lane: the lane's next message
// waits behind it, while other lanes run.
func TestParkedJobKeepsItsLane(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("a", "a1", "a2")
	e.publishKeyed("b", "b1")
	release := make(chan struct{})
	var order []string
	done := make(chan string, 8)
	runOn(t, inPlaceSource{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a1" && m.Attempt == 1 {
			select {
			case <-release:
			default:
				return consumer.RetryAfter(errors.New("not yet"), 200*time.Millisecond)
			}
		}
		done <- string(m.Body)
		return nil
	}, consumer.WithConcurrency(1), consumer.WithOrdering(consumer.OrderByKey))
	first := await(t, "a message of another lane", done)
	if first != "b1" {
		t.Fatalf("%s ran first, want b1 while a1 waits", first)
	}
	close(release)
	for len(order) < 2 {
		order = append(order, await(t, "lane a", done))
	}
	if order[0] != "a1" || order[1] != "a2" {
		t.Fatalf("lane a ran %v, want [a1 a2]", order)
	}
}

// A parked job whose delivery is lost leaves at once, not at the end of its
// wait.
func TestParkedJobLostLeavesAtOnce(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("m")
	src := e.source()
	src.SetFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		return adapters.ErrLeaseLost // every renewal refused: the lease is lost
	}})
	var attempts atomic.Int32
	runOn(t, inPlaceSource{src}, func(ctx context.Context, m *consumer.Message) error {
		attempts.Add(1)
		return consumer.RetryAfter(errors.New("not yet"), time.Hour)
	}, consumer.WithName("parked"), consumer.WithMeterProvider(mp))
	waitFor(t, "the lost delivery settled", func() bool {
		return collectAll(t, reader).points["custody.messages.settled/lost"] == 1
	})
	if n := attempts.Load(); n != 1 {
		t.Fatalf("%d attempts, want 1", n)
	}
}

// leaselessSource hides the memory broker's lease, as RabbitMQ holds
// deliveries: no lease to renew, nothing to lose.
type leaselessSource struct{ *memory.Source }

func (s leaselessSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.Lease, c.NackDelay = 0, false
	return c
}

// Without a lease, a message waiting in place is given back once it has
// been held for the maximum processing time, however long its backoff:
// RabbitMQ's consumer timeout would otherwise close the channel under
// every delivery it carries.
func TestParkedJobWithoutALeaseIsGivenBackAtTheHoldCap(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("m")
	var attempts atomic.Int32
	runOn(t, leaselessSource{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		attempts.Add(1)
		return consumer.RetryAfter(errors.New("not yet"), time.Hour)
	}, consumer.WithMaxProcessingTime(300*time.Millisecond))
	// Given back at the cap, the message is received again and run again,
	// long before its hour of backoff.
	waitFor(t, "the message given back at the cap and run again", func() bool { return attempts.Load() >= 2 })
	if s := e.stats("q"); s.Received < 2 {
		t.Fatalf("stats %+v, want the message received again", s)
	}
}
