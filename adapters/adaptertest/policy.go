package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// The tests in this file check that an adapter leaves timing policy to the
// runtime: it fetches no more than Receive asks for, renews no lease the
// runtime did not ask it to, makes Ack, Nack and Extend take effect before
// they return, and reports a refused entry instead of trying it again. An
// adapter that did any of these by itself would hold messages the runtime
// does not know it holds, or answer for the broker before the broker did.
// They also check what the runtime relies on to do that policy itself: the
// bounds of Receive (Capabilities.MaxReceive and Receivers) and a Signal per
// delivery. Each test drives Sources directly, and watches from a second
// Source, or through the broker, what the first one did.

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

// bodiesOf returns the bodies of ds.
func bodiesOf(ds []*adapters.Delivery) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = string(d.Body)
	}
	return out
}

// crash cuts src off from the broker through the harness, then closes it.
func crash(q *Queue, src adapters.Source) {
	q.Crash(src)
	_ = src.Close() // a crashed Source may fail to close; it only frees resources
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

// skipUnlessLingerShows skips a test of lingering when the broker's acks
// are not settled by the adapter's calls alone (Kafka's commits), and
// skipUnlessCrashable when the harness cannot cut a Source off, which is how
// those tests see a linger.
func skipUnlessLingerShows(t *testing.T, h Harness) {
	t.Helper()
	if h.Dispatch == Partitions {
		t.Skip("acks are offsets, committed later with others (Kafka): the runtime's prefix commits, not an adapter's linger")
	}
}

func skipUnlessCrashable(t *testing.T, q *Queue) {
	t.Helper()
	if q.Crash == nil {
		t.Skip("the harness cannot cut a Source off from the broker (Queue.Crash is nil)")
	}
}

// testAckDoesNotLinger checks that an Ack has reached the broker when it
// returns: a Source cut off from the broker right after an Ack returned nil
// leaves that message acked, and only the other comes back. An adapter that
// holds acks back to send them later in batches would lose them with the
// process, while the runtime counted them settled; the runtime does the
// batching (Capabilities.Ack), before it calls Ack.
func testAckDoesNotLinger(t *testing.T, h Harness) {
	skipUnlessLingerShows(t, h)
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	skipUnlessCrashable(t, q)
	publishN(t, q, 2, "")
	src := q.Open(t)
	ds := receiveDirect(t, src, 2, 2)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Ack(ctx, ds[:1]); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	crash(q, src)
	expectFates(t, q, map[string]bool{string(ds[0].Body): true, string(ds[1].Body): false})
}

// testNackDoesNotLinger checks that a Nack has reached the broker when it
// returns: a message nacked with no delay, by a Source cut off from the
// broker right after, is at once receivable by another Source. The queue's
// lease is long, so a nack the adapter held back and lost with the process
// leaves the message out of reach for longer than the test waits.
func testNackDoesNotLinger(t *testing.T, h Harness) {
	skipUnlessLingerShows(t, h)
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	skipUnlessCrashable(t, q)
	bodies := publishN(t, q, 1, "")
	src := q.Open(t)
	ds := receiveDirect(t, src, 1, 1)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Nack(ctx, adapters.NackAll(ds, 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	crash(q, src)
	b := q.Open(t)
	defer b.Close()
	got, ok := receiveUntil(t, b, 1, h.patience(), func(ds []*adapters.Delivery) bool { return len(ds) > 0 })
	if !ok {
		t.Fatalf("a message nacked with no delay was not receivable by another Source within %v once the Source that nacked it was cut off (lease %v): the Nack had not reached the broker when it returned", h.patience(), q.Lease)
	}
	if string(got[0].Body) != bodies[0] {
		t.Errorf("the second Source received %q, want %q", got[0].Body, bodies[0])
	}
}

// testExtendDoesNotLinger checks that an Extend has reached the broker when
// it returns. A Source renews, halfway through its lease, a delivery it
// received, for a whole lease, as the runtime's lease keeper does, and is
// cut off from the broker right after; another Source then watches the
// queue until just before the renewed lease ends. A renewal the adapter
// held back would be lost with the process, and the message would go to the
// watcher when the first lease ended, while the runtime believed it kept.
// Only what the watcher received before the renewed lease could have ended
// counts, so a slow machine cannot fail an adapter that renews at once.
func testExtendDoesNotLinger(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	if q.Lease <= 0 {
		t.Skip("the broker does not lease deliveries")
	}
	skipUnlessCrashable(t, q)
	publishN(t, q, 1, "")
	src := q.Open(t)
	ext, ok := src.(adapters.Extender)
	if !ok {
		src.Close()
		t.Fatalf("%T leases deliveries but does not implement adapters.Extender", src)
	}
	ds := receiveDirect(t, src, 1, 1)
	time.Sleep(q.Lease / 2)
	renewed := time.Now() // the renewed lease ends no sooner than renewed + q.Lease
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := ext.Extend(ctx, ds, q.Lease); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	crash(q, src)
	b := q.Open(t)
	defer b.Close()
	watchUntil := renewed.Add(q.Lease * 9 / 10)
	var early []string
	receiveUntil(t, b, 1, time.Until(watchUntil), func(ds []*adapters.Delivery) bool {
		if len(ds) > len(early) && time.Now().Before(watchUntil) {
			early = bodiesOf(ds)
		}
		return len(early) > 0
	})
	if len(early) > 0 {
		t.Fatalf("a message whose lease was renewed halfway through it, for a lease of %v, came back to another Source (%q) before the renewed lease ended, once the Source that renewed it was cut off: the Extend had not reached the broker when it returned", q.Lease, early)
	}
}

// testRefusedEntryIsNotRetried checks that an Ack entry the broker refuses
// fails in a *adapters.BatchError at once, and the other entries of the
// call are settled: the runtime tries failed entries again (asking
// adapters.Retryable which are worth it), on its own schedule. An adapter
// that tried again by itself would hold the call, and with it the runtime's
// batching, and hide from the runtime what the broker said.
func testRefusedEntryIsNotRetried(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	if q.Refuse == nil {
		t.Skip("the harness cannot make the broker refuse an ack entry (Queue.Refuse is nil): a broker that never refuses one leaves nothing to retry")
	}
	publishN(t, q, 2, "")
	src := q.Open(t)
	defer src.Close()
	ds := receiveDirect(t, src, 2, 2)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	q.Refuse(src)
	err := src.Ack(ctx, ds)
	var be *adapters.BatchError
	switch {
	case err == nil:
		t.Fatalf("Ack returned nil for a batch whose first entry the broker refused: the adapter tried the entry again by itself; report it in a *adapters.BatchError and leave retries to the runtime")
	case !errors.As(err, &be):
		t.Fatalf("Ack of a batch whose first entry the broker refused failed whole: %v; want a *adapters.BatchError failing that entry alone", err)
	}
	refused := adapters.EntryError(err, 0)
	if refused == nil {
		t.Fatalf("Ack reported entries %v, not the refused entry 0: the adapter tried it again by itself; report it and leave retries to the runtime", be.Failed)
	}
	if e := adapters.EntryError(err, 1); e != nil {
		t.Errorf("the entry after the refused one failed too: %v", e)
	}
	for _, lost := range []error{adapters.ErrLeaseLost, adapters.ErrConnectionLost, adapters.ErrRevoked, adapters.ErrClosed} {
		if errors.Is(refused, lost) {
			t.Errorf("a transient refusal was reported as %v: the runtime gives such a delivery up instead of trying again", lost)
		}
	}
	if r, ok := src.(adapters.Retryable); ok && !r.IsRetryable(refused) {
		t.Errorf("IsRetryable(%v) = false for a transient fault on the broker's side: the runtime will not try it again", refused)
	}
	// The runtime's next try.
	if err := src.Ack(ctx, ds[:1]); err != nil {
		t.Errorf("Ack of the refused entry, tried again: %v", err)
	}
}

// testMaxReceive checks that a Source bounding its Receive calls
// (Capabilities.MaxReceive) serves calls of that size on a queue holding
// more: each returns no more than asked, and together they take every
// message.
func testMaxReceive(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	src := q.Open(t)
	defer src.Close()
	m := src.Capabilities().MaxReceive
	switch {
	case m == 0:
		t.Skip("Receive is unbounded (MaxReceive 0); ReceiveBounds checks it")
	case m > 1000:
		t.Skipf("MaxReceive %d: too many messages to publish for one check", m)
	}
	bodies := publishN(t, q, m+1, "")
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	seen := map[string]bool{}
	for len(seen) < len(bodies) {
		// Acked as they come: a broker that pushes up to a prefetch window
		// sends the rest only then.
		ds := receiveDirect(t, src, 1, m)
		for _, d := range ds {
			if seen[string(d.Body)] {
				t.Fatalf("message %q received twice", d.Body)
			}
			seen[string(d.Body)] = true
		}
		if err := src.Ack(ctx, ds); err != nil {
			t.Fatalf("Ack: %v", err)
		}
	}
}

// testConcurrentReceives checks, for a Source that lets the runtime run
// several Receive calls at once (Capabilities.Receivers > 1), that such
// calls are safe together: none returns more than it asked for, and no
// message is handed to two of them. Run it under -race.
func testConcurrentReceives(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	src := q.Open(t)
	defer src.Close()
	caps := src.Capabilities()
	r := caps.Receivers
	if r <= 1 {
		t.Skipf("the runtime runs one Receive at a time on this Source (Receivers %d)", r)
	}
	per := 3
	if caps.MaxReceive > 0 {
		per = min(per, caps.MaxReceive)
	}
	n := 2 * r * per
	bodies := publishN(t, q, n, "")
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var (
		mu    sync.Mutex
		seen  = map[string]int{}
		total int
		wg    sync.WaitGroup
	)
	fail := make(chan string, r)
	for range r {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				ds, err := src.Receive(ctx, per)
				if len(ds) > per {
					fail <- fmt.Sprintf("Receive(ctx, %d) among %d concurrent calls returned %d deliveries", per, r, len(ds))
					cancel()
					return
				}
				mu.Lock()
				for _, d := range ds {
					seen[string(d.Body)]++
				}
				total += len(ds)
				done := len(seen) == n
				mu.Unlock()
				if len(ds) > 0 {
					if err := src.Ack(ctx, ds); err != nil && ctx.Err() == nil {
						fail <- fmt.Sprintf("Ack: %v", err)
						cancel()
						return
					}
				}
				if done {
					cancel() // the others are waiting in Receive
					return
				}
				if err != nil {
					if ctx.Err() == nil {
						fail <- fmt.Sprintf("Receive: %v", err)
						cancel()
					}
					return
				}
			}
		}()
	}
	wg.Wait()
	close(fail)
	for f := range fail {
		t.Error(f)
	}
	mu.Lock()
	defer mu.Unlock()
	for body, c := range seen {
		if c > 1 {
			t.Errorf("message %q handed out %d times by concurrent Receive calls", body, c)
		}
	}
	if len(seen) != n && !t.Failed() {
		t.Errorf("%d concurrent Receive calls took %d of %d messages within %v", r, len(seen), n, patience)
	}
	t.Logf("%d concurrent Receive calls of up to %d took %d deliveries of %d messages", r, per, total, len(bodies))
}

// testSignalPerDelivery checks the Signal contract: a delivery's Signal,
// where the adapter sets one, belongs to that delivery alone (not to its
// message, its batch or its Source), so that the runtime's cancelling one
// handler, or the adapter's losing one delivery, touches no other; and Lose
// on it is reported through LostCause. A redelivery of the same message to
// the same Source gets a Signal of its own, not lost at birth.
func testSignalPerDelivery(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: longLease})
	publishN(t, q, 3, "")
	src := q.Open(t)
	defer src.Close()
	ds := receiveDirect(t, src, 3, 3)
	owner := map[*adapters.Signal]string{}
	claim := func(d *adapters.Delivery, what string) {
		t.Helper()
		if d.Signal == nil {
			return
		}
		if other, ok := owner[d.Signal]; ok {
			t.Errorf("%s shares its Signal with %s", what, other)
			return
		}
		owner[d.Signal] = what
		if err := d.Signal.LostCause(); err != nil {
			t.Errorf("%s was handed out lost: %v", what, err)
		}
	}
	for i, d := range ds {
		claim(d, fmt.Sprintf("delivery %d (%q)", i, d.Body))
	}

	// Lose on one delivery's Signal, as the runtime does when it could not
	// renew a lease, is that delivery's alone.
	if s := ds[1].Signal; s != nil {
		before := make([]error, len(ds))
		for i, d := range ds {
			before[i] = d.Signal.LostCause()
		}
		cause := errors.New("adaptertest: lost on purpose")
		s.Lose(cause)
		if got := s.LostCause(); !errors.Is(got, cause) {
			t.Errorf("after Lose(%v), LostCause() = %v", cause, got)
		}
		select {
		case <-s.Lost():
		default:
			t.Errorf("after Lose, the Lost channel is open")
		}
		for i, d := range ds {
			if i != 1 && before[i] == nil && d.Signal.LostCause() != nil {
				t.Errorf("losing delivery 1 lost delivery %d too (%v)", i, d.Signal.LostCause())
			}
		}
	}

	// The same message again, on the same Source.
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Nack(ctx, adapters.NackAll(ds[:1], 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	got, ok := receiveUntil(t, src, 3, patience, func(got []*adapters.Delivery) bool {
		for _, d := range got {
			if string(d.Body) == string(ds[0].Body) {
				return true
			}
		}
		return false
	})
	if !ok {
		t.Fatalf("a message nacked with no delay did not come back to its Source within %v", patience)
	}
	for _, d := range got {
		claim(d, fmt.Sprintf("the redelivery of %q", d.Body))
	}
}
