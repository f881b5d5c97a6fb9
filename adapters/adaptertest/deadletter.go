package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// The tests in this file check that a dead-letter destination stores
// whatever it is given. A destination that refuses a message (a header name
// its broker cannot carry, a binary body, a header larger than a frame) makes
// the runtime keep the original and try again, so the poison message comes
// back for ever: on an ordered queue it stalls everything behind it. Any
// source may feed any destination (a Kafka consumer may dead-letter into
// SQS), so the deliveries here are built by hand, as another broker's
// adapter would hand them over.

// foreignDelivery returns a delivery as another broker's adapter would hand
// it to the runtime.
func foreignDelivery(body []byte, headers map[string]string) *adapters.Delivery {
	now := time.Now()
	return &adapters.Delivery{
		ID:          "foreign-id",
		Body:        body,
		Headers:     headers,
		Key:         "foreign-key",
		Attempt:     4,
		Queue:       "another-broker/orders",
		Partition:   3,
		Offset:      42,
		PublishedAt: now.Add(-time.Minute),
		ReceivedAt:  now,
	}
}

func foreignFailure(msg string) adapters.Failure {
	now := time.Now()
	return adapters.Failure{Err: errors.New(msg), Attempts: 4, FirstFailure: now.Add(-time.Second), LastFailure: now, Consumer: "suite"}
}

// sendDirect sends d to q's dead-letter destination and fails the test if
// the destination refuses it.
func sendDirect(t *testing.T, q *Queue, d *adapters.Delivery, f adapters.Failure) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	if err := q.DeadLetter.Send(ctx, d, f); err != nil {
		t.Fatalf("the dead-letter destination refused a message another broker could deliver (it would come back for ever): %v", err)
	}
}

// testDeadLetterForeignHeaders sends a delivery whose headers no single
// broker would produce: names too long for AMQP, names SQS refuses, empty and
// non-UTF-8 values, more headers than SQS allows, and look-alikes of headers
// brokers act on. Send must store it; the ordinary headers must arrive as
// they were.
func testDeadLetterForeignHeaders(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{})
	body := "foreign-" + t.Name()
	ordinary := map[string]string{
		"plain":    "text value",
		"trace-id": "4bf92f3577b34da6a3ce929d0e0e4736",
	}
	for i := range 12 {
		ordinary[fmt.Sprintf("extra-%02d", i)] = fmt.Sprintf("value %d", i)
	}
	headers := map[string]string{
		strings.Repeat("n", 300):   "a name longer than an AMQP field name may be",
		"name with spaces/ünïcode": "v",
		"empty":                    "",
		"not-utf8":                 "\xff\xfe",
		"CC":                       "a routing header look-alike",
		"x-death":                  "a broker header look-alike",
	}
	for k, v := range ordinary {
		headers[k] = v
	}
	before := time.Now()
	sendDirect(t, q, foreignDelivery([]byte(body), headers), foreignFailure("foreign failure"))
	m, ok := deadLettered(t, q, 1)[body]
	if !ok {
		t.Fatalf("the dead-letter copy lost its body %q", body)
	}
	checkDiagnostics(t, m, "4", "false", "foreign failure", before)
	hd := m.Headers
	if hd[adapters.HeaderOriginalQueue] != "another-broker/orders" || hd[adapters.HeaderOriginalPart] != "3" || hd[adapters.HeaderOriginalOffset] != "42" {
		t.Errorf("the copy does not name its source: queue %q, partition %q, offset %q",
			hd[adapters.HeaderOriginalQueue], hd[adapters.HeaderOriginalPart], hd[adapters.HeaderOriginalOffset])
	}
	for k, v := range ordinary {
		if hd[k] != v {
			t.Errorf("header %q = %q in the copy, want %q", k, hd[k], v)
		}
	}
}

