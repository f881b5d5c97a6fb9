package memory_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// replayEnv is a broker with a queue "orders" and its dead-letter queue
// "orders-dlq", of the same type.
type replayEnv struct {
	t    *testing.T
	b    *memory.Broker
	fifo bool
}

func newReplayEnv(t *testing.T, fifo bool) *replayEnv {
	t.Helper()
	b := memory.NewBroker()
	for _, q := range []string{"orders", "orders-dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: time.Minute, FIFO: fifo}); err != nil {
			t.Fatal(err)
		}
	}
	return &replayEnv{t: t, b: b, fifo: fifo}
}

func (e *replayEnv) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	e.t.Cleanup(cancel)
	return ctx
}

// publish puts messages with the given bodies on "orders", each with a
// header and a key (its group on a FIFO queue: "g" and the body's first
// character).
func (e *replayEnv) publish(bodies ...string) {
	e.t.Helper()
	for _, body := range bodies {
		m := memory.Message{Body: []byte(body), Headers: map[string]string{"tenant": "acme"}, Key: "g" + body[:1]}
		if err := e.b.Publish(e.ctx(), "orders", m); err != nil {
			e.t.Fatal(err)
		}
	}
}

// consume runs a consumer on "orders" until the queue is empty: it fails
// every body starting with "bad" permanently (so it is dead-lettered at
// once) while fail holds, and records every body it handles successfully.
func (e *replayEnv) consume(fail bool) (handled []string) {
	e.t.Helper()
	src, err := e.b.Source("orders", memory.WithPollWait(10*time.Millisecond))
	if err != nil {
		e.t.Fatal(err)
	}
	dlq, err := e.b.DeadLetterQueue("orders-dlq")
	if err != nil {
		e.t.Fatal(err)
	}
	var mu sync.Mutex
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if fail && strings.HasPrefix(string(m.Body), "bad") {
			return consumer.Permanent(fmt.Errorf("cannot parse %s", m.Body))
		}
		if m.Headers["tenant"] != "acme" {
			e.t.Errorf("message %s reached the handler without its header: %v", m.Body, m.Headers)
		}
		for k := range m.Headers {
			if adapters.IsDiagnosticHeader(k) && k != adapters.HeaderReplayOf {
				e.t.Errorf("message %s reached the handler with diagnostic header %s", m.Body, k)
			}
		}
		mu.Lock()
		handled = append(handled, string(m.Body))
		mu.Unlock()
		return nil
	})
	c, err := consumer.New(src, h, consumer.WithLogger(testlog.New(e.t)), consumer.WithName("orders-service"),
		consumer.WithDeadLetter(dlq), consumer.WithConcurrency(4))
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	if err := e.b.WaitEmpty(e.ctx(), "orders"); err != nil {
		e.t.Error(err)
	}
	cancel()
	if err := <-ran; err != nil {
		e.t.Fatalf("Run: %v", err)
	}
	return handled
}

func (e *replayEnv) messages(queue string) []memory.Message {
	e.t.Helper()
	ms, err := e.b.Messages(queue)
	if err != nil {
		e.t.Fatal(err)
	}
	return ms
}

func (e *replayEnv) replay() *memory.Replay {
	e.t.Helper()
	r, err := e.b.Replay("orders-dlq")
	if err != nil {
		e.t.Fatal(err)
	}
	return r
}

func count(xs []string) map[string]int {
	n := map[string]int{}
	for _, x := range xs {
		n[x]++
	}
	return n
}

