package idempotency_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
)

// replyLostStore applies a Claim, then holds its reply back until the
// caller's context ends or the delay passes, as a network store does whose
// reply is still on the way when the caller gives up: the claim is made, and
// the caller, had it stopped waiting, would not know it holds it.
type replyLostStore struct {
	idempotency.Store
	delay time.Duration
}

func (s replyLostStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	st, tok, err := s.Store.Claim(context.Background(), key, fp, lease)
	select {
	case <-ctx.Done():
		return 0, "", ctx.Err()
	case <-time.After(s.delay):
		return st, tok, err
	}
}

// A delivery that ends (its lease lost, the shutdown deadline) while its
// claim is on the wire leaves no claim behind: its redelivery runs at once,
// instead of being deferred as an overlapping duplicate until the orphaned
// claim's lease runs out. The handler does not run for the ended delivery.
func TestClaimCutShortByTheDeliveryIsGivenBack(t *testing.T) {
	mem := newMemory(t)
	store := replyLostStore{Store: mem, delay: 200 * time.Millisecond}
	ran := make(chan struct{}, 2)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		ran <- struct{}{}
		return nil
	}, idempotency.WithLease(time.Hour))
	ctx, cancel := context.WithCancelCause(context.Background())
	time.AfterFunc(20*time.Millisecond, func() { cancel(adapters.ErrLeaseLost) })
	err := h.Handle(ctx, msg("m-1", "x"))
	if err == nil {
		t.Fatal("Handle returned nil for a delivery that ended while its claim was on the wire")
	}
	if !errors.Is(err, adapters.ErrLeaseLost) {
		t.Errorf("Handle returned %v, want the delivery's cause (ErrLeaseLost)", err)
	}
	select {
	case <-ran:
		t.Fatal("the handler ran for a delivery that had ended before its claim returned")
	default:
	}
	// The redelivery claims the key at once.
	if err := h.Handle(context.Background(), msg("m-1", "x")); err != nil {
		t.Fatalf("redelivery: %v (the first delivery's claim was orphaned)", err)
	}
	select {
	case <-ran:
	default:
		t.Fatal("the redelivery's handler did not run: the first delivery's claim was left behind")
	}
}
