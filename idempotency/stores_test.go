package idempotency_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

// 32 concurrent deliveries of one key: the effect runs once, the 31 others
// are overlapping duplicates, and a later redelivery is a sequential one.
func TestConcurrentDeliveriesOfOneKeyRunTheEffectOnce(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			const n = 32
			m := newMeter(t)
			var runs, overlapped atomic.Int32
			h := newGuard(t, st.New(t), func(ctx context.Context, _ *consumer.Message) error {
				runs.Add(1)
				// Hold the claim until every other delivery has been
				// turned away, so they really overlap.
				end := time.Now().Add(30 * time.Second)
				for overlapped.Load() < n-1 {
					if time.Now().After(end) {
						return errors.New("the other deliveries never returned")
					}
					time.Sleep(time.Millisecond)
				}
				return nil
			}, idempotency.WithMeterProvider(m))

			var wg sync.WaitGroup
			var succeeded atomic.Int32
			errs := make(chan error, n)
			start := make(chan struct{})
			for range n {
				wg.Go(func() {
					<-start
					err := h.Handle(context.Background(), msg("order-42", "x"))
					switch {
					case err == nil:
						succeeded.Add(1)
					case errors.Is(err, idempotency.ErrInProgressElsewhere):
						overlapped.Add(1)
					default:
						errs <- err
					}
				})
			}
			close(start)
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatalf("unexpected result: %v", err)
			}
			if runs.Load() != 1 || succeeded.Load() != 1 || overlapped.Load() != n-1 {
				t.Fatalf("effect ran %d times, %d succeeded, %d overlapped; want 1, 1, %d", runs.Load(), succeeded.Load(), overlapped.Load(), n-1)
			}
			if got := m.overlapping(t); got != n-1 {
				t.Fatalf("overlapping duplicates counted %d, want %d", got, n-1)
			}
			if err := h.Handle(context.Background(), msg("order-42", "x")); err != nil {
				t.Fatalf("later redelivery = %v, want skipped", err)
			}
			if runs.Load() != 1 || m.sequential(t) != 1 {
				t.Fatalf("after a redelivery: effect ran %d times, sequential duplicates %d; want 1 and 1", runs.Load(), m.sequential(t))
			}
		})
	}
}

// An expired in-progress claim is taken over through the middleware, and
// the stale holder's completion is refused (and counted).
func TestExpiredClaimIsTakenOverAndStaleCompletionRefused(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			m := newMeter(t)
			store := &faultyStore{Store: st.New(t)}
			// The first holder cannot extend (its store link is down), so
			// its claim runs out; its handler ignores the cancellation and
			// finishes anyway, after the takeover.
			down := errors.New("store unreachable")
			store.extendErr.Store(&down)
			const lease = 150 * time.Millisecond
			takenOver := make(chan struct{})
			var runs atomic.Int32
			h := newGuard(t, store, func(ctx context.Context, m *consumer.Message) error {
				if runs.Add(1) == 1 {
					<-takenOver
				}
				return nil
			}, idempotency.WithMeterProvider(m), idempotency.WithLease(lease))

			first := make(chan error, 1)
			go func() {
				for {
					err := h.Handle(context.Background(), msg("k", "x"))
					// On a loaded machine the claim's reply can come after
					// its short lease: the middleware then refuses to run
					// the handler, and the delivery is tried again, as the
					// runtime would.
					if runs.Load() > 0 || !errors.Is(err, idempotency.ErrClaimLost) {
						first <- err
						return
					}
				}
			}()
			eventually(t, "the first delivery runs", func() bool { return runs.Load() == 1 })

			// A second delivery is turned away until the claim expires,
			// then takes it over and completes.
			eventually(t, "the expired claim is taken over", func() bool {
				return h.Handle(context.Background(), msg("k", "x")) == nil && runs.Load() == 2
			})
			close(takenOver)
			if err := <-first; err != nil {
				t.Fatalf("stale holder's Handle = %v, want nil (its effect ran; the refusal is counted, not retried)", err)
			}
			// One lost claim, counted once: by the keeper when it gave up
			// the claim, not again when the completion was refused.
			extend := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend")
			complete := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "complete")
			if extend+complete != 1 {
				t.Fatalf("claims lost counted %d (extend) + %d (complete), want 1", extend, complete)
			}
			if err := h.Handle(context.Background(), msg("k", "x")); err != nil || runs.Load() != 2 {
				t.Fatalf("after both: %v with %d runs; want a skipped duplicate and 2 runs", err, runs.Load())
			}
		})
	}
}

func TestFingerprintMismatchIsPermanentInEveryStore(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			h := newGuard(t, st.New(t), func(context.Context, *consumer.Message) error { return nil },
				idempotency.WithFingerprint(idempotency.FingerprintBody))
			if err := h.Handle(context.Background(), msg("k", "a")); err != nil {
				t.Fatal(err)
			}
			err := h.Handle(context.Background(), msg("k", "b"))
			if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrFingerprintMismatch) {
				t.Fatalf("reused key with another payload = %v, want a permanent ErrFingerprintMismatch", err)
			}
		})
	}
}
