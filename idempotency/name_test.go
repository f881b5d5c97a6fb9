package idempotency_test

import (
	"context"
	"testing"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// With WithName, every data point of the middleware's metrics carries the
// consumer's name under the runtime's own attribute, custody.consumer, so
// that two consumers in one process count their duplicates apart.
func TestMetricsCarryTheConsumerName(t *testing.T) {
	m := newMeter(t)
	store := newMemory(t)
	orders := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil },
		idempotency.WithMeterProvider(m), idempotency.WithName("orders"))
	payments := newGuard(t, store, func(context.Context, *consumer.Message) error { return nil },
		idempotency.WithMeterProvider(m), idempotency.WithName("payments"))
	ctx := context.Background()
	for range 2 {
		_ = orders.Handle(ctx, msg("o-1", "x"))
	}
	for range 3 {
		_ = payments.Handle(ctx, msg("p-1", "x"))
	}
	_ = orders.Handle(ctx, msg("", "no key")) // a counter without attributes of its own
	if got := m.count(t, idempotency.MetricDuplicates, "custody.consumer", "orders"); got != 1 {
		t.Errorf("orders' duplicates = %d, want 1", got)
	}
	if got := m.count(t, idempotency.MetricDuplicates, "custody.consumer", "payments"); got != 2 {
		t.Errorf("payments' duplicates = %d, want 2", got)
	}
	if got := m.count(t, idempotency.MetricMissingKeys, "custody.consumer", "orders"); got != 1 {
		t.Errorf("orders' missing keys = %d, want 1", got)
	}
	if got := m.sequential(t); got != 3 {
		t.Errorf("sequential duplicates = %d over both consumers, want 3 (the kind attribute stays)", got)
	}
}
