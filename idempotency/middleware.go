package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/internal/dupmetrics"
	"github.com/custody-go/custody/internal/option"
)

// New returns middleware that lets each idempotency key's effect run once:
// it claims the key in store before calling the handler, marks it completed
// after the handler returned nil, and releases it after an error. See the
// package documentation for what happens to duplicates.
func New(store Store, opts ...Option) (consumer.Middleware, error) {
	c, err := newCore("New", store, opts)
	if err != nil {
		return nil, err
	}
	return func(next consumer.Handler) consumer.Handler {
		return &guard{core: c, next: next}
	}, nil
}

// core is what the middleware's handlers share: its configuration, its
// store, its metrics and its outage report.
type core struct {
	cfg   config
	store Store
	m     *dupmetrics.Set
	down  *outage
}

// newCore checks the arguments of the constructor fn.
func newCore(fn string, store Store, opts []Option) (*core, error) {
	if store == nil {
		return nil, fmt.Errorf("idempotency: %s(nil store): pass a Store such as idempotency.NewMemoryStore(), redisstore.New or pgstore.New", fn)
	}
	c := defaultConfig()
	if err := option.Apply(&c, opts); err != nil {
		return nil, err
	}
	if err := c.fill(); err != nil {
		return nil, err
	}
	m, err := dupmetrics.New(c.meter, scope, c.name)
	if err != nil {
		return nil, fmt.Errorf("idempotency: creating metrics: %w", err)
	}
	// One outage report for every handler the middleware wraps: they share
	// the store.
	return &core{cfg: c, store: store, m: m, down: &outage{logger: c.logger}}, nil
}

// Middleware is New for options known to be valid when the program is
// written; it panics with New's error otherwise.
func Middleware(store Store, opts ...Option) consumer.Middleware {
	mw, err := New(store, opts...)
	if err != nil {
		panic(err)
	}
	return mw
}

type guard struct {
	*core
	next consumer.Handler
}

func (g *guard) Handle(ctx context.Context, msg *consumer.Message) error {
	key, fp, err := g.keyOf(ctx, msg)
	if err != nil {
		return err
	}
	claimed := time.Now()
	r := g.claim(ctx, key, fp)
	acquired := r.Err == nil && r.State == Acquired
	if acquired && ctx.Err() != nil {
		// The delivery ended (its lease lost, the shutdown deadline) while
		// the claim was on its way: the handler must not run now, and the
		// claim is given back, or the redelivery would be deferred as an
		// overlapping duplicate of nothing until the claim's lease ran out.
		g.release(ctx, key, r.Token)
		return context.Cause(ctx)
	}
	keep, answered, err := g.judge(ctx, key, r, claimed, time.Now())
	if answered {
		g.down.answered(ctx)
	}
	if !keep {
		if acquired { // answered too late
			g.release(ctx, key, r.Token)
		}
		return err
	}
	tok := r.Token

	hctx, cancel := context.WithCancelCause(ctx)
	k := g.keepOne(key, tok, claimed, cancel)
	finished := false
	defer func() {
		if !finished { // the handler panicked: let a retry claim the key
			k.stop()
			cancel(nil)
			g.release(ctx, key, tok)
		}
	}()
	err = g.next.Handle(hctx, msg)
	finished = true
	k.stop()
	cancel(nil)

	if err != nil {
		g.release(ctx, key, tok)
		if k.lostCounted() && ctx.Err() == nil && !consumer.IsPermanent(err) {
			// The middleware stopped the handler, its claim lost: the
			// failure is the store's (or a stall's), not the message's.
			// A Permanent error is the handler's own verdict, and stands.
			return consumer.Unavailable(fmt.Errorf("idempotency: key %q: %w; the handler returned: %w", key, context.Cause(hctx), err))
		}
		return err
	}
	g.complete(ctx, key, tok, k.lostCounted())
	return nil
}

// keyOf reads m's key and fingerprint, or fails m, permanently, when it has
// no key.
func (c *core) keyOf(ctx context.Context, m *consumer.Message) (key, fp string, err error) {
	if key = c.cfg.keyFunc(m); key == "" {
		c.m.MissingKeys.Add(ctx, 1, c.m.Plain)
		return "", "", consumer.Permanent(ErrNoKey)
	}
	if c.cfg.fingerprint != nil {
		fp = c.cfg.fingerprint(m)
	}
	return key, fp, nil
}

// unavailable is the outcome of a message whose claim the store failed:
// consumer.Unavailable, counted, and reported without a log line per
// message.
func (c *core) unavailable(ctx context.Context, key string, err error) error {
	if ctx.Err() == nil { // a delivery that ended meanwhile is not the store's fault
		c.m.StoreErrors.Add(ctx, 1, c.m.OpClaim)
		c.down.failed(ctx, key, err)
	}
	return consumer.Unavailable(fmt.Errorf("idempotency: claiming key %q: %w", key, err))
}

