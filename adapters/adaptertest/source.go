package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// The tests in this file drive a Source directly, without the runtime, to
// check what the contract promises of each method on its own and the
// misuses the runtime never makes but an adapter must survive. Their common
// yardstick: an Ack that returns nil for an entry means the message never
// comes back, and an Ack that fails means it does (nothing is lost).

// receiveDirect calls src.Receive(ctx, max) until it holds want deliveries,
// and fails the test if one call returns more than max.
func receiveDirect(t *testing.T, src adapters.Source, want, max int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	var got []*adapters.Delivery
	for len(got) < want {
		ds, err := src.Receive(ctx, max)
		if len(ds) > max {
			t.Fatalf("Receive(ctx, %d) returned %d deliveries", max, len(ds))
		}
		got = append(got, ds...)
		if err != nil {
			if ctx.Err() != nil {
				t.Fatalf("received %d of %d deliveries within %v", len(got), want, patience)
			}
			t.Fatalf("Receive: %v", err)
		}
	}
	return got
}

// expectFates checks what became of messages once the source that held
// them is closed: fates maps each body to whether it was acked. An acked
// message, and any message fates does not name, must never be delivered
// again; any other must be (nothing is lost). One fresh consumer watches for all of them, since it takes
// whatever comes back. A marker published first shows the consumer is
// receiving before the quiet period starts (a Kafka consumer must join its
// group first).
func expectFates(t *testing.T, q *Queue, fates map[string]bool) {
	t.Helper()
	rec := newRecorder()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		rec.record(m)
		return nil
	}))
	defer s.stop()
	marker := "marker-" + t.Name()
	publish(t, q, Message{Key: marker, Body: []byte(marker)})
	waitFor(t, "the marker and every message not acked delivered", func() bool {
		if rec.count(marker) == 0 {
			return false
		}
		for body, acked := range fates {
			if !acked && rec.count(body) == 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(quietPeriod(q))
	if err := s.stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var again []string
	for body, n := range rec.calls {
		// Messages the test does not name were acked (settled) too.
		if acked, ok := fates[body]; body != marker && (!ok || acked) {
			again = append(again, fmt.Sprintf("%q (%d times)", body, n))
		}
	}
	if len(again) > 0 {
		t.Fatalf("acked messages were delivered again: %v", again)
	}
}

// holding returns a fresh queue with n messages on it, and a source that
// received them all. The test closes the source.
func holding(t *testing.T, h Harness, n int) (*Queue, adapters.Source, []*adapters.Delivery) {
	t.Helper()
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	publishN(t, q, n, "")
	src := q.Open(t)
	return q, src, receiveDirect(t, src, n, n)
}

// testCapabilities checks that Capabilities agrees with the harness and does
// not change: the suite decides from Queue.Lease which lease tests to run,
// and the runtime reads Capabilities once, so a harness reporting no lease
// for a leasing broker would skip those tests without a word.
func testCapabilities(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: time.Second})
	src := q.Open(t)
	defer src.Close()
	first := src.Capabilities()
	if first.Lease != q.Lease {
		t.Errorf("Capabilities().Lease = %v but the harness reports Queue.Lease = %v; the suite picks its lease tests by the latter", first.Lease, q.Lease)
	}
	if first.Lease > 0 {
		if _, ok := src.(adapters.Extender); !ok {
			t.Errorf("%T reports a lease but does not implement adapters.Extender", src)
		}
	}
	if first.MaxLeaseAge < 0 || first.MaxReceive < 0 || first.Receivers < 0 || first.MaxUnacked < 0 || badBatching(first.Ack) || badBatching(first.Nack) || badBatching(first.Extend) {
		t.Errorf("Capabilities has a negative bound: %+v", first)
	}
	bodies := publishN(t, q, 1, "")
	ds := receiveDirect(t, src, 1, 1)
	if again := src.Capabilities(); !reflect.DeepEqual(first, again) {
		t.Errorf("Capabilities changed after a Receive: %+v, then %+v", first, again)
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Ack(ctx, ds); err != nil {
		t.Fatalf("Ack: %v", err)
	}
	if string(ds[0].Body) != bodies[0] {
		t.Errorf("received %q, want %q", ds[0].Body, bodies[0])
	}
}

// testReceiveBounds checks that Receive never returns more than max, that a
// max far beyond what the broker hands out in one call is no error, and the
// fields every delivery must fill.
func testReceiveBounds(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	const n = 6
	msgs := make([]Message, n)
	want := map[string]bool{}
	for i := range msgs {
		b := fmt.Sprintf("%s-%d", t.Name(), i)
		msgs[i] = Message{Body: []byte(b), Headers: map[string]string{"index": fmt.Sprint(i)}}
		want[b] = true
	}
	publish(t, q, msgs...)
	src := q.Open(t)
	defer src.Close()
	caps := src.Capabilities()
	ds := receiveDirect(t, src, 2, 1)
	ds = append(ds, receiveDirect(t, src, n-2, 100000)...)
	if len(ds) != n {
		t.Fatalf("received %d deliveries, want %d", len(ds), n)
	}
	for _, d := range ds {
		b := string(d.Body)
		if !want[b] {
			t.Errorf("unexpected or repeated delivery %q", b)
		}
		delete(want, b)
		if d.Headers["index"] == "" {
			t.Errorf("delivery %q lost its header: %v", b, d.Headers)
		}
		switch {
		case caps.CountsDeliveries && d.Attempt != 1:
			t.Errorf("delivery %q has Attempt %d on its first delivery, want 1 (CountsDeliveries)", b, d.Attempt)
		case !caps.CountsDeliveries && d.Attempt != 0:
			t.Errorf("delivery %q has Attempt %d, want 0: the broker does not count deliveries", b, d.Attempt)
		}
		if (d.Partition < 0) != (d.Offset < 0) || (d.Partition < 0 && (d.Partition != -1 || d.Offset != -1)) {
			t.Errorf("delivery %q has Partition %d, Offset %d: both -1 or both located", b, d.Partition, d.Offset)
		}
		if d.Queue == "" || d.ReceivedAt.IsZero() {
			t.Errorf("delivery %q lacks its Queue (%q) or ReceivedAt (%v)", b, d.Queue, d.ReceivedAt)
		}
		if d.OrderingKey != "" && !caps.Ordered {
			t.Errorf("delivery %q has OrderingKey %q from a source that does not report Ordered", b, d.OrderingKey)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Ack(ctx, ds); err != nil {
		t.Fatalf("Ack: %v", err)
	}
}

// testOrderingKeys checks that an ordered queue's deliveries name their
// lanes: the runtime keeps order only among deliveries with one non-empty
// OrderingKey, whatever Capabilities.Ordered says.
func testOrderingKeys(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second, Ordered: true})
	var msgs []Message
	for i := range 3 {
		for _, k := range []string{"k1", "k2"} {
			msgs = append(msgs, Message{Key: k, Body: []byte(fmt.Sprintf("%s-%d", k, i))})
		}
	}
	publish(t, q, msgs...)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	src := q.Open(t)
	defer src.Close()
	if !src.Capabilities().Ordered {
		t.Errorf("the harness made an ordered queue, but Capabilities().Ordered is false")
	}
	lanes := map[string]string{} // message key -> ordering key
	var got []*adapters.Delivery
	for len(got) < len(msgs) {
		ds := receiveDirect(t, src, 1, len(msgs))
		got = append(got, ds...)
		// Ack as we go: a FIFO queue hands out a group's next message only
		// once the one before is settled.
		if err := src.Ack(ctx, ds); err != nil {
			t.Fatalf("Ack: %v", err)
		}
	}
	for _, d := range got {
		if d.OrderingKey == "" {
			t.Errorf("delivery %q of key %q has no OrderingKey", d.Body, d.Key)
			continue
		}
		key := string(d.Body[:2])
		if l, ok := lanes[key]; ok && l != d.OrderingKey {
			t.Errorf("deliveries of key %q have OrderingKeys %q and %q", key, l, d.OrderingKey)
		}
		lanes[key] = d.OrderingKey
	}
	if len(lanes) == 2 && lanes["k1"] == lanes["k2"] {
		t.Logf("keys k1 and k2 share the lane %q (allowed, but slower)", lanes["k1"])
	}
}

// testReceiveAfterContextDone checks "after ctx is done it returns ctx's
// error": even with deliveries ready (fetched ahead by an earlier call), a
// Receive with a done context hands nothing out. The runtime stops
// receiving when shutdown begins; what a Receive hands out then would start
// handlers after the drain began.
func testReceiveAfterContextDone(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	const n = 6
	publishN(t, q, n, "")
	src := q.Open(t)
	defer src.Close()
	held := receiveDirect(t, src, 1, 1) // the source may fetch the rest ahead
	done, cancel := context.WithCancel(context.Background())
	cancel()
	// Several calls: an adapter that picks at random between a ready
	// delivery and the done context would pass one call by luck.
	for range 20 {
		ds, err := src.Receive(done, n)
		if len(ds) > 0 || !errors.Is(err, context.Canceled) {
			t.Fatalf("Receive with a done context returned %d deliveries and %v, want none and context.Canceled", len(ds), err)
		}
	}
	ctx, stop := context.WithTimeout(context.Background(), patience)
	defer stop()
	if err := src.Ack(ctx, held); err != nil {
		t.Fatalf("Ack: %v", err)
	}
}

// testClose checks Close with a Receive waiting (both return), that a later
// Receive fails with an error wrapping adapters.ErrClosed, and that settling
// a delivery after Close is truthful: an Ack that returns nil has deleted
// the message, one that fails leaves it to come back.
func testClose(t *testing.T, h Harness) {
	q, src, ds := holding(t, h, 2)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	received := make(chan error, 1)
	go func() {
		_, err := src.Receive(ctx, 10) // the queue is empty: it waits
		received <- err
	}()
	time.Sleep(50 * time.Millisecond) // let it start waiting; passing without is no harm
	closed := make(chan error, 1)
	go func() { closed <- src.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(patience):
		t.Fatalf("Close did not return within %v with a Receive waiting", patience)
	}
	select {
	case err := <-received:
		if err != nil && !errors.Is(err, adapters.ErrClosed) {
			t.Errorf("the Receive waiting at Close returned %v, want nil or an error wrapping adapters.ErrClosed", err)
		}
	case <-time.After(patience):
		t.Fatalf("a Receive waiting at Close did not return within %v", patience)
	}
	if ds, err := src.Receive(ctx, 10); len(ds) > 0 || !errors.Is(err, adapters.ErrClosed) {
		t.Errorf("Receive after Close returned %d deliveries and %v, want an error wrapping adapters.ErrClosed", len(ds), err)
	}
	ackErr := src.Ack(ctx, ds[:1])
	t.Logf("Ack after Close: %v", ackErr)
	nackErr := src.Nack(ctx, adapters.NackAll(ds[1:], 0))
	t.Logf("Nack after Close: %v", nackErr)
	expectFates(t, q, map[string]bool{string(ds[0].Body): adapters.EntryError(ackErr, 0) == nil, string(ds[1].Body): false})
}

// testAckTwice acks a delivery twice, as a runtime retrying an Ack whose
// answer was lost does: the second Ack may fail its entry, but it must not
// disturb any other delivery (an AMQP channel closes on an unknown delivery
// tag, losing every delivery it carries) nor bring the message back.
func testAckTwice(t *testing.T, h Harness) {
	q, src, ds := holding(t, h, 2)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := src.Ack(ctx, ds[:1]); err != nil {
		t.Fatalf("first Ack: %v", err)
	}
	err := src.Ack(ctx, ds[:1])
	t.Logf("second Ack of the same delivery: %v", err)
	var be *adapters.BatchError
	if err != nil && !errors.As(err, &be) {
		t.Errorf("second Ack of one delivery failed the whole call: %v; fail its entry, if anything", err)
	}
	if err := src.Ack(ctx, ds[1:]); err != nil {
		t.Fatalf("Ack of another delivery after a repeated Ack: %v", err)
	}
	if err := src.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	expectFates(t, q, map[string]bool{string(ds[0].Body): true, string(ds[1].Body): true})
}

// testAckAfterNack settles one delivery both ways, as a runtime with a bug
// might, or a user's own code calling the Source: Nack then Ack, Ack then
// Nack, and both at once. Whatever the adapter answers, it must be true: an
// Ack that returns nil for an entry means the message never comes back, and
// a failed Ack means it does.
func testAckAfterNack(t *testing.T, h Harness) {
	orders := []struct {
		name string
		run  func(ctx context.Context, src adapters.Source, d *adapters.Delivery) error
	}{
		{"NackThenAck", func(ctx context.Context, src adapters.Source, d *adapters.Delivery) error {
			if err := src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0)); err != nil {
				return fmt.Errorf("the first call, Nack: %w", err)
			}
			return src.Ack(ctx, []*adapters.Delivery{d})
		}},
		{"AckThenNack", func(ctx context.Context, src adapters.Source, d *adapters.Delivery) error {
			err := src.Ack(ctx, []*adapters.Delivery{d})
			_ = src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0))
			return err
		}},
		{"Concurrent", func(ctx context.Context, src adapters.Source, d *adapters.Delivery) error {
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 0))
			}()
			err := src.Ack(ctx, []*adapters.Delivery{d})
			wg.Wait()
			return err
		}},
	}
	for _, o := range orders {
		t.Run(o.name, func(t *testing.T) {
			q, src, ds := holding(t, h, 1)
			d := ds[0]
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			err := o.run(ctx, src, d)
			t.Logf("Ack: %v", err)
			var be *adapters.BatchError
			if err != nil && !errors.As(err, &be) {
				t.Fatalf("%v", err)
			}
			if err := src.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
			expectFates(t, q, map[string]bool{string(d.Body): adapters.EntryError(err, 0) == nil})
		})
	}
}

