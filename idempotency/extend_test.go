package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// TestExtensionCutShortByCompletionIsNotAStoreError: an extension on the
// wire when the handler returns is aborted by the middleware itself; that is
// neither a store error nor a lost claim, and must not be counted as one
// (operators alert on these metrics).
func TestExtensionCutShortByCompletionIsNotAStoreError(t *testing.T) {
	m := newMeter(t)
	store := &faultyStore{Store: newMemory(t)}
	store.extendHangs.Store(true)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		eventually(t, "an extension is on the wire", func() bool { return store.extending.Load() == 1 })
		return nil
	}, idempotency.WithMeterProvider(m), idempotency.WithLease(time.Hour), idempotency.WithExtendInterval(200*time.Millisecond))
	if err := h.Handle(context.Background(), msg("m", "x")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if n := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "extend"); n != 0 {
		t.Fatalf("store errors (extend) = %d after a clean completion, want 0", n)
	}
	if n := m.count(t, idempotency.MetricClaimsLost, "custody.idempotency.op", "extend"); n != 0 {
		t.Fatalf("claims lost (extend) = %d after a clean completion, want 0", n)
	}
}