// claim claims key on the store. It does not give up when the delivery's
// context ends: a store may have made the claim by then, and a caller that
// stopped waiting for the reply would leave it behind, held by nobody, for
// the claim's whole lease. It waits up to the store timeout instead, and
// Handle gives back a claim that arrived too late.
func (c *core) claim(ctx context.Context, key, fp string) (r ClaimResult) {
	cctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
	defer done()
	r.State, r.Token, r.Err = c.store.Claim(cctx, key, fp, c.cfg.lease)
	return r
}

// judge reads the store's answer r to the claim of key, sent at sent and
// answered at now, and counts it. keep: the claim is held and the handler
// runs. Otherwise err is the message's outcome (nil: a sequential
// duplicate, done). answered: the store answered in time, with a state.
func (c *core) judge(ctx context.Context, key string, r ClaimResult, sent, now time.Time) (keep, answered bool, err error) {
	switch {
	case r.Err == nil && r.State == Acquired && !now.Before(sent.Add(c.cfg.lease)):
		// A stalled store or network, a paused process: the claim holds
		// nothing any more, and another delivery may have taken the key
		// over and be running the effect. The caller gives it back (a
		// no-op if it was taken over), and the message waits, as after a
		// Claim that failed.
		return false, false, c.unavailable(ctx, key, fmt.Errorf("the store's reply came after the claim's lease (%v) had run out: %w", c.cfg.lease, ErrClaimLost))
	case errors.Is(r.Err, ErrFingerprintMismatch):
		c.m.Mismatches.Add(ctx, 1, c.m.Plain)
		return false, false, consumer.Permanent(r.Err)
	case errors.Is(r.Err, ErrUnstorableKey):
		return false, false, consumer.Permanent(r.Err)
	case r.Err != nil:
		return false, false, c.unavailable(ctx, key, r.Err)
	case r.State == Acquired:
		return true, true, nil
	case r.State == Completed:
		c.m.Duplicates.Add(ctx, 1, c.m.Sequential)
		return false, true, nil
	case r.State == InProgressElsewhere:
		return false, true, c.overlapping(ctx, key)
	}
	return false, false, c.unavailable(ctx, key, fmt.Errorf("the store answered an invalid state %d (a bug in the Store implementation)", r.State))
}

// overlapping counts an overlapping duplicate of key and returns its
// outcome: deferred until the other delivery is likely done.
func (c *core) overlapping(ctx context.Context, key string) error {
	c.m.Duplicates.Add(ctx, 1, c.m.Overlapping)
	return consumer.Defer(fmt.Errorf("%w (key %q)", ErrInProgressElsewhere, key), c.cfg.overlapDelay)
}

// complete records the effect. A failure does not fail the message: the
// effect happened, and retrying the message would run it again; a later
// duplicate, if any, runs it again instead, which the log and
// MetricClaimsLost report (counted reports the keeper already counted the
// loss). A failed Complete is first tried again (completeTries in all,
// within the store timeout), so that one dropped connection does not leave
// the key in progress; a repeated Complete is harmless (see Store).
func (c *core) complete(ctx context.Context, key string, tok Token, counted bool) {
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
	defer done()
	var err error
	for try := 1; ; try++ {
		err = c.store.Complete(sctx, key, tok, c.cfg.retention)
		if err == nil || errors.Is(err, ErrStaleToken) || try == completeTries || !pause(sctx, completeRetryDelay*time.Duration(try)) {
			break
		}
	}
	if err == nil {
		return
	}
	if errors.Is(err, ErrStaleToken) {
		if !counted {
			c.m.ClaimsLost.Add(ctx, 1, c.m.OpComplete)
		}
		c.cfg.logger.WarnContext(ctx, "idempotency: the claim was lost before the effect was recorded; a duplicate may run the effect again (lengthen the lease)",
			slog.String("key", key), slog.Any("error", err))
		return
	}
	c.m.StoreErrors.Add(ctx, 1, c.m.OpComplete)
	c.cfg.logger.ErrorContext(ctx, "idempotency: could not record the completed effect; the message is acked, but a duplicate delivered after the lease runs out would run the effect again",
		slog.String("key", key), slog.Any("error", err))
}

// completeTries bounds the tries of a failed Complete; completeRetryDelay
// times the try number is the wait before the next.
const (
	completeTries      = 3
	completeRetryDelay = 50 * time.Millisecond
)

// pause waits for d, and reports false if ctx ended first.
func pause(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// release lets a retry claim the key at once. On failure the claim runs out
// after its lease, and retries meanwhile are overlapping duplicates.
func (c *core) release(ctx context.Context, key string, tok Token) {
	sctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
	defer done()
	err := c.store.Release(sctx, key, tok)
	if err == nil || errors.Is(err, ErrStaleToken) {
		return // stale: the claim had already run out or been taken over
	}
	c.m.StoreErrors.Add(ctx, 1, c.m.OpRelease)
	c.cfg.logger.WarnContext(ctx, "idempotency: could not release the claim; the key's next delivery waits until the claim's lease runs out",
		slog.String("key", key), slog.Any("error", err))
}
