package redisstream

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// TestPoisonEntryDeadLetteredWithItsAck runs a poison entry through
// MaxAttempts: it must reach the dead-letter stream once, with its fields
// and the diagnostics, and leave the group's pending list in the same step:
// the dead letter acknowledges it, not the runtime afterwards.
func TestPoisonEntryDeadLetteredWithItsAck(t *testing.T) {
	const lease = 500 * time.Millisecond
	e := newEnv(t)
	id, err := e.client.XAdd(e.ctx(), &redis.XAddArgs{Stream: e.stream, Values: []string{"body", "poison", "tenant", "acme"}}).Result()
	if err != nil {
		t.Fatal(err)
	}
	e.publish("good")
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		attempts []int
	)
	src := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) != "poison" {
			return nil
		}
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		mu.Unlock()
		return errors.New("cannot parse")
	}), consumer.WithDeadLetter(dlq), consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}))
	waitFor(t, "a dead letter", func() bool { n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); return n > 0 })
	waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	copies, err := e.client.XRange(e.ctx(), e.dlq, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(copies) != 1 {
		t.Fatalf("dead-letter stream holds %d entries, want 1", len(copies))
	}
	v := copies[0].Values
	for k, want := range map[string]string{
		"body": "poison", "tenant": "acme",
		adapters.HeaderAttempts: "3", adapters.HeaderOriginalID: id, adapters.HeaderOriginalQueue: e.stream,
		adapters.HeaderPermanent: "false", adapters.HeaderError: "cannot parse",
	} {
		if v[k] != want {
			t.Errorf("dead letter field %s = %v, want %q (fields %v)", k, v[k], want, v)
		}
	}
	mu.Lock()
	if len(attempts) != 3 || attempts[0] != 1 || attempts[2] != 3 {
		t.Errorf("attempts %v, want [1 2 3]", attempts)
	}
	mu.Unlock()
	// One XACK was sent for the good entry; the poison one was acked by
	// the dead-letter script.
	if st := src.Stats(); st.Acked+st.AckedNotPending != 1 {
		t.Errorf("the Source sent XACK for %d entries, want only the good one (the dead letter acks the poison entry itself)", st.Acked+st.AckedNotPending)
	}
}

// TestDeadLetterNeverAcksWithoutItsCopy makes the dead-letter key something
// other than a stream after the DeadLetter was made, so that XADD
// fails: the original must stay pending, since its copy was not stored.
// (Under MULTI/EXEC the XACK would still run after the failed XADD.) Once
// the key is a stream again, the same Send stores the copy and acks.
func TestDeadLetterNeverAcksWithoutItsCopy(t *testing.T) {
	e := newEnv(t)
	e.publish("poison")
	src := e.open()
	defer src.Close()
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	d := receiveN(t, src, 1)[0]
	if err := e.client.Set(e.ctx(), e.dlq, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	f := adapters.Failure{Err: errors.New("bad"), Attempts: 1, FirstFailure: time.Now(), LastFailure: time.Now()}
	if err := dlq.Send(e.ctx(), d, f); err == nil {
		t.Fatal("Send into a key that is not a stream returned nil")
	}
	if p := e.pending(); len(p) != 1 {
		t.Fatalf("after a failed dead-letter write the original is not pending (%+v): it was acked without its copy", p)
	}
	e.client.Del(e.ctx(), e.dlq)
	if err := dlq.Send(e.ctx(), d, f); err != nil {
		t.Fatalf("Send: %v", err)
	}
	if p := e.pending(); len(p) != 0 {
		t.Errorf("after the dead-letter write the original is still pending: %+v", p)
	}
	if !dlq.SettlesOriginal(d) {
		t.Error("SettlesOriginal = false for an entry the dead letter acked itself: the runtime would ack it again")
	}
	if n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); n != 1 {
		t.Errorf("dead-letter stream holds %d entries, want 1", n)
	}
}

// TestDeadLetterInTwoSteps uses a DeadLetter on another client than
// the Source's, as when the two streams cannot share a script (different
// servers, or cluster slots): Send appends the copy and leaves the original
// to the runtime, which acks it through the Source (SettlesOriginal is
// false). Run through the consumer, the poison entry ends in the dead-letter
// stream once and leaves the pending list.
func TestDeadLetterInTwoSteps(t *testing.T) {
	e := newEnv(t)
	e.publish("poison")
	other := newClient(t, redisAddr())
	dlq, err := NewDeadLetter(e.ctx(), other, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	src := e.open()
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("bad"))
	}), consumer.WithDeadLetter(dlq))
	waitFor(t, "a dead letter", func() bool { n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); return n > 0 })
	waitFor(t, "the original acked", func() bool { return len(e.pending()) == 0 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); n != 1 {
		t.Errorf("dead-letter stream holds %d entries, want 1", n)
	}
	if st := src.Stats(); st.Acked != 1 {
		t.Errorf("the Source acked %d entries, want the original, acked by the runtime", st.Acked)
	}
	d := &adapters.Delivery{ID: "x", Handle: src}
	if dlq.SettlesOriginal(d) {
		t.Error("SettlesOriginal = true for an entry of a Source on another client")
	}
}

// TestDeadLetterHeaderNamedLikeTheBody checks that a header named like the
// body field does not overwrite the body in the copy.
func TestDeadLetterHeaderNamedLikeTheBody(t *testing.T) {
	e := newEnv(t)
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	d := &adapters.Delivery{ID: "x", Body: []byte("the body"), Headers: map[string]string{"body": "a header"}, Partition: -1, Offset: -1}
	if err := dlq.Send(e.ctx(), d, adapters.Failure{Err: errors.New("bad"), Attempts: 1}); err != nil {
		t.Fatal(err)
	}
	ms, err := e.client.XRange(e.ctx(), e.dlq, "-", "+").Result()
	if err != nil || len(ms) != 1 {
		t.Fatalf("XRANGE: %v %v", ms, err)
	}
	if v := ms[0].Values; v["body"] != "the body" || v[headerPrefix+"body"] != "a header" {
		t.Errorf("copy fields %v, want the body and the header apart", v)
	}
}

func TestNewDeadLetterChecksTheKey(t *testing.T) {
	e := newEnv(t)
	e.client.Set(e.ctx(), e.dlq, "x", 0)
	if _, err := NewDeadLetter(e.ctx(), e.client, e.dlq); err == nil {
		t.Error("NewDeadLetter on a string key returned no error")
	}
}

// TestDeadLetterDeletesTheOriginalUnderDeleteOnAck: with WithDeleteOnAck an
// acked entry leaves the stream, and so must one whose dead letter
// acknowledged it, or a stream trimmed by deletion alone keeps every poison
// entry for ever.
func TestDeadLetterDeletesTheOriginalUnderDeleteOnAck(t *testing.T) {
	e := newEnv(t)
	e.publish("good", "poison")
	dlq, err := NewDeadLetter(e.ctx(), e.client, e.dlq)
	if err != nil {
		t.Fatal(err)
	}
	src := e.open(WithDeleteOnAck())
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "poison" {
			return consumer.Permanent(errors.New("cannot parse"))
		}
		return nil
	}), consumer.WithDeadLetter(dlq))
	waitFor(t, "a dead letter", func() bool { n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); return n > 0 })
	waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	waitFor(t, "both entries deleted from the stream", func() bool { n, _ := e.client.XLen(e.ctx(), e.stream).Result(); return n == 0 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n, _ := e.client.XLen(e.ctx(), e.dlq).Result(); n != 1 {
		t.Fatalf("dead-letter stream holds %d entries, want 1", n)
	}
}
