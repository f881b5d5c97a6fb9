package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
)

// handleWhileTheRecordIsLost handles one delivery of key "k" whose claim is
// lost under its running handler without an extension noticing (the lease
// is an hour): the record is dropped, as a Redis failover that lost the
// write or a cleanup run by hand drops it, and another consumer claims the
// key. The handler then returns result.
func handleWhileTheRecordIsLost(t *testing.T, st teststores.Store, result error) (meter, consumer.Handler, error) {
	t.Helper()
	m := newMeter(t)
	store := &faultyStore{Store: st.New(t)}
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		ctx := context.Background()
		if err := store.Store.Release(ctx, "k", *store.token.Load()); err != nil {
			t.Errorf("dropping the record: %v", err)
		}
		if state, _, err := store.Store.Claim(ctx, "k", "", time.Hour); err != nil || state != idempotency.Acquired {
			t.Errorf("the other consumer's claim = %v, %v; want acquired", state, err)
		}
		return result
	}, idempotency.WithMeterProvider(m), idempotency.WithLogger(quiet), idempotency.WithLease(time.Hour))
	return m, h, h.Handle(context.Background(), msg("k", "x"))
}

// The claim is found lost only when the effect is recorded: that is a lost
// claim (the other consumer may run the effect again), which operators
// count under claims lost, not a store failure. The message is acked, and
// the other consumer's claim is left alone.
func TestClaimFoundLostAtCompletionIsCountedAsLost(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			m, h, err := handleWhileTheRecordIsLost(t, st, nil)
			if err != nil {
				t.Fatalf("Handle = %v, want nil: the effect ran, and retrying would run it again", err)
			}
			if got := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "complete"); got != 1 {
				t.Errorf("claims lost (complete) = %d, want 1", got)
			}
			if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "complete"); got != 0 {
				t.Errorf("store errors (complete) = %d, want 0: the store answered", got)
			}
			if err := h.Handle(context.Background(), msg("k", "x")); !errors.Is(err, idempotency.ErrInProgressElsewhere) {
				t.Fatalf("next delivery = %v, want in progress elsewhere (the other consumer still holds the key)", err)
			}
		})
	}
}

// A failed handler whose claim was lost meanwhile finds nothing to release:
// the claim is already gone, which is not a store failure, and the other
// consumer's claim is left alone.
func TestReleaseOfALostClaimIsNoStoreError(t *testing.T) {
	boom := errors.New("boom")
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			m, h, err := handleWhileTheRecordIsLost(t, st, boom)
			if !errors.Is(err, boom) {
				t.Fatalf("Handle = %v, want the handler's error", err)
			}
			if got := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "release"); got != 0 {
				t.Errorf("store errors (release) = %d, want 0: the store answered that the claim was gone", got)
			}
			if err := h.Handle(context.Background(), msg("k", "x")); !errors.Is(err, idempotency.ErrInProgressElsewhere) {
				t.Fatalf("next delivery = %v, want in progress elsewhere (the other consumer still holds the key)", err)
			}
		})
	}
}
