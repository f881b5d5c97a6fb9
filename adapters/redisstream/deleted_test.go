package redisstream

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// TestTrimmedPendingEntriesAreDropped leaves entries pending with a consumer
// that died, trims the oldest of them from the stream, and runs another
// consumer: the trimmed ones must be dropped from the pending list, counted,
// and never handed out (empty or otherwise), and everything else, including
// entries added after the trim, handled: nothing stalls behind them.
func TestTrimmedPendingEntriesAreDropped(t *testing.T) {
	const lease = 200 * time.Millisecond
	e := newEnv(t)
	old := e.publish("o0", "o1", "o2", "o3", "o4", "o5", "o6", "o7", "o8", "o9")
	dead := e.open(WithLease(lease))
	receiveN(t, dead, len(old))
	dead.Close() // holding all ten
	if err := e.client.XTrimMaxLen(e.ctx(), e.stream, 6).Err(); err != nil {
		t.Fatal(err)
	}
	fresh := e.publish("n0", "n1", "n2", "n3", "n4")
	var (
		mu      sync.Mutex
		handled = map[string]int{}
		empty   int
	)
	src := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if len(m.Body) == 0 {
			empty++
		}
		handled[string(m.Body)]++
		return nil
	}), consumer.WithConcurrency(2))
	want := []string{"o4", "o5", "o6", "o7", "o8", "o9", "n0", "n1", "n2", "n3", "n4"}
	waitFor(t, "the entries left handled and nothing pending", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, b := range want {
			if handled[b] == 0 {
				return false
			}
		}
		return len(e.pending()) == 0
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if empty > 0 {
		t.Errorf("%d entries handed out with an empty body", empty)
	}
	for _, b := range []string{"o0", "o1", "o2", "o3"} {
		if handled[b] > 0 {
			t.Errorf("trimmed entry %s was handled", b)
		}
	}
	if len(handled) != len(want) {
		t.Errorf("handled %v, want exactly %v", handled, want)
	}
	if got := src.Stats().Deleted; got != 4 {
		t.Errorf("Stats.Deleted = %d, want the 4 trimmed pending entries", got)
	}
	_ = fresh
}

