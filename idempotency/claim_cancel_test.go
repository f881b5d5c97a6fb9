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

// replyLostStore applies a Claim, then calls applied (the test ends the
// delivery there), then drops its reply if the caller's context has ended,
// as a network store does whose reply is still on the way when the caller
// gives up: the claim is made, and a caller that stopped waiting would not
// know it holds it.
type replyLostStore struct {
	idempotency.Store
	applied func()
}

func (s replyLostStore) Claim(ctx context.Context, key, fp string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	st, tok, err := s.Store.Claim(context.Background(), key, fp, lease)
	s.applied()
	if ctx.Err() != nil {
		return 0, "", ctx.Err()
	}
	return st, tok, err
}

// A delivery that ends (its lease lost, the shutdown deadline) while its
// claim is on the wire leaves no claim behind: its redelivery runs at once,
// instead of being deferred as an overlapping duplicate until the orphaned
// claim's lease runs out. The handler does not run for the ended delivery.
func TestClaimCutShortByTheDeliveryIsGivenBack(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	// The delivery ends once the store has applied the claim, before its
	// reply arrives: decided by the store, not by a timer that a loaded
	// machine could fire after the reply.
	store := replyLostStore{Store: newMemory(t), applied: func() { cancel(adapters.ErrLeaseLost) }}
	ran := make(chan struct{}, 2)
	h := newGuard(t, store, func(context.Context, *consumer.Message) error {
		ran <- struct{}{}
		return nil
	}, idempotency.WithLease(time.Hour))
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
