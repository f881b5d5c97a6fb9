package redisstore

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/custody-go/custody/idempotency"
)

var _ idempotency.BatchStore = (*Store)(nil)

// pipeliner is a client that sends many commands in one round trip; every
// go-redis client is one. On a cluster, go-redis splits a pipeline by slot.
type pipeliner interface {
	Pipeline() redis.Pipeliner
}

// ClaimBatch implements idempotency.BatchStore: one SET NX GET per key, in
// one pipeline.
func (s *Store) ClaimBatch(ctx context.Context, claims []idempotency.ClaimRequest, lease time.Duration) []idempotency.ClaimResult {
	res := make([]idempotency.ClaimResult, len(claims))
	if err := checkDuration("lease", lease); err != nil {
		for i := range res {
			res[i].Err = err
		}
		return res
	}
	p, ok := s.c.(pipeliner)
	if !ok || len(claims) < 2 {
		for i, c := range claims {
			res[i].State, res[i].Token, res[i].Err = s.Claim(ctx, c.Key, c.Fingerprint, lease)
		}
		return res
	}
	pipe := p.Pipeline()
	toks := make([]idempotency.Token, len(claims))
	cmds := make([]*redis.StatusCmd, len(claims))
	args := claimArgs(lease)
	for i, c := range claims {
		toks[i] = idempotency.NewToken()
		cmds[i] = pipe.SetArgs(ctx, s.prefix+c.Key, inProgress+string(toks[i])+":"+c.Fingerprint, args)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	for i, c := range claims {
		old, err := cmds[i].Result()
		res[i].State, res[i].Token, res[i].Err = s.claimed(c.Key, c.Fingerprint, toks[i], old, err)
	}
	return res
}

// CompleteBatch implements idempotency.BatchStore: the Complete script for
// each claim, in one pipeline.
func (s *Store) CompleteBatch(ctx context.Context, held []idempotency.HeldClaim, retention time.Duration) []error {
	if err := checkDuration("retention", retention); err != nil {
		return fill(len(held), err)
	}
	return s.runBatch(ctx, "complete", completeScript, held, millis(retention))
}

// ReleaseBatch implements idempotency.BatchStore.
func (s *Store) ReleaseBatch(ctx context.Context, held []idempotency.HeldClaim) []error {
	return s.runBatch(ctx, "release", releaseScript, held)
}

// ExtendBatch implements idempotency.BatchStore.
func (s *Store) ExtendBatch(ctx context.Context, held []idempotency.HeldClaim, lease time.Duration) []error {
	if err := checkDuration("lease", lease); err != nil {
		return fill(len(held), err)
	}
	return s.runBatch(ctx, "extend", extendScript, held, millis(lease))
}

// runBatch runs script for each claim of held, with its token and more as
// arguments, in one pipeline of EVALSHA. The entries that find the script
// missing from Redis's cache (a restart, SCRIPT FLUSH) did not run: the
// script is loaded and they are sent again.
func (s *Store) runBatch(ctx context.Context, op string, script *redis.Script, held []idempotency.HeldClaim, more ...any) []error {
	errs := make([]error, len(held))
	p, ok := s.c.(pipeliner)
	if !ok || len(held) < 2 {
		for i, h := range held {
			errs[i] = s.run(ctx, op, script, h.Key, append([]any{string(h.Token)}, more...)...)
		}
		return errs
	}
	todo := make([]int, len(held))
	for i := range todo {
		todo[i] = i
	}
	for try := 0; len(todo) > 0; try++ {
		pipe := p.Pipeline()
		cmds := make([]*redis.Cmd, len(todo))
		for j, i := range todo {
			cmds[j] = script.EvalSha(ctx, pipe, []string{s.prefix + held[i].Key}, append([]any{string(held[i].Token)}, more...)...)
		}
		_, _ = pipe.Exec(ctx) // each command carries its own error
		var missing []int
		for j, i := range todo {
			n, err := cmds[j].Int()
			switch {
			case err != nil && try == 0 && redis.HasErrorPrefix(err, "NOSCRIPT"):
				missing = append(missing, i)
			default:
				errs[i] = result(op, held[i].Key, n, err)
			}
		}
		if len(missing) > 0 {
			if err := script.Load(ctx, s.c).Err(); err != nil {
				for _, i := range missing {
					errs[i] = result(op, held[i].Key, 0, err)
				}
				break
			}
		}
		todo = missing
	}
	return errs
}

func fill(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}