// testForeignDelivery passes a delivery the Source never handed out (as
// another broker's adapter builds it) in a batch with one of its own: the
// stranger's entry must fail, in a *adapters.BatchError, and the batch's
// other entry must be settled as asked, for Ack, Nack and Extend alike.
func testForeignDelivery(t *testing.T, h Harness) {
	q, src, ds := holding(t, h, 2)
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	stranger := func() *adapters.Delivery {
		return foreignDelivery([]byte("stranger"), nil)
	}
	check := func(op string, err error) {
		t.Helper()
		var be *adapters.BatchError
		if !errors.As(err, &be) {
			t.Errorf("%s of a batch holding a foreign delivery returned %v, want a *adapters.BatchError failing that entry alone", op, err)
			return
		}
		if adapters.EntryError(err, 0) != nil || adapters.EntryError(err, 1) == nil {
			t.Errorf("%s: entry errors %v, want the foreign entry (1) alone failed", op, be.Failed)
		}
	}
	if ext, ok := src.(adapters.Extender); ok {
		check("Extend", ext.Extend(ctx, []*adapters.Delivery{ds[0], stranger()}, q.Lease))
	}
	check("Nack", src.Nack(ctx, adapters.NackAll([]*adapters.Delivery{ds[1], stranger()}, 0)))
	ackErr := src.Ack(ctx, []*adapters.Delivery{ds[0], stranger()})
	check("Ack", ackErr)
	if err := src.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	expectFates(t, q, map[string]bool{string(ds[0].Body): adapters.EntryError(ackErr, 0) == nil, string(ds[1].Body): false})
}