// TestDeletedRetryIsDropped gives an entry back with a delay and deletes it
// from the stream before it falls due: the Source, which claims its own
// retries when due, must count it as deleted and hand nothing out.
func TestDeletedRetryIsDropped(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	ids := e.publish("retry")
	src := e.open(WithLease(lease), WithReclaimInterval(lease))
	defer src.Close()
	d := receiveN(t, src, 1)[0]
	if err := src.Nack(e.ctx(), adapters.NackAll([]*adapters.Delivery{d}, 50*time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if err := e.client.XDel(e.ctx(), e.stream, ids[0]).Err(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for src.Stats().Deleted == 0 {
		ds, err := src.Receive(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(ds) > 0 {
			t.Fatalf("a deleted entry was handed out: %+v", ds[0])
		}
	}
	if p := e.pending(); len(p) != 0 {
		t.Errorf("still pending: %+v", p)
	}
}

// TestEntryDeletedWhileHeldRunsOn deletes an entry from the stream while its
// handler runs: no other consumer can ever be handed it, so the renewal
// succeeds and the handler runs to its end, its context alive; the entry is
// counted, and the ack finds nothing to do.
func TestEntryDeletedWhileHeldRunsOn(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	ids := e.publish("held")
	release := make(chan struct{})
	results := make(chan error, 4)
	src := e.open(WithLease(lease))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-release:
			results <- ctx.Err()
			return nil
		case <-ctx.Done():
			results <- context.Cause(ctx)
			return context.Cause(ctx)
		}
	}))
	waitFor(t, "the entry held", func() bool { return len(e.pending()) == 1 })
	if err := e.client.XDel(e.ctx(), e.stream, ids[0]).Err(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * lease) // renewals find it deleted, and must not lose it
	close(release)
	select {
	case err := <-results:
		if err != nil {
			t.Fatalf("the handler of an entry deleted while held saw its context end: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the handler did not return")
	}
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := src.Stats(); st.DeletedWhileHeld != 1 || st.LeaseLost != 0 {
		t.Errorf("Stats: DeletedWhileHeld %d, LeaseLost %d, want 1 and 0", st.DeletedWhileHeld, st.LeaseLost)
	}
}

// TestStreamDeletedAndRecreated deletes the stream (and with it the group)
// under a running consumer, while a handler holds an entry, and writes new
// entries, which recreate the stream without the group. The held entry's
// lease is lost (the group that held it is gone) and its handler
// cancelled with a cause saying so; the Source counts the missing group, creates it
// again from the start of the new stream, and every new entry is handled,
// once.
func TestStreamDeletedAndRecreated(t *testing.T) {
	const lease = 300 * time.Millisecond
	e := newEnv(t)
	e.publish("before")
	var (
		mu      sync.Mutex
		handled = map[string]int{}
		cause   error
	)
	src := e.open(WithLease(lease), WithReclaimInterval(20*time.Millisecond))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		handled[string(m.Body)]++
		mu.Unlock()
		if string(m.Body) != "before" {
			return nil
		}
		<-ctx.Done()
		mu.Lock()
		cause = context.Cause(ctx)
		mu.Unlock()
		return cause
	}), consumer.WithConcurrency(2))
	waitFor(t, "the first entry held", func() bool { mu.Lock(); defer mu.Unlock(); return handled["before"] == 1 })
	if err := e.client.Del(e.ctx(), e.stream).Err(); err != nil {
		t.Fatal(err)
	}
	after := []string{"a0", "a1", "a2", "a3", "a4"}
	e.publish(after...)
	waitFor(t, "the new entries handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, b := range after {
			if handled[b] == 0 {
				return false
			}
		}
		return cause != nil
	})
	waitFor(t, "nothing pending", func() bool { return len(e.pending()) == 0 })
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, b := range after {
		if handled[b] != 1 {
			t.Errorf("entry %s handled %d times, want once", b, handled[b])
		}
	}
	if !errors.Is(cause, adapters.ErrLeaseLost) || !errors.Is(cause, ErrGroupMissing) {
		t.Errorf("the held entry's handler ended with %v, want a cause wrapping adapters.ErrLeaseLost and ErrGroupMissing", cause)
	}
	if handled["before"] != 1 {
		t.Errorf("the entry of the deleted stream was handled %d times, want once", handled["before"])
	}
	if st := src.Stats(); st.GroupMissing == 0 {
		t.Error("Stats.GroupMissing = 0; the missing group was not reported")
	}
}

// TestLostGroupCancelsHandlersAtOnce deletes the stream under a handler
// holding an entry on a lease of a minute: the Source finds the group
// missing at its next read and reports the held entry lost through its
// Signal, so the handler is cancelled then, with a cause wrapping
// adapters.ErrLeaseLost and ErrGroupMissing, and not at its first renewal,
// twenty seconds on.
func TestLostGroupCancelsHandlersAtOnce(t *testing.T) {
	e := newEnv(t)
	e.publish("held")
	var (
		mu       sync.Mutex
		cause    error
		renewals int64 = -1
		after    int
	)
	var src *Source
	src = e.open(WithLease(time.Minute))
	s := start(t, src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "after" {
			mu.Lock()
			after++
			mu.Unlock()
			return nil
		}
		<-ctx.Done()
		mu.Lock()
		cause, renewals = context.Cause(ctx), src.Stats().Renewals
		mu.Unlock()
		return cause
	}), consumer.WithConcurrency(2))
	waitFor(t, "the entry held", func() bool { return len(e.pending()) == 1 })
	if err := e.client.Del(e.ctx(), e.stream).Err(); err != nil {
		t.Fatal(err)
	}
	e.publish("after")
	waitFor(t, "the held handler cancelled and the new entry handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return cause != nil && after == 1
	})
	if err := s.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(cause, adapters.ErrLeaseLost) || !errors.Is(cause, ErrGroupMissing) {
		t.Errorf("the held handler ended with %v, want a cause wrapping adapters.ErrLeaseLost and ErrGroupMissing", cause)
	}
	if renewals != 0 {
		t.Errorf("the handler was cancelled after %d renewals; want it cancelled when the Source found the group missing, before any", renewals)
	}
}