// Dead letters written by the runtime are listed with their diagnostics
// without being touched, replayed back to their queue as they were
// published (headers and key kept, diagnostics stripped, the replay marked),
// and then handled once each.
func TestReplayMovesDeadLettersBackOnce(t *testing.T) {
	for _, fifo := range []bool{false, true} {
		t.Run(map[bool]string{false: "standard", true: "fifo"}[fifo], func(t *testing.T) {
			e := newReplayEnv(t, fifo)
			e.publish("ok1", "bad1", "ok2", "bad2", "bad3")
			if got := count(e.consume(true)); got["ok1"] != 1 || got["ok2"] != 1 || len(got) != 2 {
				t.Fatalf("first run handled %v", got)
			}
			dead := e.messages("orders-dlq")
			if len(dead) != 3 {
				t.Fatalf("dead-letter queue holds %d messages, want 3", len(dead))
			}

			r := e.replay()
			recs, err := r.List(e.ctx(), 100)
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != 3 {
				t.Fatalf("List returned %d records, want 3", len(recs))
			}
			for i, rec := range recs {
				if rec.ID != dead[i].ID || string(rec.Body) != string(dead[i].Body) {
					t.Errorf("record %d is %s %q, want %s %q, in the order written", i, rec.ID, rec.Body, dead[i].ID, dead[i].Body)
				}
				if rec.OriginalQueue != "orders" || rec.Consumer != "orders-service" || !rec.Permanent || rec.Attempts != 1 ||
					!strings.HasSuffix(rec.Error, "cannot parse "+string(rec.Body)) || rec.LastFailure.IsZero() {
					t.Errorf("record %d: %+v", i, rec)
				}
				if rec.Key != "g"+string(rec.Body[:1]) || rec.Headers["tenant"] != "acme" {
					t.Errorf("record %d lost its key or header: key %q, headers %v", i, rec.Key, rec.Headers)
				}
				for k := range rec.Headers {
					if adapters.IsDiagnosticHeader(k) {
						t.Errorf("record %d: diagnostic %s among the headers", i, k)
					}
				}
			}
			groups := adapters.GroupDeadLetters(recs)
			if len(groups) != 3 {
				t.Errorf("GroupDeadLetters: %d groups, want one per error text", len(groups))
			}
			// A dry run: nothing received, nothing moved.
			after := e.messages("orders-dlq")
			for i := range after {
				if after[i].ID != dead[i].ID || after[i].Receives != 0 {
					t.Fatalf("List changed the dead-letter queue: %+v", after)
				}
			}

			res, err := r.Replay(e.ctx(), adapters.ReplayOptions{Rate: 1000})
			if err != nil {
				t.Fatal(err)
			}
			if res != (adapters.ReplayResult{Replayed: 3}) {
				t.Errorf("Replay: %+v, want 3 replayed", res)
			}
			if n := len(e.messages("orders-dlq")); n != 0 {
				t.Errorf("dead-letter queue holds %d messages after the replay", n)
			}
			back := e.messages("orders")
			for i, m := range back {
				if m.ID != dead[i].ID || string(m.Body) != string(dead[i].Body) || m.Key != dead[i].Key {
					t.Errorf("replayed %d: %s %q key %q, want %s %q key %q, in order", i, m.ID, m.Body, m.Key, dead[i].ID, dead[i].Body, dead[i].Key)
				}
				if m.Headers[adapters.HeaderReplayOf] != dead[i].ID || m.Headers["tenant"] != "acme" {
					t.Errorf("replayed %d headers %v, want %s=%s and the original's", i, m.Headers, adapters.HeaderReplayOf, dead[i].ID)
				}
				if _, ok := m.Headers[adapters.HeaderReplayDiagnostics]; ok {
					t.Errorf("replayed %d keeps its diagnostics without KeepDiagnostics", i)
				}
				for k := range m.Headers {
					if adapters.IsDiagnosticHeader(k) && k != adapters.HeaderReplayOf {
						t.Errorf("replayed %d carries diagnostic %s", i, k)
					}
				}
			}

			// Fixed: each replayed message is handled once, and a second
			// replay finds nothing.
			if got := count(e.consume(false)); got["bad1"] != 1 || got["bad2"] != 1 || got["bad3"] != 1 || len(got) != 3 {
				t.Errorf("after the replay the consumer handled %v, want each bad message once", got)
			}
			if res, err := r.Replay(e.ctx(), adapters.ReplayOptions{}); err != nil || res != (adapters.ReplayResult{}) {
				t.Errorf("second Replay: %+v, %v; want nothing to do", res, err)
			}
		})
	}
}

