package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/custody-go/custody/consumer"
)

// NewBatch returns middleware for batch handlers (consumer.NewBatch) that
// does for each message of a batch what New does for one, with the same
// options: see the package documentation, section Batches.
func NewBatch(store Store, opts ...Option) (consumer.BatchMiddleware, error) {
	c, err := newCore("NewBatch", store, opts)
	if err != nil {
		return nil, err
	}
	return func(next consumer.BatchHandler) consumer.BatchHandler {
		return &batchGuard{core: c, next: next}
	}, nil
}

// BatchMiddleware is NewBatch for options known to be valid when the
// program is written; it panics with NewBatch's error otherwise.
func BatchMiddleware(store Store, opts ...Option) consumer.BatchMiddleware {
	mw, err := NewBatch(store, opts...)
	if err != nil {
		panic(err)
	}
	return mw
}

type batchGuard struct {
	*core
	next consumer.BatchHandler
}

// entry is one message of a batch on its way through the middleware.
type entry struct {
	m     *consumer.Message
	key   string
	fp    string
	first int // the entry of the batch's first message with this key: its own for that one, -1 without a key
	state State
	done  bool  // the next handler marked it done
	err   error // the outcome of a message whose key was not acquired (nil: done)
}

// HandleBatch implements consumer.BatchHandler.
func (g *batchGuard) HandleBatch(ctx context.Context, b *consumer.Batch) error {
	es := make([]entry, len(b.Messages))
	firsts := make(map[string]int, len(b.Messages))
	var (
		claims  []ClaimRequest
		claimOf []int // the entry of each claim
	)
	for i, m := range b.Messages {
		e := &es[i]
		e.m, e.first = m, i
		var err error
		if e.key, e.fp, err = g.keyOf(ctx, m); err != nil {
			e.first = -1
			b.Fail(m, err)
			continue
		}
		if j, ok := firsts[e.key]; ok {
			e.first = j
			continue
		}
		firsts[e.key] = i
		claims = append(claims, ClaimRequest{Key: e.key, Fingerprint: e.fp})
		claimOf = append(claimOf, i)
	}

	results, sent := g.claimAll(ctx, claims)
	if ctx.Err() != nil {
		// The batch's deliveries ended (the shutdown deadline, the handler
		// timeout) while the claims were on their way: nothing runs now,
		// and the claims made are given back at once, or the redeliveries
		// would wait on them as overlapping duplicates of nothing.
		var held []HeldClaim
		for j, r := range results {
			if r.Err == nil && r.State == Acquired {
				held = append(held, HeldClaim{Key: claims[j].Key, Token: r.Token})
			}
		}
		g.releaseAll(ctx, held)
		return context.Cause(ctx)
	}

	now := time.Now()
	var (
		kept   []keptClaim
		keptOf []int // the entry of each kept claim
		late   []HeldClaim
	)
	answered := false
	for j, r := range results {
		e := &es[claimOf[j]]
		e.state = r.State
		keep, ok, err := g.judge(ctx, e.key, r, sent[j], now)
		answered = answered || ok
		if keep {
			kept = append(kept, keptClaim{HeldClaim: HeldClaim{Key: e.key, Token: r.Token}, expires: sent[j].Add(g.cfg.lease)})
			keptOf = append(keptOf, claimOf[j])
			continue
		}
		if r.Err == nil && r.State == Acquired { // answered too late
			late = append(late, HeldClaim{Key: e.key, Token: r.Token})
		}
		e.err = err
		b.Fail(e.m, err)
	}
	if answered {
		g.down.answered(ctx)
	}
	g.releaseAll(ctx, late)

	if len(kept) > 0 {
		if err := g.run(ctx, b, es, kept, keptOf); err != nil {
			return err
		}
	}
	g.settleDuplicates(ctx, b, es)
	return nil
}