// testDeadLetterForeignBodies sends a binary body and an empty one: both
// must arrive byte for byte (the harness undoes an encoding the destination
// documents).
func testDeadLetterForeignBodies(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{})
	binary := "\x00\xff\xfe binary " + t.Name()
	for _, body := range []string{binary, ""} {
		sendDirect(t, q, foreignDelivery([]byte(body), map[string]string{"kind": "body"}), foreignFailure("bad body"))
	}
	dl := deadLettered(t, q, 2)
	for _, body := range []string{binary, ""} {
		m, ok := dl[body]
		if !ok {
			t.Errorf("body %q did not arrive intact; the destination holds %q", body, keys(dl))
			continue
		}
		if m.Headers["kind"] != "body" {
			t.Errorf("body %q arrived without its header: %v", body, m.Headers)
		}
	}
}

// testDeadLetterOversizedHeader sends a delivery with a header larger than
// an AMQP frame (128 KiB by default) but well within every broker's message
// size. Send must store it, keeping the body and diagnostics; what it does
// with the header is the adapter's to document.
func testDeadLetterOversizedHeader(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{})
	body := "oversized-header-" + t.Name()
	headers := map[string]string{"large": strings.Repeat("h", 150<<10), "small": "kept"}
	before := time.Now()
	sendDirect(t, q, foreignDelivery([]byte(body), headers), foreignFailure("large header"))
	m, ok := deadLettered(t, q, 1)[body]
	if !ok {
		t.Fatalf("the dead-letter copy lost its body %q", body)
	}
	checkDiagnostics(t, m, "4", "false", "large header", before)
	if m.Headers["small"] != "kept" {
		t.Errorf("header %q = %q, want %q", "small", m.Headers["small"], "kept")
	}
}

// testDeadLetterReplayedCopy dead-letters a message that carries the
// diagnostics of an earlier trip to a dead-letter destination, as a message
// replayed from a DLQ into its queue does. The new copy must describe the new
// failure only: no header of the old one may survive beside the new ones.
func testDeadLetterReplayedCopy(t *testing.T, h Harness) {
	q := h.NewQueue(t, QueueConfig{Lease: 2 * time.Second})
	body := "replayed-" + t.Name()
	stale := map[string]string{
		adapters.HeaderError:          "stale error",
		adapters.HeaderPermanent:      "true",
		adapters.HeaderAttempts:       "99",
		adapters.HeaderFirstFailure:   "2001-01-01T00:00:00Z",
		adapters.HeaderLastFailure:    "2001-01-01T00:00:01Z",
		adapters.HeaderOriginalQueue:  "stale-queue",
		adapters.HeaderOriginalID:     "stale-id",
		adapters.HeaderOriginalPart:   "7777",
		adapters.HeaderOriginalOffset: "7777",
		adapters.HeaderOriginalTime:   "2001-01-01T00:00:00Z",
		adapters.HeaderOriginalKey:    "stale-key",
		adapters.HeaderConsumer:       "stale-consumer",
	}
	headers := map[string]string{"origin": "suite"}
	for k, v := range stale {
		headers[k] = v
	}
	ctx := context.Background()
	if err := q.Publish(ctx, Message{Body: []byte(body), Headers: headers}); err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	s := start(t, q.Open(t), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return errors.New("fresh failure")
	}), fastRetry(1), consumer.WithDeadLetter(q.DeadLetter))
	dl := deadLettered(t, q, 1)
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	m, ok := dl[body]
	if !ok {
		t.Fatalf("dead-letter destination holds %v, want %q", keys(dl), body)
	}
	checkDiagnostics(t, m, "1", "false", "fresh failure", before)
	if strings.Contains(m.Headers[adapters.HeaderError], "stale") {
		t.Errorf("%s = %q: the old trip's error survived", adapters.HeaderError, m.Headers[adapters.HeaderError])
	}
	for k, v := range stale {
		if m.Headers[k] == v {
			t.Errorf("header %s = %q comes from the earlier dead-letter trip", k, v)
		}
	}
	if m.Headers["origin"] != "suite" {
		t.Errorf("the message's own header was lost: %v", m.Headers)
	}
	expectNothingMore(t, q)
}