// Select, Max and KeepDiagnostics shape what a replay moves; what Select
// leaves out is counted as skipped and stays.
func TestReplaySelectMaxAndKeepDiagnostics(t *testing.T) {
	e := newReplayEnv(t, false)
	e.publish("bad1", "bad2", "bad3", "bad4", "badX")
	e.consume(true)
	var first []string // the first two dead letters but badX, in the order written
	for _, m := range e.messages("orders-dlq") {
		if string(m.Body) != "badX" && len(first) < 2 {
			first = append(first, string(m.Body))
		}
	}
	r := e.replay()
	res, err := r.Replay(e.ctx(), adapters.ReplayOptions{
		Rate:            1000,
		Max:             2,
		KeepDiagnostics: true,
		Select:          func(rec adapters.DeadLetterRecord) bool { return !strings.Contains(rec.Error, "badX") },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Replayed != 2 {
		t.Errorf("Replay with Max 2: %+v", res)
	}
	back := e.messages("orders")
	if len(back) != 2 || string(back[0].Body) != first[0] || string(back[1].Body) != first[1] {
		t.Fatalf("replayed %v, want %v", back, first)
	}
	var diag map[string]string
	if err := json.Unmarshal([]byte(back[0].Headers[adapters.HeaderReplayDiagnostics]), &diag); err != nil {
		t.Fatalf("%s: %v", adapters.HeaderReplayDiagnostics, err)
	}
	if !strings.HasSuffix(diag[adapters.HeaderError], "cannot parse "+first[0]) || diag[adapters.HeaderOriginalQueue] != "orders" {
		t.Errorf("kept diagnostics %v", diag)
	}
	res, err = r.Replay(e.ctx(), adapters.ReplayOptions{
		Rate:   1000,
		Select: func(rec adapters.DeadLetterRecord) bool { return !strings.Contains(rec.Error, "badX") },
	})
	if err != nil {
		t.Fatal(err)
	}
	if res != (adapters.ReplayResult{Replayed: 2, Skipped: 1}) {
		t.Errorf("second Replay: %+v, want 2 replayed and badX skipped", res)
	}
	if left := e.messages("orders-dlq"); len(left) != 1 || string(left[0].Body) != "badX" {
		t.Errorf("dead-letter queue holds %v, want badX alone", left)
	}
}

// A replay cut short (here its context ends in the middle, as when the
// operator's process dies) and run again moves every dead letter back
// exactly once.
func TestReplayCutShortAndRunAgainMovesEachOnce(t *testing.T) {
	e := newReplayEnv(t, true)
	var bodies []string
	for i := range 20 {
		bodies = append(bodies, fmt.Sprintf("bad%02d", i))
	}
	e.publish(bodies...)
	e.consume(true)
	r := e.replay()
	ctx, cancel := context.WithCancel(e.ctx())
	seen := 0
	res, err := r.Replay(ctx, adapters.ReplayOptions{Rate: 1000, Select: func(adapters.DeadLetterRecord) bool {
		if seen++; seen == 8 {
			cancel()
		}
		return true
	}})
	if !errors.Is(err, context.Canceled) || res.Replayed != 7 {
		t.Fatalf("the cut replay: %+v, %v; want 7 replayed and the context's error", res, err)
	}
	res, err = e.replay().Replay(e.ctx(), adapters.ReplayOptions{Rate: 1000})
	if err != nil || res.Replayed != 13 {
		t.Fatalf("the second replay: %+v, %v; want the other 13", res, err)
	}
	if got := count(e.consume(false)); len(got) != 20 {
		t.Fatalf("handled %d distinct messages, want 20", len(got))
	} else {
		for b, n := range got {
			if n != 1 {
				t.Errorf("%s handled %d times", b, n)
			}
		}
	}
}

// The rate bounds how fast dead letters go back: 5 at 20 a second take at
// least four intervals (a floor, which a slow machine only exceeds).
func TestReplayRate(t *testing.T) {
	e := newReplayEnv(t, false)
	e.publish("bad1", "bad2", "bad3", "bad4", "bad5")
	e.consume(true)
	start := time.Now()
	res, err := e.replay().Replay(e.ctx(), adapters.ReplayOptions{Rate: 20})
	if err != nil || res.Replayed != 5 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("5 dead letters at 20/s took %v, want at least 200ms", took)
	}
}

// Dead letters moved by a queue's MaxReceiveCount go back with their key.
func TestReplayOfRedrivenMessages(t *testing.T) {
	b := memory.NewBroker()
	if err := b.CreateQueue("dlq", memory.QueueOptions{FIFO: true}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", memory.QueueOptions{Lease: time.Millisecond * 5, FIFO: true, MaxReceiveCount: 1, DeadLetterQueue: "dlq"}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b.Publish(ctx, "q", memory.Message{ID: "a", Body: []byte("x"), Key: "group-7"})
	src, _ := b.Source("q", memory.WithPollWait(20*time.Millisecond))
	defer src.Close()
	if ds, err := src.Receive(ctx, 1); err != nil || len(ds) != 1 {
		t.Fatalf("Receive: %v, %v", ds, err)
	}
	for { // the lease runs out; the next receive moves the message
		if ds, _ := src.Receive(ctx, 1); len(ds) != 0 {
			t.Fatal("a message past MaxReceiveCount was delivered")
		}
		if s, _ := b.Stats("dlq"); s.Visible == 1 {
			break
		}
	}
	r, _ := b.Replay("dlq")
	recs, _ := r.List(ctx, 10)
	if len(recs) != 1 || recs[0].OriginalQueue != "q" || recs[0].Key != "group-7" || recs[0].Attempts != 1 {
		t.Fatalf("List: %+v", recs)
	}
	if res, err := r.Replay(ctx, adapters.ReplayOptions{}); err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	if ms, _ := b.Messages("q"); len(ms) != 1 || ms[0].Key != "group-7" || ms[0].Headers[adapters.HeaderReplayOf] != "a" {
		t.Fatalf("q holds %+v", ms)
	}
}

// A dead letter a consumer of the dead-letter queue holds is left alone.
func TestReplayLeavesHeldDeadLettersAlone(t *testing.T) {
	e := newReplayEnv(t, false)
	e.publish("bad1", "bad2")
	e.consume(true)
	src, err := e.b.Source("orders-dlq", memory.WithPollWait(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	held, err := src.Receive(e.ctx(), 1)
	if err != nil || len(held) != 1 {
		t.Fatalf("Receive: %v, %v", held, err)
	}
	res, err := e.replay().Replay(e.ctx(), adapters.ReplayOptions{Rate: 1000})
	if err != nil || res.Replayed != 1 {
		t.Fatalf("Replay: %+v, %v", res, err)
	}
	if back := e.messages("orders"); len(back) != 1 || back[0].ID == held[0].ID {
		t.Fatalf("replayed %+v; the held dead letter %s must stay", back, held[0].ID)
	}
	if err := src.Ack(e.ctx(), held); err != nil {
		t.Errorf("the holder's ack after the replay: %v", err)
	}

	// One received while the replay looks at it stays with its holder too.
	e.consume(true) // the replayed one is dead-lettered again
	var taken []*adapters.Delivery
	res, err = e.replay().Replay(e.ctx(), adapters.ReplayOptions{Rate: 1000, Select: func(rec adapters.DeadLetterRecord) bool {
		if taken, err = src.Receive(e.ctx(), 1); err != nil || len(taken) != 1 || taken[0].ID != rec.ID {
			t.Fatalf("Receive during the replay: %v, %v", taken, err)
		}
		return true
	}})
	if err != nil || res.Replayed != 0 {
		t.Fatalf("Replay of a dead letter received meanwhile: %+v, %v; want it left to its holder", res, err)
	}
	if err := src.Ack(e.ctx(), taken); err != nil {
		t.Errorf("the holder's ack after the replay: %v", err)
	}
	if back := e.messages("orders"); len(back) != 0 {
		t.Errorf("orders holds %d messages, want none", len(back))
	}
}

// Bad options and dead letters that cannot go back fail with what to do;
// nothing moves.
func TestReplayRefusals(t *testing.T) {
	e := newReplayEnv(t, false)
	if _, err := e.b.Replay("nope"); !errors.Is(err, memory.ErrNoQueue) {
		t.Errorf("Replay of a missing queue: %v", err)
	}
	r := e.replay()
	if _, err := r.List(e.ctx(), 0); err == nil || !strings.Contains(err.Error(), "max") {
		t.Errorf("List(0): %v", err)
	}
	for _, o := range []adapters.ReplayOptions{{Rate: -1}, {Max: -1}} {
		if _, err := r.Replay(e.ctx(), o); err == nil {
			t.Errorf("Replay(%+v) accepted", o)
		}
	}
	// A message with no original queue, and one whose queue is gone.
	e.b.Publish(e.ctx(), "orders-dlq", memory.Message{ID: "stray", Body: []byte("x")})
	_, err := r.Replay(e.ctx(), adapters.ReplayOptions{})
	if err == nil || !strings.Contains(err.Error(), "stray") || !strings.Contains(err.Error(), "Select") {
		t.Errorf("Replay of a message naming no queue: %v", err)
	}
	e.b.Publish(e.ctx(), "orders-dlq", memory.Message{ID: "orphan", Body: []byte("y"), Headers: map[string]string{adapters.HeaderOriginalQueue: "gone"}})
	_, err = r.Replay(e.ctx(), adapters.ReplayOptions{Select: func(rec adapters.DeadLetterRecord) bool { return rec.ID == "orphan" }})
	if !errors.Is(err, memory.ErrNoQueue) || !strings.Contains(err.Error(), "gone") {
		t.Errorf("Replay to a missing queue: %v", err)
	}
	if n := len(e.messages("orders-dlq")); n != 2 {
		t.Errorf("dead-letter queue holds %d messages after the refusals, want 2", n)
	}
}

// A replayed message that is dead-lettered again describes its latest
// failure only: the earlier trip's replay headers do not follow it into the
// new dead letter.
func TestDeadLetterOfAReplayedMessageDropsTheEarlierTrip(t *testing.T) {
	b := memory.NewBroker()
	for _, q := range []string{"q", "dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	if err := b.Publish(ctx, "q", memory.Message{Body: []byte("x"), Headers: map[string]string{
		adapters.HeaderReplayOf: "m-1", adapters.HeaderReplayDiagnostics: `{"custody-error":"old"}`, "tenant": "acme"}}); err != nil {
		t.Fatal(err)
	}
	src, err := b.Source("q")
	if err != nil {
		t.Fatal(err)
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ds, err := src.Receive(rctx, 1)
	if err != nil || len(ds) != 1 {
		t.Fatalf("Receive: %v, %d", err, len(ds))
	}
	if err := dlq.Send(ctx, ds[0], adapters.Failure{Err: errors.New("new failure"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	msgs, err := b.Messages("dlq")
	if err != nil || len(msgs) != 1 {
		t.Fatalf("dead letters %v, %v", msgs, err)
	}
	h := msgs[0].Headers
	if _, ok := h[adapters.HeaderReplayDiagnostics]; ok || h[adapters.HeaderReplayOf] != "" || h["tenant"] != "acme" || h[adapters.HeaderError] != "new failure" {
		t.Fatalf("dead letter headers %v, want the tenant and the new failure, no earlier replay's", h)
	}
}
