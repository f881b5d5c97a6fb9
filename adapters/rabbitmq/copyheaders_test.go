package rabbitmq

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// Tests of what a copy (a dead letter or a retry) does with headers AMQP
// cannot carry as they are, against the real broker.

// connOf returns the publisher's current connection.
func connOf(p *publisher) *amqp.Connection {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.conn
}

// connect makes the publisher open its connection, if it has none yet.
func connect(t *testing.T, p *publisher) *amqp.Connection {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.ensureLocked(context.Background()); err != nil {
		t.Fatal(err)
	}
	return p.conn
}

// checkConnSurvived fails the test unless the publisher still uses the open
// connection it had before.
func checkConnSurvived(t *testing.T, p *publisher, before *amqp.Connection) {
	t.Helper()
	after := connOf(p)
	if before == nil || after != before || after.IsClosed() {
		t.Fatalf("the publisher's connection did not survive (before %p, after %p): the broker closes it over a content header larger than frame_max", before, after)
	}
}

// budgetOf is the largest content header payload conn takes.
func budgetOf(t *testing.T, conn *amqp.Connection) int {
	t.Helper()
	if conn.Config.FrameSize <= 0 {
		t.Skip("the connection negotiated no frame limit")
	}
	return conn.Config.FrameSize - frameOverhead
}

// padTo sets header k of p to a string that makes p's content header
// payload exactly size bytes.
func padTo(t *testing.T, p *amqp.Publishing, k string, size int) {
	t.Helper()
	p.Headers[k] = ""
	n, err := headerFrameSize(p)
	if err != nil {
		t.Fatal(err)
	}
	if size < n {
		t.Fatalf("cannot pad to %d bytes: already %d", size, n)
	}
	p.Headers[k] = strings.Repeat("p", size-n)
	if n, _ := headerFrameSize(p); n != size {
		t.Fatalf("padded to %d bytes, want %d", n, size)
	}
}

func foreignFailure() adapters.Failure {
	now := time.Now()
	return adapters.Failure{Err: errors.New("foreign failure"), Attempts: 4, FirstFailure: now.Add(-time.Second), LastFailure: now, Consumer: "test"}
}

func checkFreshDiagnostics(t *testing.T, h map[string]string) {
	t.Helper()
	if h[adapters.HeaderError] != "foreign failure" || h[adapters.HeaderAttempts] != "4" || h[adapters.HeaderPermanent] != "false" ||
		h[adapters.HeaderFirstFailure] == "" || h[adapters.HeaderLastFailure] == "" {
		t.Errorf("the copy lost its diagnostics: %v", h)
	}
}

// headerSizeWitness exercises every field type amqp091 writes, and every
// property, so that the size measure is checked against the broker for all
// of them.
func headerSizeWitness() amqp.Publishing {
	return amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "gzip", CorrelationId: "corr", ReplyTo: "reply",
		Expiration: "60000", MessageId: "witness", Type: "type", UserId: "guest", AppId: "app",
		DeliveryMode: amqp.Persistent, Priority: 3, Timestamp: time.Unix(1700000000, 0),
		Headers: amqp.Table{
			"bool": true, "byte": byte(7), "int8": int8(-7), "int16": int16(-300), "uint16": uint16(300),
			"int": 70000, "int32": int32(-70000), "uint32": uint32(70000), "int64": int64(1) << 40,
			"float32": float32(1.5), "float64": 2.5, "decimal": amqp.Decimal{Scale: 2, Value: 12345},
			"time": time.Unix(1700000000, 0), "bytes": []byte{0, 1, 0xff}, "void": nil,
			"array":  []any{"a", int32(1), amqp.Table{"k": "v"}, []any{}},
			"table":  amqp.Table{"nested": amqp.Table{"deep": []byte("x")}, "s": "t"},
			"ünï c":  "",
			"utf8":   "\xff\xfe",
			"string": "text",
		},
	}
}

// recordingConn records what the client writes.
type recordingConn struct {
	net.Conn
	mu      sync.Mutex
	written []byte
}

func (c *recordingConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	c.written = append(c.written, b...)
	c.mu.Unlock()
	return c.Conn.Write(b)
}

// take returns what was written since the last call.
func (c *recordingConn) take() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.written
	c.written = nil
	return b
}

