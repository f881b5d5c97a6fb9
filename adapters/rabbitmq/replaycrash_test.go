package rabbitmq

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// A replay whose connection is cut between a copy's confirm and its dead
// letter's ack loses nothing and duplicates at most that dead letter: run
// again, it replays the dead letter a second time, a copy with the same
// message-id and custody-replay-of, which the idempotency middleware
// absorbs. Two runs cut, then one to the end: every message's effect runs
// once, and the queue got exactly two duplicates, of the two dead letters
// at the cuts.
func TestReplayCutBetweenConfirmAndAck(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	bodies := names("m", 20)
	deadLetterAll(t, a, q, dlq, fixedCause, bodies...)
	r := newReplay(t, dlq)

	// cutAt makes the next run cut its reading connection, from the
	// broker's side, once its n-th copy is confirmed, before the ack.
	cutAt := func(n int) {
		var confirmed atomic.Int32
		r.testHookConfirmed = func(conn *amqp.Connection) {
			if int(confirmed.Add(1)) == n {
				if err := closeFromBroker(conn); err != nil {
					t.Error(err)
				}
				// The cut reaches the client: amqp091 sees the close.
				for !conn.IsClosed() {
					time.Sleep(time.Millisecond)
				}
			}
		}
	}
	var replayed int
	for run, cut := range []int{5, 6} {
		cutAt(cut)
		res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
		if err == nil || !strings.Contains(err.Error(), "its copy is confirmed, but its removal was cut short") {
			t.Fatalf("run %d cut after its copy %d: %+v, %v; want the error saying the dead letter stays", run+1, cut, res, err)
		}
		if res.Replayed != cut-1 {
			t.Fatalf("run %d: %d replayed, want the %d before the cut", run+1, res.Replayed, cut-1)
		}
		replayed += res.Replayed
	}
	r.testHookConfirmed = nil
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	if err != nil {
		t.Fatal(err)
	}
	replayed += res.Replayed
	if replayed != 20 {
		t.Fatalf("%d replayed over three runs, want 20: each dead letter counted once, by the run that removed it", replayed)
	}
	if n := a.ready(dlq); n != 0 {
		t.Fatalf("%d dead letters left", n)
	}

	a.waitReady(q, 22)

	// The consumer, with the idempotency middleware (keyed on the message
	// id, its default), runs each effect once.
	store, err := idempotency.NewMemoryStore()
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idempotency.New(store)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	copies := map[string][]string{} // body -> custody-replay-of of each copy delivered
	var effects handled             // body -> effects run
	effect := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		effects.add(string(m.Body))
		return nil
	})
	guarded := consumer.Chain(effect, mw)
	src := openSource(t, q)
	run := runConsumer(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		copies[string(m.Body)] = append(copies[string(m.Body)], m.Headers[adapters.HeaderReplayOf])
		mu.Unlock()
		return guarded.Handle(ctx, m)
	}))
	waitUntil(t, "every copy consumed", func() bool { return effects.distinct() == 20 && a.ready(q) == 0 && unacked(t, q) == 0 })
	run.stop(t)
	for _, id := range bodies {
		c := copies[id]
		switch {
		case len(c) == 0:
			t.Errorf("%s lost: no copy", id)
		case (id == "m5" || id == "m10") && len(c) != 2:
			t.Errorf("%s, the dead letter at a cut, has %d copies, want 2", id, len(c))
		case id != "m5" && id != "m10" && len(c) != 1:
			t.Errorf("%s has %d copies, want 1", id, len(c))
		case len(c) == 2 && c[0] != c[1]:
			t.Errorf("%s's two copies say %s %v: want the same dead letter", id, adapters.HeaderReplayOf, c)
		}
	}
	for id, n := range effects.snapshot() {
		if n != 1 {
			t.Errorf("%s's effect ran %d times", id, n)
		}
	}
}

// A replay counts a dead letter replayed only once the broker has read its
// ack: when the connection goes silent after the last copy's confirm, so
// that the ack never arrives, the run fails and the dead letter is still in
// the queue, rather than reporting it replayed.
func TestReplayCountsOnlyAcksTheBrokerRead(t *testing.T) {
	a := newAdmin(t)
	q := a.queue(ClassicQueue, nil)
	dlq := a.queue(ClassicQueue, nil)
	deadLetterAll(t, a, q, dlq, fixedCause, "m1", "m2", "m3")
	relay := startMuteRelay(t)
	r, err := NewReplay(context.Background(), dlq, WithURL(relay.url()))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	confirmed := 0
	r.testHookConfirmed = func(*amqp.Connection) {
		if confirmed++; confirmed == 3 {
			// Nothing the client writes from here reaches the broker;
			// then the connections end, as after a network failure.
			relay.muted.Store(true)
			time.AfterFunc(200*time.Millisecond, func() {
				relay.mu.Lock()
				defer relay.mu.Unlock()
				for _, c := range relay.conns {
					c.Close()
				}
			})
		}
	}
	res, err := r.Replay(context.Background(), adapters.ReplayOptions{Rate: 1000})
	a.waitReady(q, 3)
	a.waitReady(dlq, 1)
	if err == nil || res.Replayed != 2 {
		t.Fatalf("Replay: %+v, %v; the third dead letter's ack was lost: want 2 replayed and an error", res, err)
	}
}