// testNackDelay checks, where the source reports NackDelay, that a nacked
// message comes back no sooner than asked, and that a delay beyond what the
// broker can hold (SQS: 12 hours) is still a delay, not an error or an
// immediate redelivery. Only a lower bound is checked: a slow machine makes
// the measured time longer, never shorter.
func testNackDelay(t *testing.T, h Harness) {
	q, src, ds := holding(t, h, 2)
	if !src.Capabilities().NackDelay {
		src.Close()
		t.Skip("the source does not report NackDelay; the runtime retries in place")
	}
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	const delay = 1500 * time.Millisecond
	nacked := time.Now()
	if err := src.Nack(ctx, adapters.NackAll(ds[:1], delay)); err != nil {
		t.Fatalf("Nack with a delay of %v: %v", delay, err)
	}
	if err := src.Nack(ctx, adapters.NackAll(ds[1:], 10000*time.Hour)); err != nil {
		t.Fatalf("Nack with a delay beyond any broker's limit: %v; the runtime asks for what its retry policy says, so cap it", err)
	}
	var (
		mu   sync.Mutex
		back = map[string]time.Duration{}
	)
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		if _, ok := back[string(m.Body)]; !ok {
			back[string(m.Body)] = time.Since(nacked)
		}
		mu.Unlock()
		return nil
	}))
	waitFor(t, "the message nacked with a short delay delivered again", func() bool {
		mu.Lock()
		defer mu.Unlock()
		_, ok := back[string(ds[0].Body)]
		return ok
	})
	time.Sleep(quietPeriod(q))
	if err := s.stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := back[string(ds[0].Body)]; got < delay {
		t.Errorf("a message nacked with a delay of %v came back after %v", delay, got)
	}
	if got, ok := back[string(ds[1].Body)]; ok {
		t.Errorf("a message nacked with a delay of 10000h came back after %v", got)
	}
}

// badBatching reports a Batching with a negative bound.
func badBatching(b adapters.Batching) bool {
	return b.MaxEntries < 0 || b.Linger < 0 || b.MaxCalls < 0
}