// The measure of a content header is exact, to the byte, for every field
// type and property: it is what amqp091 writes on the wire.
func TestContentHeaderMeasureIsWhatTheClientWrites(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	var rec *recordingConn
	conn, err := amqp.DialConfig(brokerURL, amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		c, err := net.Dial(network, addr)
		if err != nil {
			return nil, err
		}
		rec = &recordingConn{Conn: c}
		return rec, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []amqp.Publishing{headerSizeWitness(), {}, {Headers: amqp.Table{"a": "b"}, Body: []byte("body")}} {
		want, err := headerFrameSize(&p)
		if err != nil {
			t.Fatal(err)
		}
		rec.take()
		// Publish returns once its frames are written and flushed.
		if err := ch.Publish("", q, false, false, p); err != nil {
			t.Fatal(err)
		}
		found := false
		for b := rec.take(); len(b) >= 7; {
			typ, size := b[0], int(binary.BigEndian.Uint32(b[3:7]))
			if typ == 2 { // content header
				found = true
				if size != want {
					t.Errorf("amqp091 wrote a content header of %d bytes; measured %d", size, want)
				}
			}
			b = b[min(len(b), 7+size+1):]
		}
		if !found {
			t.Fatal("no content header frame written")
		}
	}
}

// A message whose content header takes exactly the connection's budget is
// stored; the publisher refuses one a byte larger without sending it, so
// its connection survives. Sent anyway, a content header larger than
// frame_max makes the broker close the connection. (RabbitMQ tolerates up
// to 8 bytes beyond the limit, for clients that forget the frame's own
// overhead; the adapter keeps to the protocol's limit.)
func TestPublisherRefusesAContentHeaderBeyondFrameMax(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	st, err := apply([]Option{WithURL(brokerURL)})
	if err != nil {
		t.Fatal(err)
	}
	p := newPublisher(st)
	defer p.close()
	ctx := context.Background()
	if err := p.publish(ctx, "", q, amqp.Publishing{Body: []byte("warm-up")}, 0, nil); err != nil {
		t.Fatal(err)
	}
	conn := connOf(p)
	budget := budgetOf(t, conn)

	exact := headerSizeWitness()
	exact.Body = []byte("exact")
	padTo(t, &exact, "pad", budget)
	if err := p.publish(ctx, "", q, exact, 0, nil); err != nil {
		t.Fatalf("a content header of exactly the budget, %d bytes: %v", budget, err)
	}
	over := headerSizeWitness()
	over.Body = []byte("over")
	padTo(t, &over, "pad", budget+1)
	if err := p.publish(ctx, "", q, over, 0, nil); !errors.Is(err, errHeaderTooLarge) {
		t.Fatalf("a content header one byte over the budget: %v, want %v", err, errHeaderTooLarge)
	}
	// With room kept for what the broker adds, the limit moves down.
	exact.Body = []byte("exact-reserve")
	padTo(t, &exact, "pad", budget-100)
	if err := p.publish(ctx, "", q, exact, 100, nil); err != nil {
		t.Fatalf("a content header of exactly the budget less the reserve: %v", err)
	}
	padTo(t, &exact, "pad", budget-99)
	if err := p.publish(ctx, "", q, exact, 100, nil); !errors.Is(err, errHeaderTooLarge) {
		t.Fatalf("a content header one byte over the budget less the reserve: %v, want %v", err, errHeaderTooLarge)
	}
	checkConnSurvived(t, p, conn)
	got := a.drain(q)
	if len(got) != 3 || string(got[1].Body) != "exact" || string(got[2].Body) != "exact-reserve" {
		t.Fatalf("queue holds %d messages, want the warm-up and the two exact ones", len(got))
	}
	if got[1].Headers["utf8"] != "\xff\xfe" || got[1].Headers["ünï c"] != "" {
		t.Fatalf("headers did not arrive as sent: %v", stringHeaders(got[1].Headers))
	}

	// The broker's side, on a connection of its own.
	raw, err := amqp.Dial(brokerURL)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	closed := raw.NotifyClose(make(chan *amqp.Error, 1))
	ch, err := raw.Channel()
	if err != nil {
		t.Fatal(err)
	}
	padTo(t, &over, "pad", budget+frameOverhead+1)
	// The broker may close the connection while the client still writes
	// the message's frames: Publish then fails, and the close below says why.
	_ = ch.Publish("", q, false, false, over)
	select {
	case e := <-closed:
		if e == nil || e.Code != amqp.FrameError {
			t.Fatalf("the broker answered a content header larger than frame_max with %v, want a FRAME_ERROR closing the connection", e)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the broker kept the connection open after a content header larger than frame_max")
	}
}

// Another adapter's headers may have names longer than an AMQP field name
// (255 bytes): amqp091 refuses such a publish every time, so the message
// would never leave its stream. The copy keeps them in one JSON header,
// merged with one an earlier trip left; the others arrive byte for byte,
// spaces, Unicode, empty and invalid UTF-8 values included.
func TestDeadLetterKeepsLongHeaderNamesInJSON(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	x := openSink(t, "", dlq)
	long := strings.Repeat("n", 300)
	longer := strings.Repeat("m", 70000)
	d := &adapters.Delivery{ID: "f-1", Body: []byte("b"), Queue: "kafka/orders", Partition: 1, Offset: 2, Headers: map[string]string{
		long:                       "long name",
		longer:                     "\xff bytes",
		"name with spaces/ünïcode": "v",
		"empty":                    "",
		"not-utf8":                 "\xff\xfe",
		HeaderOriginalHeaders:      `{"from-an-earlier-trip":"kept"}`,
	}}
	if err := x.Send(context.Background(), d, foreignFailure()); err != nil {
		t.Fatalf("Send of a delivery with a %d-byte header name: %v", len(long), err)
	}
	got := a.drain(dlq)
	if len(got) != 1 {
		t.Fatalf("dead-letter queue holds %d messages, want 1", len(got))
	}
	m := got[0]
	checkFreshDiagnostics(t, stringHeaders(m.Headers))
	for k, v := range map[string]string{"name with spaces/ünïcode": "v", "empty": "", "not-utf8": "\xff\xfe"} {
		if g, ok := m.Headers[k]; !ok || g != v {
			t.Errorf("header %q = %q (present %v), want %q", k, g, ok, v)
		}
	}
	var aside map[string]string
	if err := json.Unmarshal([]byte(m.Headers[HeaderOriginalHeaders].(string)), &aside); err != nil {
		t.Fatalf("%s = %q: %v", HeaderOriginalHeaders, m.Headers[HeaderOriginalHeaders], err)
	}
	want := map[string]string{long: "long name", longer: "\ufffd bytes", "from-an-earlier-trip": "kept"}
	if len(aside) != len(want) {
		t.Errorf("%s holds %d headers, want %d", HeaderOriginalHeaders, len(aside), len(want))
	}
	for k, v := range want {
		if aside[k] != v {
			t.Errorf("%s[%.20q...] = %q, want %q", HeaderOriginalHeaders, k, aside[k], v)
		}
	}
}

// A message id longer than the message-id property (a short string) is
// carried by the diagnostics only.
func TestDeadLetterTakesALongForeignID(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	x := openSink(t, "", dlq)
	id := strings.Repeat("i", 300)
	if err := x.Send(context.Background(), &adapters.Delivery{ID: id, Body: []byte("b"), Partition: -1, Offset: -1}, foreignFailure()); err != nil {
		t.Fatalf("Send of a delivery with a %d-byte id: %v", len(id), err)
	}
	got := a.drain(dlq)
	if len(got) != 1 || got[0].MessageId != "" || got[0].Headers[adapters.HeaderOriginalID] != id {
		t.Fatalf("dead-letter queue holds %d messages; want one without a message-id and with %s in full", len(got), adapters.HeaderOriginalID)
	}
}

// A foreign delivery may carry the broker's own header names (bridged from
// RabbitMQ, or look-alikes). Under those names a copy replayed from the
// dead-letter queue would start at a stale attempt (x-delivery-count), and
// a text x-death would be silently replaced by the broker when the
// dead-letter queue dead-letters the copy in turn. The copy keeps them as
// custody-original-<name>.
func TestDeadLetterSetsAsideForeignBrokerHeaders(t *testing.T) {
	a := newAdmin(t)
	final := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": final})
	x := openSink(t, "", dlq)
	d := &adapters.Delivery{ID: "f-2", Body: []byte("b"), Queue: "kafka/orders", Partition: 0, Offset: 9, Headers: map[string]string{
		"x-death":             "a broker header look-alike",
		"x-delivery-count":    "7",
		"x-first-death-queue": "elsewhere",
	}}
	if err := x.Send(context.Background(), d, foreignFailure()); err != nil {
		t.Fatal(err)
	}
	// Replayed: the copy's first delivery is its first attempt (0 from a
	// classic queue, which counts nothing), not the foreign count's.
	s := openSource(t, dlq, WithPrefetch(10), WithDeadLetterByPolicy())
	r := receiveN(t, s, 1)[0]
	if r.Attempt > 1 {
		t.Errorf("a copy read back from the dead-letter queue is at attempt %d, want its first", r.Attempt)
	}
	// Dead-lettered by the broker in turn, it keeps the foreign values.
	native, err := s.NativeDeadLetter()
	if err != nil {
		t.Fatal(err)
	}
	if err := native.Send(context.Background(), r, foreignFailure()); err != nil {
		t.Fatal(err)
	}
	a.waitReady(final, 1)
	h := stringHeaders(a.drain(final)[0].Headers)
	want := map[string]string{
		HeaderOriginalXDeath:                   "a broker header look-alike",
		"custody-original-x-delivery-count":    "7",
		"custody-original-x-first-death-queue": "elsewhere",
		"x-first-death-queue":                  dlq,
	}
	for k, v := range want {
		if h[k] != v {
			t.Errorf("header %s = %q, want %q", k, h[k], v)
		}
	}
	if !strings.Contains(h["x-death"], `"reason":"rejected"`) {
		t.Errorf("x-death %s is not the broker's", h["x-death"])
	}
}

// An x-death that is not an array of tables, or whose entry for a queue
// and reason has a count that is not a number, crashes the RabbitMQ queue
// that dead-letters the message: a dead-letter copy carrying one would take
// its dead-letter queue down when that queue dead-letters it (a TTL, a
// length limit, a reject). The copy keeps such an x-death aside; the
// broker's own history stays x-death.
func TestDeadLetterSetsAsideMalformedXDeath(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	final := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": final})
	history := []any{amqp.Table{"queue": "somewhere", "reason": "expired", "count": int64(1), "exchange": "", "routing-keys": []any{"somewhere"}}}
	textCount := []any{amqp.Table{"queue": dlq, "reason": "rejected", "count": "one"}}
	a.publishMsg(q, amqp.Publishing{MessageId: "not-tables", Body: []byte("not-tables"), Headers: amqp.Table{"x-death": []any{"not a table"}}})
	a.publishMsg(q, amqp.Publishing{MessageId: "text-count", Body: []byte("text-count"), Headers: amqp.Table{"x-death": textCount}})
	a.publishMsg(q, amqp.Publishing{MessageId: "history", Body: []byte("history"), Headers: amqp.Table{"x-death": history}})
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, "", dlq)
	ctx := context.Background()
	for _, d := range receiveN(t, s, 3) {
		if err := x.Send(ctx, d, foreignFailure()); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		m, ok, err := a.ch.Get(dlq, false)
		if err != nil || !ok {
			t.Fatalf("get from the dead-letter queue: %v, %v", ok, err)
		}
		if err := m.Reject(false); err != nil {
			t.Fatal(err)
		}
	}
	a.waitReady(final, 3)
	byID := map[string]map[string]string{}
	for _, m := range a.drain(final) {
		byID[m.MessageId] = stringHeaders(m.Headers)
	}
	for id, aside := range map[string]string{"not-tables": `["not a table"]`, "text-count": `"count":"one"`} {
		if h := byID[id]; h == nil || !strings.Contains(h[HeaderOriginalXDeath], aside) {
			t.Errorf("the copy of the message with a malformed x-death %s: headers %v", id, h)
		}
	}
	if h := byID["history"]; h == nil || !strings.Contains(h["x-death"], `"queue":"somewhere"`) || !strings.Contains(h["x-death"], `"queue":"`+dlq+`"`) {
		t.Errorf("the copy of the message with the broker's history lost it: x-death %s", byID["history"]["x-death"])
	}
}

// A dead-letter copy whose content header would exceed frame_max leaves out
// the largest headers, names them in HeaderDroppedHeaders, and keeps the
// body and the diagnostics; the sink's connection survives. Sent as it was,
// the broker would close the connection every time and the message would
// never leave its stream. Here: a message that arrived within the frame but
// whose copy, with the diagnostics, would not fit; another adapter's
// oversized header; and another adapter's oversized key (a diagnostic).
func TestDeadLetterDropsHeadersBeyondFrameMax(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	x := openSink(t, "", dlq)
	before := connOf(x.pub)
	ctx := context.Background()

	near := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &near, "big", budget-50)
	a.publishMsg(q, near)
	s := openSource(t, q, WithPrefetch(10))
	if err := x.Send(ctx, receiveN(t, s, 1)[0], foreignFailure()); err != nil {
		t.Fatalf("Send of a delivery whose copy exceeds frame_max: %v", err)
	}
	if err := x.Send(ctx, &adapters.Delivery{ID: "large", Body: []byte("large"), Queue: "kafka/orders", Partition: 0, Offset: 1,
		Headers: map[string]string{"large": strings.Repeat("h", 150<<10), "kept": "yes"}}, foreignFailure()); err != nil {
		t.Fatalf("Send of a delivery with a 150 KiB header: %v", err)
	}
	if err := x.Send(ctx, &adapters.Delivery{ID: "key", Body: []byte("key"), Queue: "kafka/orders", Partition: 0, Offset: 2,
		Key: strings.Repeat("k", 150<<10), Headers: map[string]string{"kept": "yes"}}, foreignFailure()); err != nil {
		t.Fatalf("Send of a delivery with a 150 KiB key: %v", err)
	}
	checkConnSurvived(t, x.pub, before)

	got := map[string]map[string]string{}
	for _, m := range a.drain(dlq) {
		got[string(m.Body)] = stringHeaders(m.Headers)
	}
	for body, droppedHeader := range map[string]string{"near": "big", "large": "large", "key": adapters.HeaderOriginalKey} {
		h, ok := got[body]
		if !ok {
			t.Errorf("dead-letter queue lacks %q", body)
			continue
		}
		checkFreshDiagnostics(t, h)
		if h["kept"] != "yes" {
			t.Errorf("%s: a small header was dropped too: %v", body, h)
		}
		if _, ok := h[droppedHeader]; ok {
			t.Errorf("%s: header %s was not dropped", body, droppedHeader)
		}
		var rec struct {
			Reason  string         `json:"reason"`
			Headers map[string]int `json:"headers"`
		}
		if err := json.Unmarshal([]byte(h[HeaderDroppedHeaders]), &rec); err != nil {
			t.Errorf("%s: %s = %q: %v", body, HeaderDroppedHeaders, h[HeaderDroppedHeaders], err)
			continue
		}
		if len(rec.Headers) != 1 || rec.Headers[droppedHeader] < 100<<10 || !strings.Contains(rec.Reason, "frame_max") {
			t.Errorf("%s: %s = %s, want it to name %s alone, with its size, and say why", body, HeaderDroppedHeaders, h[HeaderDroppedHeaders], droppedHeader)
		}
	}
}

