package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
)

var _ idempotency.BatchStore = (*Store)(nil)

// The batch statements take their entries as arrays (unnest) and answer in
// one row of arrays, so that a batch is one round trip through the DB's
// QueryRow.
func (s *Store) prepareBatchSQL() {
	t := s.t.Quoted
	// As claimSQL, for many keys. The rows are inserted in key order, so
	// that two batches sharing keys wait for each other's rows in one
	// order and never deadlock. A key whose live record was committed
	// after the statement's snapshot shows neither as claimed nor as a
	// record (state ''), and is claimed again.
	s.claimBatchSQL = `WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) WITH ORDINALITY AS i(key, token, fingerprint, ord)
), claimed AS (
    INSERT INTO ` + t + ` AS r (key, token, state, fingerprint, expires_at)
    SELECT key, token, 'in_progress', fingerprint, now() + $4::float8 * interval '1 millisecond'
    FROM input ORDER BY key
    ON CONFLICT (key) DO UPDATE
        SET token = excluded.token, state = excluded.state,
            fingerprint = excluded.fingerprint, expires_at = excluded.expires_at
        WHERE r.expires_at <= now()
    RETURNING r.key
)
SELECT coalesce(array_agg(c.key IS NOT NULL ORDER BY i.ord), '{}'),
    coalesce(array_agg(coalesce(r.state, '') ORDER BY i.ord), '{}'),
    coalesce(array_agg(coalesce(r.fingerprint, '') ORDER BY i.ord), '{}')
FROM input i
LEFT JOIN claimed c ON c.key = i.key
LEFT JOIN ` + t + ` r ON c.key IS NULL AND r.key = i.key AND r.expires_at > now()`

	// As completeSQL, releaseSQL and extendSQL, for many claims; each
	// answers the keys it changed.
	s.completeBatchSQL = `WITH done AS (
    UPDATE ` + t + ` AS r
    SET expires_at = CASE WHEN r.state = 'in_progress'
                          THEN now() + $3::float8 * interval '1 millisecond'
                          ELSE r.expires_at END,
        state = 'completed'
    FROM unnest($1::text[], $2::text[]) AS i(key, token)
    WHERE r.key = i.key AND r.token = i.token AND r.expires_at > now()
    RETURNING r.key
)
SELECT coalesce(array_agg(key), '{}') FROM done`

	s.releaseBatchSQL = `WITH done AS (
    DELETE FROM ` + t + ` AS r
    USING unnest($1::text[], $2::text[]) AS i(key, token)
    WHERE r.key = i.key AND r.token = i.token AND r.state = 'in_progress' AND r.expires_at > now()
    RETURNING r.key
)
SELECT coalesce(array_agg(key), '{}') FROM done`

	s.extendBatchSQL = `WITH done AS (
    UPDATE ` + t + ` AS r
    SET expires_at = now() + $3::float8 * interval '1 millisecond'
    FROM unnest($1::text[], $2::text[]) AS i(key, token)
    WHERE r.key = i.key AND r.token = i.token AND r.state = 'in_progress' AND r.expires_at > now()
    RETURNING r.key
)
SELECT coalesce(array_agg(key), '{}') FROM done`
}

// ClaimBatch implements idempotency.BatchStore: one statement for the
// batch.
func (s *Store) ClaimBatch(ctx context.Context, claims []idempotency.ClaimRequest, lease time.Duration) []idempotency.ClaimResult {
	res := make([]idempotency.ClaimResult, len(claims))
	if err := checkDuration("lease", lease); err != nil {
		for i := range res {
			res[i].Err = err
		}
		return res
	}
	todo := make([]int, 0, len(claims))
	for i, c := range claims {
		if err := pgsql.CheckText(c.Key, c.Fingerprint); err != nil {
			res[i].Err = fmt.Errorf("pgstore: claim: %w", err)
			continue
		}
		todo = append(todo, i)
	}
	for attempt := 0; len(todo) > 0; attempt++ {
		keys := make([]string, len(todo))
		toks := make([]string, len(todo))
		fps := make([]string, len(todo))
		for j, i := range todo {
			keys[j], toks[j], fps[j] = claims[i].Key, string(idempotency.NewToken()), claims[i].Fingerprint
		}
		var (
			acquired []bool
			states   []string
			oldFPs   []string
		)
		err := s.db.QueryRow(ctx, s.claimBatchSQL, keys, toks, fps, millis(lease)).Scan(&acquired, &states, &oldFPs)
		if err == nil && (len(acquired) != len(todo) || len(states) != len(todo) || len(oldFPs) != len(todo)) {
			err = fmt.Errorf("the statement answered %d entries for %d", len(acquired), len(todo))
		}
		if err != nil {
			for _, i := range todo {
				res[i].Err = fmt.Errorf("pgstore: claim %q: %w", claims[i].Key, err)
			}
			return res
		}
		var again []int
		for j, i := range todo {
			r := &res[i]
			if !acquired[j] && states[j] == "" { // the record changed under the statement
				if attempt < 10 {
					again = append(again, i) // look again
				} else {
					r.Err = fmt.Errorf("pgstore: claim %q: %w", claims[i].Key, errRecordChanging)
				}
				continue
			}
			r.State, r.Err = found(claims[i].Key, claims[i].Fingerprint, acquired[j], states[j], oldFPs[j])
			if r.State == idempotency.Acquired {
				r.Token = idempotency.Token(toks[j])
			}
		}
		todo = again
	}
	return res
}

var errRecordChanging = errors.New("the record kept changing under the claim")

// CompleteBatch implements idempotency.BatchStore: one statement for the
// batch.
func (s *Store) CompleteBatch(ctx context.Context, held []idempotency.HeldClaim, retention time.Duration) []error {
	if err := checkDuration("retention", retention); err != nil {
		return fill(len(held), err)
	}
	return s.execBatch(ctx, "complete", s.completeBatchSQL, held, millis(retention))
}

// ReleaseBatch implements idempotency.BatchStore: one statement for the
// batch.
func (s *Store) ReleaseBatch(ctx context.Context, held []idempotency.HeldClaim) []error {
	return s.execBatch(ctx, "release", s.releaseBatchSQL, held)
}

// ExtendBatch implements idempotency.BatchStore: one statement for the
// batch.
func (s *Store) ExtendBatch(ctx context.Context, held []idempotency.HeldClaim, lease time.Duration) []error {
	if err := checkDuration("lease", lease); err != nil {
		return fill(len(held), err)
	}
	return s.execBatch(ctx, "extend", s.extendBatchSQL, held, millis(lease))
}

// execBatch runs sql for held, and fails with a stale token each claim whose
// key it did not change.
func (s *Store) execBatch(ctx context.Context, op, sql string, held []idempotency.HeldClaim, more ...any) []error {
	errs := make([]error, len(held))
	if len(held) == 0 {
		return errs
	}
	keys := make([]string, len(held))
	toks := make([]string, len(held))
	for i, h := range held {
		keys[i], toks[i] = h.Key, string(h.Token)
	}
	var changed []string
	if err := s.db.QueryRow(ctx, sql, append([]any{keys, toks}, more...)...).Scan(&changed); err != nil {
		for i, h := range held {
			errs[i] = fmt.Errorf("pgstore: %s %q: %w", op, h.Key, err)
		}
		return errs
	}
	done := make(map[string]bool, len(changed))
	for _, k := range changed {
		done[k] = true
	}
	for i, h := range held {
		if !done[h.Key] {
			errs[i] = fmt.Errorf("%w (key %q)", idempotency.ErrStaleToken, h.Key)
		}
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
