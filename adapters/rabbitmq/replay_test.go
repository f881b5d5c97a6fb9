package rabbitmq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
)

// deadLetterAll publishes bodies to q (message ids equal to the bodies, a
// text and an integer header each), receives them with a Source, sends each
// to a DeadLetter sink into dlq with a failure whose error is cause(body),
// and acks the originals: dead letters written the way the runtime writes
// them.
func deadLetterAll(t *testing.T, a *admin, q, dlq string, cause func(body string) string, bodies ...string) {
	t.Helper()
	for i, b := range bodies {
		a.publishMsg(q, amqp.Publishing{MessageId: b, Body: []byte(b), DeliveryMode: amqp.Persistent, ContentType: "text/plain",
			Headers: amqp.Table{"tenant": "acme", "seq": int32(i)}})
	}
	s := openSource(t, q, WithPrefetch(len(bodies)))
	sink, err := NewDeadLetter(context.Background(), "", dlq, WithURL(brokerURL))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	ds := receiveN(t, s, len(bodies))
	now := time.Now()
	for _, d := range ds {
		f := adapters.Failure{Err: errors.New(cause(string(d.Body))), Permanent: true, Attempts: 3,
			FirstFailure: now.Add(-time.Minute), LastFailure: now, Consumer: "orders-service"}
		if err := sink.Send(context.Background(), d, f); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ack(context.Background(), ds); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	a.waitReady(dlq, len(bodies))
}

func newReplay(t *testing.T, dlq string, opts ...Option) *Replay {
	t.Helper()
	r, err := NewReplay(context.Background(), dlq, append([]Option{WithURL(brokerURL)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func fixedCause(string) string { return "boom" }

func messageIDs(ms []amqp.Delivery) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.MessageId
	}
	return out
}

// List reads the dead letters with their diagnostics and leaves them all in
// the queue. What it changes: those it listed are flagged redelivered (on a
// quorum queue their x-delivery-count grows), and on a quorum queue, which
// delivers messages returned to it ahead of the others, behind those
// returned before them, a shorter List after a longer one moves what it
// listed behind the rest.
func TestReplayListIsADryRun(t *testing.T) {
	for _, typ := range []QueueType{ClassicQueue, QuorumQueue} {
		t.Run(typ.String(), func(t *testing.T) {
			a := newAdmin(t)
			q := a.queue(ClassicQueue, nil)
			dlq := a.queue(typ, nil)
			bodies := names("m", 6)
			deadLetterAll(t, a, q, dlq, func(b string) string { return "cannot handle " + b }, bodies...)
			r := newReplay(t, dlq)
			list := func(max int) []adapters.DeadLetterRecord {
				t.Helper()
				recs, err := r.List(context.Background(), max)
				if err != nil {
					t.Fatal(err)
				}
				return recs
			}
			ordered := func(recs []adapters.DeadLetterRecord) []string {
				out := make([]string, len(recs))
				for i, rec := range recs {
					out[i] = rec.OriginalID
				}
				return out
			}

			all := list(100)
			if got := ordered(all); !slices.Equal(got, bodies) {
				t.Fatalf("List(100) returned %v, want %v", got, bodies)
			}
			ids := map[string]bool{}
			for i, rec := range all {
				want := bodies[i]
				if string(rec.Body) != want || rec.OriginalQueue != q || rec.Error != "cannot handle "+want ||
					!rec.Permanent || rec.Attempts != 3 || rec.Consumer != "orders-service" || rec.LastFailure.IsZero() {
					t.Errorf("dead letter %d: %+v", i, rec)
				}
				if rec.Headers["tenant"] != "acme" || rec.Headers["seq"] != fmt.Sprint(i) || len(rec.Headers) != 2 {
					t.Errorf("dead letter %d headers %v, want the original's, without diagnostics", i, rec.Headers)
				}
				if rec.Diagnostics[adapters.HeaderOriginalRoutingKey] != q {
					t.Errorf("dead letter %d diagnostics %v, want the original route", i, rec.Diagnostics)
				}
				if rec.ID == "" || ids[rec.ID] {
					t.Errorf("dead letter %d has ID %q, empty or not unique", i, rec.ID)
				}
				ids[rec.ID] = true
			}
			if two := list(2); len(two) != 2 || two[0].ID != all[0].ID || two[1].ID != all[1].ID {
				t.Fatalf("List(2) after List(100) returned %v, want the first two again with the same IDs", ordered(two))
			}
			want := bodies
			if typ == QuorumQueue {
				want = []string{"m3", "m4", "m5", "m6", "m1", "m2"}
			}
			if got := ordered(list(100)); !slices.Equal(got, want) {
				t.Fatalf("after List(2) the queue's order is %v, want %v", got, want)
			}
			a.waitReady(dlq, 6)
			for _, m := range a.drain(dlq) {
				if !m.Redelivered {
					t.Errorf("%s: not flagged redelivered after being listed", m.MessageId)
				}
				if typ == QuorumQueue {
					listed := int64(2)
					if m.MessageId == "m1" || m.MessageId == "m2" {
						listed = 3
					}
					if n, _ := headerInt(m.Headers, "x-delivery-count"); n != listed {
						t.Errorf("%s: x-delivery-count %d, want %d (listed %d times)", m.MessageId, n, listed, listed)
					}
				}
			}
			if _, err := r.List(context.Background(), 0); err == nil {
				t.Error("List(0) did not fail")
			}
		})
	}
}

// Replay copies the dead letters back to their queue, strips the
// diagnostics and keeps the rest (typed headers, properties), marks each
// copy with the dead letter's ID, and empties the dead-letter queue.
func TestReplayMovesDeadLettersBack(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	bodies := names("m", 5)
	deadLetterAll(t, a, q, dlq, fixedCause, bodies...)
	r := newReplay(t, dlq)
	recs, err := r.List(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed != 5 || res.Skipped != 0 {
		t.Fatalf("Replay: %+v, want 5 replayed", res)
	}
	if n := a.ready(dlq); n != 0 {
		t.Fatalf("%d dead letters left", n)
	}
	a.waitReady(q, 5)
	got := a.drain(q)
	if ids := messageIDs(got); !slices.Equal(ids, bodies) {
		t.Fatalf("replayed %v, want %v in order", ids, bodies)
	}
	for i, m := range got {
		if string(m.Body) != bodies[i] || m.ContentType != "text/plain" || m.DeliveryMode != amqp.Persistent {
			t.Errorf("copy %d: body %q, content type %q, delivery mode %d", i, m.Body, m.ContentType, m.DeliveryMode)
		}
		if m.Headers["tenant"] != "acme" || m.Headers["seq"] != int32(i) {
			t.Errorf("copy %d headers %v: want tenant and the int32 seq kept as they were", i, m.Headers)
		}
		if m.Headers[adapters.HeaderReplayOf] != recs[i].ID {
			t.Errorf("copy %d: %s = %v, want the dead letter's ID %s", i, adapters.HeaderReplayOf, m.Headers[adapters.HeaderReplayOf], recs[i].ID)
		}
		for k := range m.Headers {
			if adapters.IsDiagnosticHeader(k) && k != adapters.HeaderReplayOf {
				t.Errorf("copy %d carries %s", i, k)
			}
		}
		if len(m.Headers) != 3 {
			t.Errorf("copy %d headers %v, want the two original ones and %s", i, m.Headers, adapters.HeaderReplayOf)
		}
	}
	// A second run finds nothing.
	if res, err := r.Replay(context.Background(), adapters.ReplayOptions{}); err != nil || res != (adapters.ReplayResult{}) {
		t.Fatalf("second Replay: %+v, %v; want nothing done", res, err)
	}
}

// Select leaves dead letters in the queue, in their order; Max bounds what
// is replayed; KeepDiagnostics packs the diagnostics into one header.
func TestReplaySelectMaxAndKeepDiagnostics(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	bodies := names("m", 8)
	deadLetterAll(t, a, q, dlq, func(b string) string {
		if b == "m2" || b == "m5" || b == "m8" {
			return "bug 42"
		}
		return "timeout"
	}, bodies...)
	r := newReplay(t, dlq)
	recs, err := r.List(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	groups := adapters.GroupDeadLetters(recs)
	if len(groups) != 2 || groups[0].Error != "timeout" || groups[0].Count != 5 || groups[1].Count != 3 {
		t.Fatalf("groups %+v", groups)
	}
	bug := func(rec adapters.DeadLetterRecord) bool { return rec.Error == "bug 42" }
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Select: bug, Max: 2, Rate: 1000, KeepDiagnostics: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed != 2 || res.Skipped != 3 {
		t.Fatalf("Replay: %+v, want 2 replayed (Max) and the 3 before the second left out", res)
	}
	a.waitReady(q, 2)
	got := a.drain(q)
	if ids := messageIDs(got); !slices.Equal(ids, []string{"m2", "m5"}) {
		t.Fatalf("replayed %v, want m2 and m5", ids)
	}
	var diag map[string]string
	if err := json.Unmarshal([]byte(got[0].Headers[adapters.HeaderReplayDiagnostics].(string)), &diag); err != nil {
		t.Fatalf("%s: %v", adapters.HeaderReplayDiagnostics, err)
	}
	if diag[adapters.HeaderError] != "bug 42" || diag[adapters.HeaderOriginalQueue] != q || diag[adapters.HeaderAttempts] != "3" {
		t.Fatalf("packed diagnostics %v", diag)
	}
	a.waitReady(dlq, 6)
	left := messageIDs(a.drain(dlq))
	if want := []string{"m1", "m3", "m4", "m6", "m7", "m8"}; !slices.Equal(left, want) {
		t.Fatalf("left in the dead-letter queue %v, want %v in order", left, want)
	}
}

// Bad options and a missing queue fail with what to do.
func TestReplayRefusesBadInput(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(ClassicQueue, nil)
	if _, err := NewReplay(context.Background(), dlq+"-missing", WithURL(brokerURL)); err == nil || !strings.Contains(err.Error(), "check the name") {
		t.Errorf("NewReplay of a missing queue: %v", err)
	}
	if _, err := NewReplay(context.Background(), dlq, WithURL(brokerURL), WithPrefetch(3)); err == nil || !strings.Contains(err.Error(), "WithPrefetch") {
		t.Errorf("NewReplay with WithPrefetch: %v", err)
	}
	if _, err := NewReplay(context.Background(), ""); err == nil {
		t.Error("NewReplay of no queue did not fail")
	}
	if _, err := New(context.Background(), dlq, WithURL(brokerURL), WithReplayThroughExchange()); err == nil || !strings.Contains(err.Error(), "WithReplayThroughExchange") {
		t.Errorf("New with WithReplayThroughExchange: %v", err)
	}
	if _, err := NewDeadLetter(context.Background(), "", dlq, WithURL(brokerURL), WithReplayThroughExchange()); err == nil || !strings.Contains(err.Error(), "WithReplayThroughExchange") {
		t.Errorf("NewDeadLetter with WithReplayThroughExchange: %v", err)
	}
	r := newReplay(t, dlq)
	for _, o := range []adapters.ReplayOptions{{Rate: -1}, {Max: -1}} {
		if _, err := r.Replay(context.Background(), o); err == nil {
			t.Errorf("Replay(%+v) did not fail", o)
		}
	}
}

// A copy the broker cannot route (its queue was deleted) is an error, and
// the dead letter stays, with those after it.
func TestReplayUnroutableKeepsTheDeadLetter(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	deadLetterAll(t, a, q, dlq, fixedCause, "m1", "m2")
	if _, err := a.ch.QueueDelete(q, false, false, false); err != nil {
		t.Fatal(err)
	}
	r := newReplay(t, dlq)
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if !errors.Is(err, errUnroutable) || res.Replayed != 0 {
		t.Fatalf("Replay to a deleted queue: %+v, %v; want an unroutable error and nothing replayed", res, err)
	}
	a.waitReady(dlq, 2)
	if ids := messageIDs(a.drain(dlq)); !slices.Equal(ids, []string{"m1", "m2"}) {
		t.Fatalf("dead-letter queue holds %v, want m1 and m2", ids)
	}
}

// By default a copy goes to the queue whose consumer failed, and to no
// other queue its first route reaches; WithReplayThroughExchange publishes
// it through that route again, to every queue bound to it.
func TestReplayRoutes(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	other := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	ex := a.exchangeTo(q, "orders.created")
	if err := a.ch.QueueBind(other, "orders.created", ex, false, nil); err != nil {
		t.Fatal(err)
	}
	dc, err := a.ch.PublishWithDeferredConfirm(ex, "orders.created", true, false, amqp.Publishing{MessageId: "o1", Body: []byte("o1")})
	if err != nil || !dc.Wait() {
		t.Fatalf("publish: %v", err)
	}
	a.waitReady(other, 1)
	a.drain(other) // its consumer handled it
	s := openSource(t, q)
	d := receiveN(t, s, 1)[0]
	sink, err := NewDeadLetter(context.Background(), "", dlq, WithURL(brokerURL))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	for range 2 { // two dead letters of it: one for each way of replaying
		if err := sink.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), Attempts: 1, LastFailure: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}

	if res, err := newReplay(t, dlq).Replay(context.Background(), adapters.ReplayOptions{Max: 1, Rate: 1000}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	a.waitReady(q, 1)
	if n := a.ready(other); n != 0 {
		t.Fatalf("the default replay reached %d messages into the other queue bound to the route", n)
	}
	if m := a.drain(q)[0]; m.Exchange != "" || m.RoutingKey != q {
		t.Fatalf("the copy came through exchange %q with routing key %q, want the default exchange to %s", m.Exchange, m.RoutingKey, q)
	}

	if res, err := newReplay(t, dlq, WithReplayThroughExchange()).Replay(context.Background(), adapters.ReplayOptions{Rate: 1000}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay through the exchange: %+v, %v", res, err)
	}
	a.waitReady(q, 1)
	a.waitReady(other, 1)
	if m := a.drain(q)[0]; m.Exchange != ex || m.RoutingKey != "orders.created" {
		t.Fatalf("the copy came through exchange %q with routing key %q, want %s and orders.created", m.Exchange, m.RoutingKey, ex)
	}
}

// Dead letters the broker made (NativeDeadLetter) are listed with their
// queue and reason, and replayed to that queue without the broker's
// headers, or with WithReplayThroughExchange through the exchange and
// routing key of their first death.
func TestReplayOfNativeDeadLetters(t *testing.T) {
	a := newAdmin(t)
	dlq := a.queue(QuorumQueue, nil)
	q := uniqueName(t, "classic")
	t.Cleanup(func() { deleteQueues(q) })
	s := openSource(t, q, WithDeclare(ClassicQueue, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq}))
	ex := a.exchangeTo(q, "orders.created")
	for _, id := range []string{"n1", "n2"} {
		dc, err := a.ch.PublishWithDeferredConfirm(ex, "orders.created", true, false,
			amqp.Publishing{MessageId: id, Body: []byte(id), Headers: amqp.Table{"tenant": "acme"}})
		if err != nil || !dc.Wait() {
			t.Fatalf("publish: %v", err)
		}
	}
	native, err := s.NativeDeadLetter()
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range receiveN(t, s, 2) {
		if err := native.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom")}); err != nil {
			t.Fatal(err)
		}
	}
	a.waitReady(dlq, 2)
	r := newReplay(t, dlq)
	recs, err := r.List(context.Background(), 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 2 || recs[0].OriginalQueue != q || recs[0].Error != "rejected" || recs[0].OriginalID != "n1" ||
		recs[0].LastFailure.IsZero() || recs[0].Diagnostics["x-death"] == "" || len(recs[0].Headers) != 1 {
		t.Fatalf("native dead letters listed as %+v", recs)
	}
	check := func(wantExchange, wantKey string, rec adapters.DeadLetterRecord) {
		t.Helper()
		got := receiveN(t, s, 1)[0]
		m := got.Native.(amqp.Delivery)
		if m.MessageId != rec.OriginalID || m.Headers["tenant"] != "acme" || m.Headers[adapters.HeaderReplayOf] != rec.ID {
			t.Fatalf("replayed copy %+v", m)
		}
		if m.Exchange != wantExchange || m.RoutingKey != wantKey {
			t.Fatalf("%s came through exchange %q with routing key %q, want %q and %q", m.MessageId, m.Exchange, m.RoutingKey, wantExchange, wantKey)
		}
		for _, k := range brokerHeaders {
			if _, ok := m.Headers[k]; ok {
				t.Errorf("the copy carries the broker's %s", k)
			}
		}
		if err := s.Ack(context.Background(), []*adapters.Delivery{got}); err != nil {
			t.Fatal(err)
		}
	}
	if res, err := r.Replay(context.Background(), adapters.ReplayOptions{Max: 1, Rate: 1000}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	check("", q, recs[0])
	if res, err := newReplay(t, dlq, WithReplayThroughExchange()).Replay(context.Background(), adapters.ReplayOptions{Rate: 1000}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay through the exchange: %+v, %v", res, err)
	}
	check(ex, "orders.created", recs[1])
	if n := a.ready(dlq); n != 0 {
		t.Fatalf("%d dead letters left", n)
	}
}

// A dead letter of a message published without a message-id is replayed
// with its ID as one, so that a second copy of it can be recognised.
func TestReplayGivesAMessageWithoutAnIDOne(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	a.publishMsg(q, amqp.Publishing{Body: []byte("anonymous")})
	s := openSource(t, q)
	d := receiveN(t, s, 1)[0]
	sink, err := NewDeadLetter(context.Background(), "", dlq, WithURL(brokerURL))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	if err := sink.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom"), LastFailure: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	a.waitReady(dlq, 1)
	r := newReplay(t, dlq)
	recs, err := r.List(context.Background(), 1)
	if err != nil || len(recs) != 1 || recs[0].OriginalID != "" {
		t.Fatalf("List: %+v, %v", recs, err)
	}
	if res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	got := receiveN(t, s, 1)[0]
	if got.ID != recs[0].ID {
		t.Fatalf("the copy's message-id is %q, want the dead letter's ID %s", got.ID, recs[0].ID)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{got}); err != nil {
		t.Fatal(err)
	}
}

// Copies go out at most Rate a second: five at 20 a second take at least
// the four intervals between them.
func TestReplayKeepsToTheRate(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	deadLetterAll(t, a, q, dlq, fixedCause, names("m", 5)...)
	r := newReplay(t, dlq)
	start := time.Now()
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 20})
	if err != nil || res.Replayed != 5 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	if took := time.Since(start); took < 4*50*time.Millisecond {
		t.Fatalf("five copies at 20 a second took %v, less than the four intervals of 50 ms between them", took)
	}
}

// A run reads only the dead letters the queue held when it began: those
// that arrive meanwhile (a replayed copy that failed again, say) wait for
// the next run instead of being replayed, failing and replayed again in a
// loop.
func TestReplayReadsOnlyWhatTheQueueHeldAtItsStart(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	deadLetterAll(t, a, q, dlq, fixedCause, names("m", 3)...)
	r := newReplay(t, dlq)
	arrived := 0
	r.testHookConfirmed = func(*amqp.Connection) {
		// Each copy fails again and comes back as a new dead letter.
		arrived++
		a.publishMsg(dlq, amqp.Publishing{MessageId: fmt.Sprint("again", arrived), Body: []byte("again"),
			Headers: amqp.Table{adapters.HeaderOriginalQueue: q, adapters.HeaderError: "boom again"}})
	}
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed != 3 {
		t.Fatalf("Replay: %+v, want the 3 dead letters the queue held at the start", res)
	}
	a.waitReady(dlq, 3)
	if ids := messageIDs(a.drain(dlq)); !slices.Equal(ids, []string{"again1", "again2", "again3"}) {
		t.Fatalf("left in the dead-letter queue %v, want the three that arrived during the run", ids)
	}
}

// A replayed copy that fails again is dead-lettered with its latest trip's
// diagnostics only: the sink drops the custody-replay-of it came back with.
func TestReplayedCopyDeadLetteredAgainDescribesItsLatestTrip(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	deadLetterAll(t, a, q, dlq, fixedCause, "m1")
	r := newReplay(t, dlq)
	if res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000, KeepDiagnostics: true}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	s := openSource(t, q)
	d := receiveN(t, s, 1)[0]
	if d.Headers[adapters.HeaderReplayOf] == "" || d.Headers[adapters.HeaderReplayDiagnostics] == "" {
		t.Fatalf("the replayed copy's headers %v lack the replay's", d.Headers)
	}
	sink, err := NewDeadLetter(context.Background(), "", dlq, WithURL(brokerURL))
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	if err := sink.Send(context.Background(), d, adapters.Failure{Err: errors.New("boom again"), LastFailure: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if err := s.Ack(context.Background(), []*adapters.Delivery{d}); err != nil {
		t.Fatal(err)
	}
	a.waitReady(dlq, 1)
	recs, err := r.List(context.Background(), 10)
	if err != nil || len(recs) != 1 {
		t.Fatalf("List: %+v, %v", recs, err)
	}
	rec := recs[0]
	if rec.Error != "boom again" || rec.Diagnostics[adapters.HeaderReplayOf] != "" || rec.Diagnostics[adapters.HeaderReplayDiagnostics] != "" ||
		rec.Headers[adapters.HeaderReplayOf] != "" || len(rec.Headers) != 2 {
		t.Fatalf("the second dead letter: error %q, headers %v, diagnostics %v; want the latest trip only", rec.Error, rec.Headers, rec.Diagnostics)
	}
}