// A retry's copy adds the attempt, the first receive time and the original
// route to the message. When that would push a content header that arrived
// within the frame over frame_max (less the room kept for the headers the
// broker adds on the copy's way through the delay queue and back), the copy
// leaves out the diagnostic bookkeeping, never the message's own headers,
// and is still published.
func TestRetryCopyNearFrameMaxKeepsTheMessage(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	name := delayQueueName(q, delayStep(10*time.Millisecond))
	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &m, "big", budget-brokerAdditions(name, "", name)-brokerAdditions(q, "", q)-30)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	before := connect(t, s.pub)
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 1 || st.RetryFailures != 0 {
		t.Fatalf("stats %+v: want the retry's copy published to the delay queue", st)
	}
	d = receiveN(t, s, 1)[0]
	checkConnSurvived(t, s.pub, before)
	if d.Attempt != 2 || d.Headers[HeaderAttempt] != "2" || d.Headers["kept"] != "yes" || d.Headers["big"] != m.Headers["big"] {
		t.Fatalf("retry: attempt %d, %s %q, kept %q, big intact %v", d.Attempt, HeaderAttempt, d.Headers[HeaderAttempt], d.Headers["kept"], d.Headers["big"] == m.Headers["big"])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// When not even the attempt counter fits, the retry's copy is sent neither
// to the delay queue nor to the queue (the broker would close the
// publishing connection over it, on every retry): the original is requeued
// whole, and the connection survives.
func TestRetryCopyBeyondFrameMaxRequeuesTheOriginal(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	m := amqp.Publishing{MessageId: "full", Body: []byte("full"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &m, "big", budget-10)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	before := connect(t, s.pub)
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.RetryFailures != 1 || st.RetriedAtOnce != 0 || st.Rejects != 1 {
		t.Fatalf("stats %+v: want the copy refused everywhere and the original requeued", st)
	}
	d = receiveN(t, s, 1)[0]
	checkConnSurvived(t, s.pub, before)
	if d.Headers["kept"] != "yes" || d.Headers["big"] != m.Headers["big"] || d.Attempt != 2 {
		t.Fatalf("requeued original: attempt %d, kept %q, big intact %v", d.Attempt, d.Headers["kept"], d.Headers["big"] == m.Headers["big"])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// A message replayed from a dead-letter queue carries the diagnostics of
// its earlier trip; a new dead-letter copy describes the new failure only.
// The original route survives: retries keep it in the headers, and the
// copy reads it before it drops the old diagnostics.
func TestDeadLetterReplacesStaleDiagnostics(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	ex := a.exchangeTo(q, "rk")
	stale := amqp.Table{
		adapters.HeaderOriginalPart: "7777", adapters.HeaderOriginalOffset: "7777", adapters.HeaderOriginalKey: "stale-key",
		adapters.HeaderOriginalID: "stale-id", adapters.HeaderError: "stale", "own": "kept",
	}
	dc, err := a.ch.PublishWithDeferredConfirm(ex, "rk", true, false, amqp.Publishing{Body: []byte("native"), Headers: stale})
	if err != nil || !dc.Wait() {
		t.Fatalf("publish: %v", err)
	}
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	x := openSink(t, "", dlq)
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0] // the retry's copy, through a delay queue and the default exchange
	if err := x.Send(ctx, d, foreignFailure()); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	foreign := map[string]string{"own": "kept", HeaderOriginalExchange: "stale-exchange", HeaderOriginalRoutingKey: "stale-key"}
	for k, v := range stale {
		foreign[k] = v.(string)
	}
	if err := x.Send(ctx, &adapters.Delivery{ID: "fresh-id", Body: []byte("foreign"), Queue: "kafka/orders", Partition: -1, Offset: -1, Headers: foreign}, foreignFailure()); err != nil {
		t.Fatal(err)
	}
	got := map[string]map[string]string{}
	for _, m := range a.drain(dlq) {
		got[string(m.Body)] = stringHeaders(m.Headers)
	}
	for body, route := range map[string][2]string{"native": {ex, "rk"}, "foreign": {"", "kafka/orders"}} {
		h := got[body]
		if h == nil {
			t.Errorf("dead-letter queue lacks %q", body)
			continue
		}
		checkFreshDiagnostics(t, h)
		for _, k := range []string{adapters.HeaderOriginalPart, adapters.HeaderOriginalOffset, adapters.HeaderOriginalKey} {
			if v, ok := h[k]; ok {
				t.Errorf("%s: stale %s = %q survived", body, k, v)
			}
		}
		if v := h[adapters.HeaderOriginalID]; v == "stale-id" {
			t.Errorf("%s: stale %s survived", body, adapters.HeaderOriginalID)
		}
		if h["own"] != "kept" {
			t.Errorf("%s: the message's own header was lost: %v", body, h)
		}
		if h[HeaderOriginalExchange] != route[0] || h[HeaderOriginalRoutingKey] != route[1] {
			t.Errorf("%s: original route %q/%q, want %q/%q", body, h[HeaderOriginalExchange], h[HeaderOriginalRoutingKey], route[0], route[1])
		}
	}
}

// fitDeadLetter leaves out as little as it can: nothing when the copy fits,
// the largest of the message's own headers first, a diagnostic only when it
// cannot fit beside the essentials, never the essential diagnostics; and its
// record names exactly what it left out, merged with an earlier trip's.
func TestFitDeadLetter(t *testing.T) {
	const budget = 4096 - frameOverhead
	essentials := func() amqp.Table {
		h := amqp.Table{}
		for k, v := range adapters.Diagnostics(&adapters.Delivery{ID: "id", Queue: "q", Partition: 1, Offset: 2, Key: "k", PublishedAt: time.Now()}, foreignFailure()) {
			h[k] = v
		}
		return h
	}
	for _, tc := range []struct {
		name        string
		headers     amqp.Table
		wantDropped []string
	}{
		{"fits", amqp.Table{"a": strings.Repeat("a", 1000), "b": strings.Repeat("b", 1000)}, nil},
		{"largest own first", amqp.Table{"a": strings.Repeat("a", 2000), "b": strings.Repeat("b", 1500), "c": strings.Repeat("c", 1000), "small": "s"}, []string{"a"}},
		{"as many as needed", amqp.Table{"a": strings.Repeat("a", 2000), "b": strings.Repeat("b", 2000), "c": strings.Repeat("c", 1999), "small": "s"}, []string{"a", "b"}},
		{"nested values", amqp.Table{"x-death": []any{amqp.Table{"queue": strings.Repeat("q", 5000)}}, "small": int32(1)}, []string{"x-death"}},
		{"a diagnostic too large by itself", amqp.Table{adapters.HeaderOriginalKey: strings.Repeat("k", 5000), "own": strings.Repeat("o", 1000)}, []string{adapters.HeaderOriginalKey}},
		{"earlier record merged", amqp.Table{HeaderDroppedHeaders: `{"reason":"r","headers":{"earlier":99}}`, "a": strings.Repeat("a", 5000)}, []string{"a", "earlier"}},
		{"foreign record kept as dropped", amqp.Table{HeaderDroppedHeaders: "not ours", "a": strings.Repeat("a", 5000)}, []string{"a", HeaderDroppedHeaders}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := amqp.Publishing{Headers: essentials(), MessageId: "id", DeliveryMode: amqp.Persistent, Timestamp: time.Now()}
			for k, v := range tc.headers {
				p.Headers[k] = v
			}
			before := maps.Clone(p.Headers)
			fitDeadLetter(&p, budget, budget+frameOverhead)
			if n, err := headerFrameSize(&p); err != nil || n > budget {
				t.Fatalf("the copy takes %d bytes (%v), budget %d", n, err, budget)
			}
			rec, ok := p.Headers[HeaderDroppedHeaders].(string)
			if len(tc.wantDropped) == 0 {
				if ok || len(p.Headers) != len(before) {
					t.Fatalf("a copy that fits lost headers: %v", p.Headers)
				}
				return
			}
			var r struct {
				Reason  string         `json:"reason"`
				Headers map[string]int `json:"headers"`
			}
			if err := json.Unmarshal([]byte(rec), &r); err != nil || !strings.Contains(r.Reason, "frame_max (4096 bytes)") {
				t.Fatalf("record %q: %v", rec, err)
			}
			var got []string
			for k := range r.Headers {
				got = append(got, k)
			}
			slices.Sort(got)
			if !slices.Equal(got, tc.wantDropped) {
				t.Fatalf("dropped %v, want %v", got, tc.wantDropped)
			}
			for k := range before {
				_, named := r.Headers[k]
				_, kept := p.Headers[k]
				if k != HeaderDroppedHeaders && named == kept {
					t.Errorf("header %s: kept %v, named in the record %v", k, kept, named)
				}
			}
			for k := range essentials() {
				if _, ok := p.Headers[k]; !ok && !bulkyDiagnostics[k] {
					t.Errorf("essential diagnostic %s dropped", k)
				}
			}
		})
	}
}

// A retry through a delay queue passes a dead-letter hop, where the broker
// adds x-death and x-first-death-* to the copy. A copy that fitted frame_max
// without them would reach the consumer larger than the frame: its client
// refuses the frame and closes the connection, the broker redelivers the
// message, and so on for ever, stalling the queue. The copy must leave room
// for them; one that cannot is published to the queue at once instead
// (where the broker adds nothing on the way) or, failing that, the original
// is requeued whole.
func TestDelayedRetryLeavesRoomForTheBrokersHeaders(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues(),
		WithReconnectBackoff(10*time.Millisecond, 100*time.Millisecond))
	ctx := context.Background()
	// Measure what the delay queue's hop adds, with a small probe.
	a.publish(q, "probe")
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	var native amqp.Delivery
	if !d.As(&native) || native.Headers["x-death"] == nil {
		t.Fatalf("the probe did not come back through the delay queue: %v", d.Headers)
	}
	added := 0
	for k, v := range native.Headers {
		if strings.HasPrefix(k, "x-") {
			e, _ := entrySize(k, v)
			added += e
		}
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}

	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &m, "big", budget-added-10)
	a.publishMsg(q, m)
	d = receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 100*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	var back []*adapters.Delivery
	for len(back) == 0 && rctx.Err() == nil {
		back, _ = s.Receive(rctx, 1)
	}
	cancel()
	if len(back) == 0 {
		t.Fatalf("the retry never came back; stats %+v: each generation is a reconnection, the copy reached the Source larger than a frame", s.Stats())
	}
	d = back[0]
	if st := s.Stats(); st.Generations != 1 {
		t.Fatalf("stats %+v: the Source reconnected; the copy reached it larger than a frame", st)
	}
	if d.ID != "near" || d.Attempt != 2 || d.Headers["kept"] != "yes" || d.Headers["big"] != m.Headers["big"] {
		t.Fatalf("retry of %q: attempt %d, kept %q, big intact %v", d.ID, d.Attempt, d.Headers["kept"], d.Headers["big"] == m.Headers["big"])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// A dead-letter copy trimmed to fit frame_max leaves room for the headers
// the broker adds when the dead-letter queue dead-letters it in turn (a
// TTL, a length limit, a reject into a parking queue): whoever reads it
// next can still take the frame. Many small headers make the trimmed copy
// end close to the limit.
func TestDeadLetterCopyLeavesRoomForTheBrokersHeaders(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	final := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": final})
	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	for i := 0; ; i++ {
		m.Headers[fmt.Sprintf("h%04d", i)] = strings.Repeat("v", 100)
		if n, _ := headerFrameSize(&m); n > budget-200 {
			delete(m.Headers, fmt.Sprintf("h%04d", i))
			break
		}
	}
	padTo(t, &m, "pad", budget-50)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10))
	x := openSink(t, "", dlq)
	if err := x.Send(context.Background(), receiveN(t, s, 1)[0], foreignFailure()); err != nil {
		t.Fatal(err)
	}
	got, ok, err := a.ch.Get(dlq, false)
	if err != nil || !ok {
		t.Fatalf("get from the dead-letter queue: %v, %v", ok, err)
	}
	if err := got.Reject(false); err != nil {
		t.Fatal(err)
	}
	a.waitReady(final, 1)
	parked, ok, err := a.ch.Get(final, true)
	if err != nil || !ok {
		t.Fatalf("the copy dead-lettered out of the dead-letter queue cannot be read: %v, %v", ok, err)
	}
	h := stringHeaders(parked.Headers)
	checkFreshDiagnostics(t, h)
	if h["kept"] != "yes" || !strings.Contains(h["x-death"], dlq) || !strings.Contains(h[HeaderDroppedHeaders], `"h0000"`) {
		t.Fatalf("parked copy headers: kept %q, x-death %s, %s %s", h["kept"], h["x-death"], HeaderDroppedHeaders, h[HeaderDroppedHeaders])
	}
}

