package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// keeper extends the claims of a running handler: one message's, or every
// claim of a batch at once. It holds no goroutine while waiting: a timer
// fires every extendEvery and extends the claims on the timer's goroutine,
// which ends when the store has answered.
type keeper struct {
	c      *core
	claims []keptClaim
	one    [1]keptClaim            // claims for a single message, without an allocation of its own
	cancel context.CancelCauseFunc // cancels the handler when a claim is lost

	mu      sync.Mutex
	timer   *time.Timer
	stopped bool
	lost    bool               // a claim was lost, and counted (MetricClaimsLost, op extend)
	busy    chan struct{}      // closed when the running extension returns
	abort   context.CancelFunc // cancels the running extension
}

// keptClaim is one claim a keeper extends.
type keptClaim struct {
	HeldClaim
	expires time.Time // when the claim runs out if not extended again
	lost    bool      // lost and counted
}

// keepOne keeps the claim of one message; claimed is when the Claim was
// sent: the store started the lease no earlier, so claimed+lease never
// overestimates how long the claim is held.
func (c *core) keepOne(key string, tok Token, claimed time.Time, cancel context.CancelCauseFunc) *keeper {
	k := &keeper{c: c, cancel: cancel}
	k.one[0] = keptClaim{HeldClaim: HeldClaim{Key: key, Token: tok}, expires: claimed.Add(c.cfg.lease)}
	k.claims = k.one[:]
	k.start()
	return k
}

// keepAll keeps claims, whose expires each hold when its Claim was sent
// plus the lease.
func (c *core) keepAll(claims []keptClaim, cancel context.CancelCauseFunc) *keeper {
	k := &keeper{c: c, cancel: cancel, claims: claims}
	k.start()
	return k
}

// start schedules the first extension. Each extension is due an interval
// after the lease it renews began (the send of the Claim or of the last
// extension), not after the reply came: a slow reply must not push the next
// extension past the expiry, where the claim would run out under a handler
// that nobody told. With several claims, the earliest decides.
func (k *keeper) start() {
	first := k.claims[0].expires
	for _, cl := range k.claims[1:] {
		if cl.expires.Before(first) {
			first = cl.expires
		}
	}
	k.mu.Lock()
	k.timer = time.AfterFunc(time.Until(first.Add(k.c.cfg.extendEvery-k.c.cfg.lease)), k.extend)
	k.mu.Unlock()
}

func (k *keeper) extend() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	live := make([]int, 0, len(k.claims))
	held := make([]HeldClaim, 0, len(k.claims))
	// An extension still waiting when a claim runs out cannot keep it any
	// more, and the handler must not run on past the expiry: give up then,
	// so that the failure below cancels the handler in time.
	deadline := time.Now().Add(k.c.cfg.extendEvery)
	for i, cl := range k.claims {
		if cl.lost {
			continue
		}
		live = append(live, i)
		held = append(held, cl.HeldClaim)
		if cl.expires.Before(deadline) {
			deadline = cl.expires
		}
	}
	ctx, abort := context.WithDeadline(context.Background(), deadline)
	busy := make(chan struct{})
	k.busy, k.abort = busy, abort
	k.mu.Unlock()

	start := time.Now()
	errs := k.c.extendAll(ctx, held)
	abort()

	k.mu.Lock()
	defer k.mu.Unlock()
	defer close(busy)
	k.busy, k.abort = nil, nil
	if k.stopped {
		return // the handler has finished; its outcome decides, not this
	}
	ctxBg := context.Background()
	next := start.Add(k.c.cfg.extendEvery)
	var cause error
	lost, kept := 0, 0
	for j, i := range live {
		cl := &k.claims[i]
		err := errs[j]
		if err == nil {
			cl.expires = start.Add(k.c.cfg.lease)
			kept++
			continue
		}
		if !errors.Is(err, ErrStaleToken) {
			k.c.m.StoreErrors.Add(ctxBg, 1, k.c.m.OpExtend)
			// Try again at the next interval if the claim is still held
			// by then; otherwise stop the handler now, before another
			// delivery can take the key over.
			if next.Before(cl.expires) {
				kept++
				continue
			}
		}
		cl.lost = true
		lost++
		if cause == nil {
			cause = fmt.Errorf("%w (key %q): %v", ErrClaimLost, cl.Key, err)
		}
	}
	if lost > 0 {
		k.lost = true
		k.c.m.ClaimsLost.Add(ctxBg, int64(lost), k.c.m.OpExtend)
		k.cancel(cause)
	}
	if kept > 0 {
		// The other claims of a batch stopped for one that was lost are
		// kept until the handler returns.
		k.timer.Reset(time.Until(next))
	}
}

// extendAll extends held, in one call where the store takes batches.
func (c *core) extendAll(ctx context.Context, held []HeldClaim) []error {
	return c.callStore(held, "ExtendBatch",
		func(bs BatchStore) []error { return bs.ExtendBatch(ctx, held, c.cfg.lease) },
		func(h HeldClaim) error { return c.store.Extend(ctx, h.Key, h.Token, c.cfg.lease) })
}

// lostCounted reports whether the keeper lost a claim and counted it.
func (k *keeper) lostCounted() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lost
}

// lostAt reports whether the keeper lost claim i and counted it.
func (k *keeper) lostAt(i int) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.claims[i].lost
}

// stop ends the extensions. When it returns no extension is running or
// will run, so the caller may complete or release the claims.
func (k *keeper) stop() {
	k.mu.Lock()
	k.stopped = true
	k.timer.Stop()
	busy, abort := k.busy, k.abort
	k.mu.Unlock()
	if busy != nil {
		abort()
		<-busy
	}
}