// TestMissingGroupWithoutCreate checks that, without WithCreateGroup, a
// Source whose group vanished says so, with an error wrapping
// ErrGroupMissing, rather than creating it.
func TestMissingGroupWithoutCreate(t *testing.T) {
	e := newEnv(t)
	if err := e.client.XGroupCreateMkStream(e.ctx(), e.stream, e.group, "$").Err(); err != nil {
		t.Fatal(err)
	}
	src, err := New(e.ctx(), e.client, e.stream, e.group, WithBlock(10*time.Millisecond), WithLogger(quiet()))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := e.client.Del(e.ctx(), e.stream).Err(); err != nil {
		t.Fatal(err)
	}
	e.publish("x")
	_, err = src.Receive(e.ctx(), 10)
	if !errors.Is(err, ErrGroupMissing) {
		t.Fatalf("Receive after the group vanished: %v, want an error wrapping ErrGroupMissing", err)
	}
	groups, _ := e.client.XInfoGroups(e.ctx(), e.stream).Result()
	if len(groups) != 0 {
		t.Errorf("the group was created again without WithCreateGroup: %+v", groups)
	}
}

// TestHeldEntryDroppedByAScanRunsOn deletes an entry from the stream while
// this Source holds it, then lets a reclaim scan run before the entry's next
// renewal: Redis 7.0's XAUTOCLAIM drops every pending entry it finds deleted,
// whoever holds it and however briefly idle. The renewal that follows finds
// the entry no longer pending; it must still tell "deleted while held" (no
// one else can ever be handed it: the handler runs on, not a lost lease)
// from "acked elsewhere", whether the scan was this Source's own or another
// consumer's.
func TestHeldEntryDroppedByAScanRunsOn(t *testing.T) {
	for _, scanner := range []string{"itself", "another consumer"} {
		t.Run(scanner, func(t *testing.T) {
			const lease = 10 * time.Second // no entry falls idle during the test
			e := newEnv(t)
			ids := e.publish("held")
			a := e.open(WithLease(lease), WithReclaimInterval(time.Millisecond))
			defer a.Close()
			held := receiveN(t, a, 1)[0]
			if err := e.client.XDel(e.ctx(), e.stream, ids[0]).Err(); err != nil {
				t.Fatal(err)
			}
			scan := a
			if scanner != "itself" {
				scan = e.open(WithLease(lease), WithReclaimInterval(time.Millisecond))
				defer scan.Close()
			}
			time.Sleep(2 * time.Millisecond) // a scan is due
			if ds, err := scan.Receive(e.ctx(), 1); err != nil || len(ds) != 0 {
				t.Fatalf("Receive: %d entries, %v; want none, nil", len(ds), err)
			}
			if p := e.pending(); len(p) != 0 {
				t.Fatalf("pending after the scan: %+v, want the deleted entry dropped", p)
			}
			if err := a.Extend(e.ctx(), []*adapters.Delivery{held}, lease); err != nil {
				t.Fatalf("renewing an entry deleted while held, after a scan dropped it: %v, want nil: its handler runs on", err)
			}
			if st := a.Stats(); st.DeletedWhileHeld != 1 || st.LeaseLost != 0 || st.Deleted != 0 {
				t.Errorf("Stats: DeletedWhileHeld %d, LeaseLost %d, Deleted %d; want 1, 0, 0", st.DeletedWhileHeld, st.LeaseLost, st.Deleted)
			}
			if err := a.Ack(e.ctx(), []*adapters.Delivery{held}); err != nil {
				t.Errorf("Ack: %v", err)
			}
		})
	}
}