// A retry's copy published to the queue itself (when the delay queue does
// not take it) may later be dead-lettered by the queue (Source.NativeDeadLetter,
// a TTL, a length limit), where the broker adds x-death and x-first-death-*.
// Here the original leaves room for them and its copy, with the attempt
// counter added, would not: the copy is not published, and the original is
// requeued and dead-lettered readable. Published, the copy would reach the
// dead-letter queue larger than a frame, and every client reading it would
// refuse it and lose its connection.
func TestRetryCopyLeavesRoomForTheBrokersHeaders(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	final := a.queue(ClassicQueue, nil)
	q := a.queue(ClassicQueue, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": final})
	// Measure what this broker adds when q dead-letters a message.
	probe := amqp.Table{"kept": "yes"}
	a.publishMsg(q, amqp.Publishing{MessageId: "probe", Body: []byte("probe"), Headers: probe})
	pm, ok, err := a.ch.Get(q, false)
	if err != nil || !ok {
		t.Fatalf("get the probe: %v, %v", ok, err)
	}
	if err := pm.Reject(false); err != nil {
		t.Fatal(err)
	}
	a.waitReady(final, 1)
	withDeath, _ := tableSize(a.drain(final)[0].Headers)
	without, _ := tableSize(probe)
	added := withDeath - without

	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &m, "big", budget-added-10)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10), WithDeadLetterByPolicy(), WithDelayQueues())
	native, err := s.NativeDeadLetter()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	d = receiveN(t, s, 1)[0]
	if err := native.Send(ctx, d, foreignFailure()); err != nil {
		t.Fatal(err)
	}
	a.waitReady(final, 1)
	parked, ok, err := a.ch.Get(final, true)
	if err != nil || !ok {
		t.Fatalf("the message dead-lettered after its retry cannot be read: %v, %v", ok, err)
	}
	h := stringHeaders(parked.Headers)
	if h["kept"] != "yes" || h["big"] != m.Headers["big"] || !strings.Contains(h["x-death"], q) {
		t.Fatalf("parked message: kept %q, big intact %v, x-death %s", h["kept"], h["big"] == m.Headers["big"], h["x-death"])
	}
}

