package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/teststores"
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

// TestExtensionNeverOutlivesTheClaim: an Extend stuck on a store that does
// not answer must give up by the time the claim runs out, so that the
// handler is told (ErrClaimLost) before another delivery can take the key
// over. An attempt allowed to run a full interval past the expiry leaves
// the handler running, uncancelled, beside the new holder.
func TestExtensionNeverOutlivesTheClaim(t *testing.T) {
	const lease = 300 * time.Millisecond
	store := &faultyStore{Store: newMemory(t)}
	store.extendHangs.Store(true)
	var cause error
	h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
		select {
		case <-ctx.Done():
		case <-time.After(30 * time.Second):
			return errors.New("the handler was never told that its claim could not be kept")
		}
		cause = context.Cause(ctx)
		return ctx.Err()
	}, idempotency.WithLease(lease), idempotency.WithExtendInterval(250*time.Millisecond))
	err := h.Handle(context.Background(), msg("m", "x"))
	if !errors.Is(err, context.Canceled) || !consumer.IsUnavailable(err) {
		t.Fatalf("Handle = %v, want the cancelled handler's error marked unavailable (the store stopped it, not the message)", err)
	}
	if !errors.Is(cause, idempotency.ErrClaimLost) {
		t.Fatalf("handler's context cause = %v, want ErrClaimLost", cause)
	}
	// The store made the claim before Claim returned, so it ran out by
	// claimed+lease; no extension attempt may still be waiting after that.
	expiry := store.claimed.Load().Add(lease)
	until := store.extendUntil.Load()
	if until == nil {
		t.Fatal("the claim was never extended")
	}
	if until.After(expiry) {
		t.Fatalf("an extension was allowed to wait until %v after the claim ran out", until.Sub(expiry))
	}
}

// TestSlowClaimReplyDoesNotDelayTheFirstExtension: the claim's lease starts
// when the store makes it, not when the reply arrives. Counting the first
// extension interval from the reply let a slow reply push that extension
// past the expiry: the claim ran out under a running handler that was not
// told, and a duplicate delivery took the key and ran the effect beside it.
func TestSlowClaimReplyDoesNotDelayTheFirstExtension(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			t.Parallel()
			// The reply comes 1.8s after the claim was made; without
			// extension the claim runs out at 3s, and the first extension
			// is due at 1.5s: sent at once when the reply comes, it has
			// 1.3s to reach the store before the duplicate comes.
			const lease = 3 * time.Second
			store := &faultyStore{Store: st.New(t)}
			store.claimDelay.Store(int64(1800 * time.Millisecond))
			var runs atomic.Int32
			entered, leave := make(chan struct{}), make(chan struct{})
			var cause error
			h := newGuard(t, store, func(ctx context.Context, _ *consumer.Message) error {
				if runs.Add(1) > 1 {
					return nil // a duplicate that got the key
				}
				close(entered)
				select {
				case <-leave:
				case <-ctx.Done():
					cause = context.Cause(ctx)
				}
				return nil
			}, idempotency.WithLease(lease), idempotency.WithExtendInterval(lease/2))

			first := make(chan error, 1)
			go func() { first <- h.Handle(context.Background(), msg("k", "x")) }()
			<-entered
			store.claimDelay.Store(0)

			// Wait until the claim would have run out unextended, then
			// deliver a duplicate: the running handler still holds the key.
			time.Sleep(time.Until(store.claimSent.Load().Add(lease + 100*time.Millisecond)))
			err := h.Handle(context.Background(), msg("k", "x"))
			close(leave)
			if err := <-first; err != nil {
				t.Fatal(err)
			}
			if !errors.Is(err, idempotency.ErrInProgressElsewhere) || runs.Load() != 1 {
				t.Fatalf("duplicate delivered a lease after the claim = %v, effect ran %d times; want in progress elsewhere and 1 run (the claim must be extended)", err, runs.Load())
			}
			if cause != nil {
				t.Fatalf("the running handler was cancelled (%v) although every extension could reach the store", cause)
			}
		})
	}
}

// TestClaimReplyAfterTheLeaseDoesNotRunTheHandler: a Claim whose reply
// comes back only after the claim's lease has run out (a stalled store or
// network, a paused process, a lease shorter than the store timeout) holds
// nothing any more: another delivery may have taken the key over and be
// running the effect. Running the handler then runs the effect twice at
// once; the delivery must be retried instead, and never acked unrun.
func TestClaimReplyAfterTheLeaseDoesNotRunTheHandler(t *testing.T) {
	for _, st := range teststores.All() {
		t.Run(st.Name, func(t *testing.T) {
			t.Parallel()
			const lease = 300 * time.Millisecond
			m := newMeter(t)
			store := &faultyStore{Store: st.New(t)}
			store.claimDelay.Store(int64(2 * time.Second)) // the first copy's reply
			var running, most, runsA, runsB atomic.Int32
			firstDone := make(chan struct{})
			h := newGuard(t, store, func(ctx context.Context, msg *consumer.Message) error {
				n := running.Add(1)
				defer running.Add(-1)
				for o := most.Load(); n > o && !most.CompareAndSwap(o, n); o = most.Load() {
				}
				if msg.Headers["copy"] == "first" {
					runsA.Add(1)
					return nil
				}
				runsB.Add(1)
				// Hold the key until the first copy is done with it.
				select {
				case <-firstDone:
				case <-time.After(30 * time.Second):
				}
				return nil
			}, idempotency.WithLease(lease), idempotency.WithMeterProvider(m))

			first := msg("k", "x")
			first.Headers = map[string]string{"copy": "first"}
			var firstErr error
			go func() {
				defer close(firstDone)
				firstErr = h.Handle(context.Background(), first)
			}()
			eventually(t, "the first copy's claim is made", func() bool { return store.token.Load() != nil })
			store.claimDelay.Store(0)

			// Once the claim ran out, a second copy takes the key over.
			second := msg("k", "x")
			second.Headers = map[string]string{"copy": "second"}
			var secondErr error
			for {
				secondErr = h.Handle(context.Background(), second)
				if !errors.Is(secondErr, idempotency.ErrInProgressElsewhere) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			<-firstDone
			if secondErr != nil {
				t.Fatalf("second copy = %v, want it to run once the first claim ran out", secondErr)
			}
			if runsB.Load() != 1 {
				t.Skipf("the second copy did not take the key over while the first reply was held back (runs %d); inconclusive", runsB.Load())
			}
			if most.Load() > 1 || runsA.Load() != 0 {
				t.Fatalf("the first copy ran its handler %d times on a claim whose reply came after its lease ran out (%d at once)", runsA.Load(), most.Load())
			}
			if !errors.Is(firstErr, idempotency.ErrClaimLost) || !consumer.IsUnavailable(firstErr) {
				t.Fatalf("first copy = %v, want an unavailable error wrapping ErrClaimLost (tried again without using up an attempt, never acked unrun)", firstErr)
			}
			if n := m.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim"); n != 1 {
				t.Fatalf("store errors (claim) = %d, want 1 for the claim answered too late", n)
			}
		})
	}
}