// run passes the messages of the kept claims to the next handler, keeps
// the claims alive while it runs, and then completes or releases each.
func (g *batchGuard) run(ctx context.Context, b *consumer.Batch, es []entry, kept []keptClaim, keptOf []int) error {
	msgs := make([]*consumer.Message, len(kept))
	held := make([]HeldClaim, len(kept))
	for j, i := range keptOf {
		msgs[j] = es[i].m
		held[j] = kept[j].HeldClaim
	}
	sub := consumer.BatchOf(msgs)
	hctx, cancel := context.WithCancelCause(ctx)
	k := g.keepAll(kept, cancel)
	finished := false
	defer func() {
		if !finished { // the handler panicked: let the retries claim the keys
			k.stop()
			cancel(nil)
			g.releaseAll(ctx, held)
		}
	}()
	err := g.next.HandleBatch(hctx, sub)
	finished = true
	k.stop()
	cause := context.Cause(hctx)
	cancel(nil)
	// A lost claim stopped the whole batch: its failures are the store's
	// (or a stall's), not the messages'. A Permanent error is the
	// handler's own verdict, and stands.
	stopped := k.lostCounted() && ctx.Err() == nil

	if err != nil {
		g.releaseAll(ctx, held)
		if stopped && !consumer.IsPermanent(err) {
			return consumer.Unavailable(fmt.Errorf("idempotency: %w; the batch handler returned: %w", cause, err))
		}
		return err
	}
	var (
		done, failed []HeldClaim
		counted      []bool // the keeper lost (and counted) the claim of done[i]
	)
	for j, m := range msgs {
		res, ok := sub.Result(m)
		switch {
		case ok && res == nil:
			es[keptOf[j]].done = true
			done = append(done, held[j])
			counted = append(counted, k.lostAt(j))
			b.Done(m)
		case ok:
			failed = append(failed, held[j])
			if stopped && !consumer.IsPermanent(res) {
				res = consumer.Unavailable(fmt.Errorf("idempotency: %w; the batch handler failed the message: %w", cause, res))
			}
			b.Fail(m, res)
		default: // no outcome: consumer.ErrNoOutcome applies
			failed = append(failed, held[j])
		}
	}
	g.completeAll(ctx, done, counted)
	g.releaseAll(ctx, failed)
	return nil
}

// settleDuplicates records the outcome of each message whose key an
// earlier message of the batch has.
func (g *batchGuard) settleDuplicates(ctx context.Context, b *consumer.Batch, es []entry) {
	for i := range es {
		e := &es[i]
		if e.first < 0 || e.first == i {
			continue
		}
		p := &es[e.first]
		var err error
		switch {
		case e.fp != "" && p.fp != "" && e.fp != p.fp:
			g.m.Mismatches.Add(ctx, 1, g.m.Plain)
			err = consumer.Permanent(fmt.Errorf("%w (key %q, twice in one batch)", ErrFingerprintMismatch, e.key))
		case p.state == Acquired && p.err == nil:
			if !p.done {
				// Failed, or left without an outcome: the retry of one
				// of the two runs the effect; the other waits for it.
				g.m.Duplicates.Add(ctx, 1, g.m.Overlapping)
				err = consumer.Defer(fmt.Errorf("%w (key %q)", ErrInProgressElsewhere, e.key), g.cfg.overlapDelay)
				break
			}
			g.m.Duplicates.Add(ctx, 1, g.m.Sequential)
		default: // the first one's claim decided: so it does for this one
			err = p.err
			switch {
			case err == nil:
				g.m.Duplicates.Add(ctx, 1, g.m.Sequential)
			case consumer.IsDeferred(err):
				g.m.Duplicates.Add(ctx, 1, g.m.Overlapping)
			}
		}
		b.Fail(e.m, err)
	}
}

// claimAll claims claims, in one call where the store takes batches, and
// returns when each was sent. As claim does, it waits for the store's
// reply whatever happens to ctx, up to the store timeout.
func (c *core) claimAll(ctx context.Context, claims []ClaimRequest) ([]ClaimResult, []time.Time) {
	sent := make([]time.Time, len(claims))
	if bs, ok := c.store.(BatchStore); ok && len(claims) > 1 {
		cctx, done := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.storeTimeout)
		defer done()
		now := time.Now()
		for i := range sent {
			sent[i] = now
		}
		return checked(bs.ClaimBatch(cctx, claims, c.cfg.lease), len(claims), "ClaimBatch", func(err error) ClaimResult { return ClaimResult{Err: err} }), sent
	}
	res := make([]ClaimResult, len(claims))
	for i, cl := range claims {
		sent[i] = time.Now()
		r := c.claim(ctx, cl.Key, cl.Fingerprint)
		res[i] = r
		if r.Err == nil || errors.Is(r.Err, ErrFingerprintMismatch) || errors.Is(r.Err, ErrUnstorableKey) {
			continue
		}
		// The store failed: the later claims are not sent to wait out a
		// timeout each, but fail with the same error.
		for j := i + 1; j < len(res); j++ {
			sent[j] = sent[i]
			res[j].Err = fmt.Errorf("not sent after an earlier claim of the batch failed: %w", r.Err)
		}
		break
	}
	return res, sent
}
