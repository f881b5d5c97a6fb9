package adaptertest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// The tests in this file check that an adapter leaves timing policy to the
// runtime: it fetches no more than Receive asks for, and renews no lease the
// runtime did not ask it to. An adapter that did either by itself would
// hold messages the runtime does not know it holds. Each test drives Sources
// directly, and watches from a second Source what the first one did.

// receiveUntil calls src.Receive(ctx, max) until done reports true of what
// it received, or wait passes, and returns what it received and whether done
// said so. It fails the test when a call returns more than max or fails
// other than by the end of the wait.
func receiveUntil(t *testing.T, src adapters.Source, max int, wait time.Duration, done func([]*adapters.Delivery) bool) ([]*adapters.Delivery, bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	var got []*adapters.Delivery
	for !done(got) {
		ds, err := src.Receive(ctx, max)
		if len(ds) > max {
			t.Fatalf("Receive(ctx, %d) returned %d deliveries", max, len(ds))
		}
		got = append(got, ds...)
		if ctx.Err() != nil {
			return got, done(got)
		}
		if err != nil {
			t.Fatalf("Receive: %v", err)
		}
	}
	return got, true
}

// longLease is the lease of queues on which no lease may run out during a
// test: a message held by a Source that crashed, or that fetched ahead,
// stays out of reach for longer than any check waits.
const longLease = 2 * patience

// testNoFetchAhead checks, where the broker hands each message to whichever
// consumer asks first, that a Source fetches no more than Receive asks for:
// after one Source received one message of many, another Source can receive
// all the others at once; and again after a Receive with a larger max. A
// Source that fetched ahead would hold them, out of other consumers' reach
// until their leases ran out (or for ever, if it renewed them), while the
// runtime does not know they exist: they would be neither handled nor
// renewed by it. The larger max exceeds what one broker call returns (SQS:
// 10), so that a Source that keeps several calls in flight for it, and
// returns when the first answers, is caught too (most of the time: it is
// caught when a call answers after Receive returned).
func testNoFetchAhead(t *testing.T, h Harness) {
	if h.Dispatch != OnReceive {
		t.Skipf("the broker hands messages out by %v, not to whichever consumer asks first", h.Dispatch)
	}
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	a := q.Open(t)
	defer a.Close()
	b := q.Open(t)
	defer b.Close()
	counts := a.Capabilities().CountsDeliveries
	const n = 40
	for round, max := range []int{1, 25} {
		msgs := make([]Message, n)
		for i := range msgs {
			msgs[i] = Message{Body: []byte(fmt.Sprintf("%s-%d-%d", t.Name(), round, i))}
		}
		publish(t, q, msgs...)
		heldByA := map[string]bool{}
		for _, d := range receiveDirect(t, a, 1, max) {
			heldByA[string(d.Body)] = true
		}
		want := map[string]bool{}
		for _, m := range msgs {
			if !heldByA[string(m.Body)] {
				want[string(m.Body)] = true
			}
		}
		seen := map[string]*adapters.Delivery{}
		_, ok := receiveUntil(t, b, n, h.patience(), func(ds []*adapters.Delivery) bool {
			for _, d := range ds {
				if want[string(d.Body)] {
					seen[string(d.Body)] = d
				}
			}
			return len(seen) == len(want)
		})
		if !ok {
			t.Fatalf("a Source asked for %d and returned %d of %d messages; another Source received %d of the %d others within %v: the first Source holds the rest, fetched ahead of what Receive asked for",
				max, len(heldByA), n, len(seen), len(want), h.patience())
		}
		if counts {
			for body, d := range seen {
				if d.Attempt != 1 {
					t.Errorf("message %q reached the second Source on delivery %d, want 1: the first Source had received it too, though Receive did not return it", body, d.Attempt)
				}
			}
		}
	}
}

// testNoSelfRenewal checks that a Source renews no lease by itself: a
// delivery received and never extended by its caller goes to another
// Source once its lease has passed. The runtime renews what it holds, and
// stops when it lets a delivery go; an adapter renewing on its own would
// keep a message from every consumer after the runtime gave up on it (its
// handler hung past the maximum processing time, its lease keeper failed).
func testNoSelfRenewal(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	bodies := publishN(t, q, 1, "")
	a := q.Open(t)
	defer a.Close()
	first := receiveDirect(t, a, 1, 1)[0] // never extended
	received := time.Now()
	b := q.Open(t)
	defer b.Close()
	got, ok := receiveUntil(t, b, 1, h.patience(), func(ds []*adapters.Delivery) bool { return len(ds) > 0 })
	if !ok {
		t.Fatalf("a message received and never renewed by its caller did not go to another Source within %v, with a lease of %v: the Source renewed its lease by itself", h.patience(), q.Lease)
	}
	d := got[0]
	if string(d.Body) != bodies[0] {
		t.Fatalf("the second Source received %q, want %q", d.Body, bodies[0])
	}
	t.Logf("redelivered %v after the first receive, with a lease of %v", time.Since(received).Round(time.Millisecond), q.Lease)
	if a.Capabilities().CountsDeliveries && d.Attempt != first.Attempt+1 {
		t.Errorf("the redelivery has Attempt %d, want %d", d.Attempt, first.Attempt+1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := b.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatalf("Ack of the redelivery: %v", err)
	}
}
