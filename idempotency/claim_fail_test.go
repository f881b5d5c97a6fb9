package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/redisstore"
)

// A Claim the store cannot make fails the delivery as unavailable
// (consumer.Unavailable): the message is not at fault, so it waits without
// using up an attempt, and its effect runs once the store can claim the key
// again. Acking it instead would drop a message whose effect never ran;
// running the handler without a claim could run the effect twice; an
// ordinary error would use up the message's attempts and dead-letter it
// during an outage.
func TestFailedClaimRetriesTheMessageWithoutRunningTheHandler(t *testing.T) {
	stores := []struct {
		name string
		new  func(t *testing.T) (idempotency.Store, func())
	}{
		// A full MemoryStore refuses a claim until one of its in-progress
		// claims ends.
		{"memory full", func(t *testing.T) (idempotency.Store, func()) {
			s := newMemory(t, idempotency.MemoryMaxEntries(1))
			st, tok, err := s.Claim(context.Background(), "other", "", time.Hour)
			if err != nil || st != idempotency.Acquired {
				t.Fatalf("filling the store: %v, %v", st, err)
			}
			return s, func() {
				if err := s.Release(context.Background(), "other", tok); err != nil {
					t.Fatal(err)
				}
			}
		}},
		// Clients that can no longer reach their servers.
		{"redis closed", func(t *testing.T) (idempotency.Store, func()) {
			c := teststores.RedisClient(t)
			s, err := redisstore.New(context.Background(), c)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.Close()
			return s, nil
		}},
		{"postgres closed", func(t *testing.T) (idempotency.Store, func()) {
			pool := pgsql.TestPool(t)
			closing := pgsql.TestPool(t) // the table is dropped through pool
			s := teststores.PostgresOn(t, closing, pgsql.TestTable(t, pool, "custody_idem_test"))
			closing.Close()
			return s, nil
		}},
	}
	for _, st := range stores {
		t.Run(st.name, func(t *testing.T) {
			m := newMeter(t)
			store, free := st.new(t)
			var runs atomic.Int32
			h := newGuard(t, store, func(context.Context, *consumer.Message) error {
				runs.Add(1)
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet))
			err := h.Handle(context.Background(), msg("m", "x"))
			if !consumer.IsUnavailable(err) || errors.Is(err, idempotency.ErrInProgressElsewhere) {
				t.Fatalf("Handle with a failing Claim = %v, want it marked unavailable (the message waits, using up no attempt)", err)
			}
			if runs.Load() != 0 {
				t.Fatal("the handler ran without a claim")
			}
			if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim"); got != 1 {
				t.Fatalf("store errors (claim) = %d, want 1", got)
			}
			if got := m.count(t, idempotency.MetricDuplicates, "", ""); got != 0 {
				t.Fatalf("duplicates = %d, want 0: the message was never claimed", got)
			}
			if free == nil {
				return
			}
			free()
			if err := h.Handle(context.Background(), msg("m", "x")); err != nil || runs.Load() != 1 {
				t.Fatalf("retry once the store can claim = %v with %d runs; want nil and 1", err, runs.Load())
			}
		})
	}
}

// brokenStore is a Store implementation with a bug: its Claim answers no
// state and no error.
type brokenStore struct{ idempotency.Store }

func (brokenStore) Claim(context.Context, string, string, time.Duration) (idempotency.State, idempotency.Token, error) {
	return 0, "", nil
}

// A state the middleware does not know (a Store written elsewhere, with a
// bug) fails the delivery: the handler is not run without a claim, and the
// message is not acked as if its effect had happened. The store is at
// fault, not the message: it waits rather than use up its attempts.
func TestUnknownClaimStateFailsTheDelivery(t *testing.T) {
	h := newGuard(t, brokenStore{newMemory(t)}, func(context.Context, *consumer.Message) error {
		t.Error("the handler ran without a claim")
		return nil
	})
	err := h.Handle(context.Background(), msg("m", "x"))
	if err == nil || !contains(err.Error(), "invalid state") || !consumer.IsUnavailable(err) {
		t.Fatalf("Handle with a store answering no state = %v, want an unavailable error naming the invalid state", err)
	}
}

// A store that never answers (a hung server, a network partition that drops
// packets) fails the Claim after WithStoreTimeout, so the delivery is
// given back to wait instead of holding its worker for as long as the store
// stays silent. The server here accepts PostgreSQL connections and never
// says a word.
func TestSilentStoreFailsTheClaimAfterTheStoreTimeout(t *testing.T) {
	pool, link := teststores.PostgresVia(t)
	store := teststores.PostgresOn(t, pool, pgsql.TestTable(t, pgsql.TestPool(t), "custody_idem_test"))
	link.Silence()
	pool.Reset() // the pool's connections are gone; new ones reach a silent server
	m := newMeter(t)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		t.Error("the handler ran without a claim")
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithStoreTimeout(100*time.Millisecond))
	done := make(chan error, 1)
	go func() { done <- h.Handle(context.Background(), msg("m", "x")) }()
	select {
	case err := <-done:
		if !consumer.IsUnavailable(err) {
			t.Fatalf("Handle with a silent store = %v, want it marked unavailable (the message waits, using up no attempt)", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Handle still waits on a silent store 30 s into a 100 ms store timeout")
	}
	if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim"); got != 1 {
		t.Fatalf("store errors (claim) = %d, want 1", got)
	}
}
