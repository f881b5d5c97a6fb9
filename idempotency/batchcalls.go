package idempotency

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// completeAll records the effects of held, as complete does for one: the
// store is tried again for the claims it failed (completeTries in all,
// within the store timeout), and a failure fails no message but is counted
// for each key and logged once for the batch. counted[i] says the keeper
// already counted the loss of held[i]'s claim.
func (c *core) completeAll(ctx context.Context, held []HeldClaim, counted []bool) {
	if len(held) == 0 {
		return
	}
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
	defer done()
	errs := c.completeMany(sctx, held)
	for try := 1; try < completeTries; try++ {
		var again []int // the claims to try again
		for i, err := range errs {
			if err != nil && !errors.Is(err, ErrStaleToken) {
				again = append(again, i)
			}
		}
		if len(again) == 0 || !pause(sctx, completeRetryDelay*time.Duration(try)) {
			break
		}
		todo := make([]HeldClaim, len(again))
		for j, i := range again {
			todo[j] = held[i]
		}
		for j, err := range c.completeMany(sctx, todo) {
			errs[again[j]] = err
		}
	}
	var lost, failed failures
	for i, err := range errs {
		switch {
		case err == nil:
		case errors.Is(err, ErrStaleToken):
			if !counted[i] {
				c.m.ClaimsLost.Add(ctx, 1, c.m.OpComplete)
			}
			lost.add(held[i].Key, err)
		default:
			c.m.StoreErrors.Add(ctx, 1, c.m.OpComplete)
			failed.add(held[i].Key, err)
		}
	}
	if lost.n > 0 {
		c.cfg.logger.WarnContext(ctx, "idempotency: claims were lost before the effects were recorded; duplicates may run the effects again (lengthen the lease)",
			lost.attrs()...)
	}
	if failed.n > 0 {
		c.cfg.logger.ErrorContext(ctx, "idempotency: could not record completed effects; the messages are acked, but duplicates delivered after the lease runs out would run the effects again",
			failed.attrs()...)
	}
}

// releaseAll lets the retries claim the keys of held at once, as release
// does for one. The failures are counted for each key and logged once.
func (c *core) releaseAll(ctx context.Context, held []HeldClaim) {
	if len(held) == 0 {
		return
	}
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
	defer done()
	var failed failures
	for i, err := range c.releaseMany(sctx, held) {
		if err == nil || errors.Is(err, ErrStaleToken) {
			continue // stale: the claim had already run out or been taken over
		}
		c.m.StoreErrors.Add(ctx, 1, c.m.OpRelease)
		failed.add(held[i].Key, err)
	}
	if failed.n > 0 {
		c.cfg.logger.WarnContext(ctx, "idempotency: could not release claims; the keys' next deliveries wait until the claims' lease runs out",
			failed.attrs()...)
	}
}

// completeMany completes held, in one call where the store takes batches.
func (c *core) completeMany(ctx context.Context, held []HeldClaim) []error {
	return c.callStore(held, "CompleteBatch",
		func(bs BatchStore) []error { return bs.CompleteBatch(ctx, held, c.cfg.retention) },
		func(h HeldClaim) error { return c.store.Complete(ctx, h.Key, h.Token, c.cfg.retention) })
}

// releaseMany releases held, in one call where the store takes batches.
func (c *core) releaseMany(ctx context.Context, held []HeldClaim) []error {
	return c.callStore(held, "ReleaseBatch",
		func(bs BatchStore) []error { return bs.ReleaseBatch(ctx, held) },
		func(h HeldClaim) error { return c.store.Release(ctx, h.Key, h.Token) })
}

// callStore calls the store for held: batch once, where the store takes
// batches (method names it in the error of a wrong count of results), and
// one for each claim where it does not, or held has only one.
func (c *core) callStore(held []HeldClaim, method string, batch func(BatchStore) []error, one func(HeldClaim) error) []error {
	if bs, ok := c.store.(BatchStore); ok && len(held) > 1 {
		return checked(batch(bs), len(held), method, func(err error) error { return err })
	}
	errs := make([]error, len(held))
	for i, h := range held {
		errs[i] = one(h)
	}
	return errs
}

// failures sums up the failed store calls of a batch for one log line: how
// many, and the first key and error.
type failures struct {
	n   int
	key string
	err error
}

func (f *failures) add(key string, err error) {
	if f.n == 0 {
		f.key, f.err = key, err
	}
	f.n++
}

func (f *failures) attrs() []any {
	return []any{slog.Int("keys", f.n), slog.String("key", f.key), slog.Any("error", f.err)}
}
