package adaptertest

import (
	"context"
	"fmt"
	"reflect"
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
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := q.Publish(ctx, Message{Key: marker, Body: []byte(marker)}); err != nil {
		t.Fatalf("publish: %v", err)
	}
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
	if first.MaxLeaseAge < 0 || first.MaxReceive < 0 || first.MaxAckBatch < 0 || first.MaxExtendBatch < 0 || first.MaxUnacked < 0 {
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
