package idempotency

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// keeper extends one claim while its handler runs. It holds no goroutine
// while waiting: a timer fires every extendEvery and runs one Extend on the
// timer's goroutine, which ends when Extend returns.
type keeper struct {
	g      *guard
	key    string
	tok    Token
	cancel context.CancelCauseFunc // cancels the handler when the claim is lost

	mu      sync.Mutex
	timer   *time.Timer
	stopped bool
	lost    bool               // the loss is counted (MetricClaimsLost, op extend)
	expires time.Time          // when the claim runs out if not extended again
	busy    chan struct{}      // closed when the running Extend returns
	abort   context.CancelFunc // cancels the running Extend
}

// claimed is when the Claim was sent: the store started the lease no
// earlier, so claimed+lease never overestimates how long the claim is held.
//
// Each extension is due an interval after the lease it renews began (the
// send of the Claim or of the last Extend), not after the reply came: a slow
// reply must not push the next extension past the expiry, where the claim
// would run out under a handler that nobody told.
func (g *guard) keep(key string, tok Token, claimed time.Time, cancel context.CancelCauseFunc) *keeper {
	k := &keeper{g: g, key: key, tok: tok, cancel: cancel, expires: claimed.Add(g.cfg.lease)}
	k.mu.Lock()
	k.timer = time.AfterFunc(time.Until(claimed.Add(g.cfg.extendEvery)), k.extend)
	k.mu.Unlock()
	return k
}

func (k *keeper) extend() {
	k.mu.Lock()
	if k.stopped {
		k.mu.Unlock()
		return
	}
	// An Extend still waiting when the claim runs out cannot keep it any
	// more, and the handler must not run on past the expiry: give up then,
	// so that the failure below cancels the handler in time.
	deadline := time.Now().Add(k.g.cfg.extendEvery)
	if k.expires.Before(deadline) {
		deadline = k.expires
	}
	ctx, abort := context.WithDeadline(context.Background(), deadline)
	busy := make(chan struct{})
	k.busy, k.abort = busy, abort
	k.mu.Unlock()

	start := time.Now()
	err := k.g.store.Extend(ctx, k.key, k.tok, k.g.cfg.lease)
	abort()

	k.mu.Lock()
	defer k.mu.Unlock()
	defer close(busy)
	k.busy, k.abort = nil, nil
	if k.stopped {
		return // the handler has finished; its outcome decides, not this
	}
	next := start.Add(k.g.cfg.extendEvery)
	if err == nil {
		k.expires = start.Add(k.g.cfg.lease)
		k.timer.Reset(time.Until(next))
		return
	}
	ctxBg := context.Background()
	lost := errors.Is(err, ErrStaleToken)
	if !lost {
		k.g.m.StoreErrors.Add(ctxBg, 1, k.g.m.OpExtend)
		// Try again at the next interval if the claim is still held by
		// then; otherwise stop the handler now, before another delivery
		// can take the key over.
		if next.Before(k.expires) {
			k.timer.Reset(time.Until(next))
			return
		}
	}
	k.lost = true
	k.g.m.ClaimsLost.Add(ctxBg, 1, k.g.m.OpExtend)
	k.cancel(fmt.Errorf("%w (key %q): %v", ErrClaimLost, k.key, err))
}

// lostCounted reports whether the keeper lost the claim and counted it.
func (k *keeper) lostCounted() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.lost
}

// stop ends the extensions. When it returns no Extend is running or will
// run, so the caller may complete or release the claim.
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