// A retry's copy that fits frame_max once it leaves out the first receive
// time keeps its original route: the bookkeeping is shed a group at a time,
// only as far as needed, and the route is what the dead-letter copy names.
func TestRetryCopyShedsOnlyWhatItMust(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	attempt, _ := entrySize(HeaderAttempt, int64(2))
	exchange, _ := entrySize(HeaderOriginalExchange, "")
	key, _ := entrySize(HeaderOriginalRoutingKey, q)
	first, _ := entrySize(HeaderFirstReceived, "2006-01-02T15:04:05Z") // the shortest time it writes
	// Room for the attempt and the route, not for the first receive time.
	slack := attempt + exchange + key + first/2
	name := delayQueueName(q, delayStep(10*time.Millisecond))
	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	padTo(t, &m, "big", budget-brokerAdditions(name, "", name)-brokerAdditions(q, "", q)-slack)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 10*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 1 {
		t.Fatalf("stats %+v: want the copy through the delay queue", st)
	}
	d = receiveN(t, s, 1)[0]
	if d.Attempt != 2 || d.Headers["big"] != m.Headers["big"] {
		t.Fatalf("retry: attempt %d, big intact %v", d.Attempt, d.Headers["big"] == m.Headers["big"])
	}
	if _, ok := d.Headers[HeaderFirstReceived]; ok {
		t.Fatalf("the copy kept %s although it could not fit", HeaderFirstReceived)
	}
	if route, ok := d.Headers[HeaderOriginalRoutingKey]; !ok || route != q {
		t.Fatalf("the copy's original routing key %q (present %v), want %q: shed although it fitted", route, ok, q)
	}
	if _, ok := d.Headers[HeaderOriginalExchange]; !ok {
		t.Fatalf("the copy left out %s although it fitted", HeaderOriginalExchange)
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}

// A retry through a delay queue passes two queues that may dead-letter the
// copy, the delay queue (always) and the source queue, so its copy leaves
// room for the headers both add. One that fits beside the source queue's
// alone is not sent through the delay queue, where the headers of the
// second hop could take it past frame_max, but to the queue at once, where
// it fits.
func TestDelayQueueCopyLeavesRoomForBothHops(t *testing.T) {
	a := newAdmin(t)
	budget := budgetOf(t, a.conn)
	q := a.queue(ClassicQueue, nil)
	source := brokerAdditions(q, "", q)
	name := delayQueueName(q, 250*time.Millisecond)
	delay := brokerAdditions(name, "", name)
	attempt, _ := entrySize(HeaderAttempt, int64(2))
	m := amqp.Publishing{MessageId: "near", Body: []byte("near"), DeliveryMode: amqp.Persistent, Headers: amqp.Table{"kept": "yes"}}
	// Even with all its bookkeeping left out, the copy fits beside the
	// source queue's headers and not beside both queues'.
	padTo(t, &m, "big", budget-source-attempt-delay/2)
	a.publishMsg(q, m)
	s := openSource(t, q, WithPrefetch(10), WithDelayQueues())
	ctx := context.Background()
	d := receiveN(t, s, 1)[0]
	if err := s.Nack(ctx, adapters.NackAll([]*adapters.Delivery{d}, 200*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if st := s.Stats(); st.DelayQueued != 0 || st.RetryFailures != 1 || st.RetriedAtOnce != 1 {
		t.Fatalf("stats %+v: want the delay queue refused for the copy, and the copy published to the queue", st)
	}
	d = receiveN(t, s, 1)[0]
	if d.Attempt != 2 || d.Headers["kept"] != "yes" || d.Headers["big"] != m.Headers["big"] {
		t.Fatalf("retry: attempt %d, kept %q, big intact %v", d.Attempt, d.Headers["kept"], d.Headers["big"] == m.Headers["big"])
	}
	if err := s.Ack(ctx, []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
}
