package pgstore

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/internal/option"
)

// DB is what the store needs from pgx: *pgxpool.Pool satisfies it, and so
// does *pgx.Conn for a store used by one goroutine at a time.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Store is an idempotency.Store in a PostgreSQL table. It is safe for
// concurrent use when its DB is.
type Store struct {
	db DB
	t  pgsql.Table

	claimSQL, completeSQL, releaseSQL, extendSQL, cleanupSQL string

	claimBatchSQL, completeBatchSQL, releaseBatchSQL, extendBatchSQL string
}

var _ idempotency.Store = (*Store)(nil)

// Option configures a Store.
type Option func(*Store) error

// WithTable names the table ("name" or "schema.name"). Default
// DefaultTable ("custody_idempotency").
func WithTable(name string) Option {
	return func(s *Store) error {
		t, err := pgsql.ParseTable(name)
		if err != nil {
			return fmt.Errorf("pgstore: WithTable(%q): %w", name, err)
		}
		s.t = t
		return nil
	}
}

// New returns a Store over db. It checks that the database answers and
// that the store's table is there, with the columns the store uses, so
// that a wrong connection string or a table not yet created (see
// [CreateSchema] and [DDL]) fails here, saying what to do, rather than
// leave every message waiting on a store that cannot serve it. ctx bounds
// that one round trip.
func New(ctx context.Context, db DB, opts ...Option) (*Store, error) {
	if db == nil {
		return nil, errors.New("pgstore: New(nil): pass a *pgxpool.Pool")
	}
	s, err := configure(opts)
	if err != nil {
		return nil, err
	}
	s.db = db
	if err := s.check(ctx); err != nil {
		return nil, err
	}
	return s, nil
}

// configure applies opts to a Store without a database.
func configure(opts []Option) (*Store, error) {
	s := &Store{}
	s.t, _ = pgsql.ParseTable(DefaultTable)
	if err := option.Apply(s, opts); err != nil {
		return nil, err
	}
	s.prepareSQL()
	return s, nil
}

// check reads nothing from the table, but names every column the store
// uses: it fails as the store's statements would.
func (s *Store) check(ctx context.Context) error {
	_, err := s.db.Exec(ctx, `SELECT key, token, state, fingerprint, expires_at FROM `+s.t.Quoted+` WHERE false`)
	if err == nil {
		return nil
	}
	var ce *pgconn.ConnectError
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &ce) || !errors.As(err, &pe):
		return fmt.Errorf("pgstore: New: PostgreSQL does not answer; check the connection string, the credentials and that the server runs: %w", err)
	case pe.Code == "42P01" || pe.Code == "3F000": // undefined_table, invalid_schema_name
		return fmt.Errorf("pgstore: New: the table %s does not exist; create it with pgstore.CreateSchema(ctx, db) (given the same options as New), or apply pgstore.DDL() with your migrations: %w", s.t.Quoted, err)
	case pe.Code == "42703": // undefined_column
		return fmt.Errorf("pgstore: New: the table %s lacks the store's columns (is it another table of the same name?); name another with WithTable, or see pgstore.DDL() for the store's: %w", s.t.Quoted, err)
	case pe.Code == "42501": // insufficient_privilege
		return fmt.Errorf("pgstore: New: the role may not use the table %s; grant it SELECT, INSERT, UPDATE and DELETE: %w", s.t.Quoted, err)
	}
	return fmt.Errorf("pgstore: New: checking the table %s: %w", s.t.Quoted, err)
}

func (s *Store) prepareSQL() {
	t := s.t.Quoted
	// The INSERT either creates the claim or takes over an expired record
	// (RETURNING a row), or leaves a live record alone (no row); the second
	// branch then reports that record. When the live record was committed
	// after this statement's snapshot was taken, neither branch returns a
	// row and Claim runs the statement again.
	s.claimSQL = `WITH claimed AS (
    INSERT INTO ` + t + ` AS r (key, token, state, fingerprint, expires_at)
    VALUES ($1, $2, 'in_progress', $3, now() + $4::float8 * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
        SET token = excluded.token, state = excluded.state,
            fingerprint = excluded.fingerprint, expires_at = excluded.expires_at
        WHERE r.expires_at <= now()
    RETURNING true AS acquired, r.state, r.fingerprint
)
SELECT acquired, state, fingerprint FROM claimed
UNION ALL
SELECT false, state, fingerprint FROM ` + t + `
WHERE key = $1 AND expires_at > now() AND NOT EXISTS (SELECT FROM claimed)`

	// Completing a completed record again with its own token succeeds and
	// changes nothing, so a retried Complete is harmless.
	s.completeSQL = `UPDATE ` + t + `
SET expires_at = CASE WHEN state = 'in_progress'
                      THEN now() + $3::float8 * interval '1 millisecond'
                      ELSE expires_at END,
    state = 'completed'
WHERE key = $1 AND token = $2 AND expires_at > now()`

	s.releaseSQL = `DELETE FROM ` + t + `
WHERE key = $1 AND token = $2 AND state = 'in_progress' AND expires_at > now()`

	s.extendSQL = `UPDATE ` + t + `
SET expires_at = now() + $3::float8 * interval '1 millisecond'
WHERE key = $1 AND token = $2 AND state = 'in_progress' AND expires_at > now()`

	// SKIP LOCKED lets several cleaners run at once, and lets a claim that
	// is taking over an expired row win over the cleaner.
	s.cleanupSQL = `DELETE FROM ` + t + `
WHERE key IN (
    SELECT key FROM ` + t + ` WHERE expires_at <= now()
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
AND expires_at <= now()`

	s.prepareBatchSQL()
}

// Claim implements idempotency.Store.
func (s *Store) Claim(ctx context.Context, key, fingerprint string, lease time.Duration) (idempotency.State, idempotency.Token, error) {
	if err := checkDuration("lease", lease); err != nil {
		return 0, "", err
	}
	if err := pgsql.CheckText(key, fingerprint); err != nil {
		return 0, "", fmt.Errorf("pgstore: claim: %w", err)
	}
	tok := idempotency.NewToken()
	for attempt := 0; ; attempt++ {
		var (
			acquired bool
			state    string
			fp       string
		)
		err := s.db.QueryRow(ctx, s.claimSQL, key, string(tok), fingerprint, millis(lease)).Scan(&acquired, &state, &fp)
		if errors.Is(err, pgx.ErrNoRows) && attempt < 10 {
			continue // the record changed under the statement; look again
		}
		if err != nil {
			return 0, "", fmt.Errorf("pgstore: claim %q: %w", key, err)
		}
		st, err := found(key, fingerprint, acquired, state, fp)
		if st != idempotency.Acquired {
			tok = ""
		}
		return st, tok, err
	}
}

// found reads what the claim of key found: the key acquired, or the live
// record, in state recState with fingerprint recFP, that holds it.
func found(key, fingerprint string, acquired bool, recState, recFP string) (idempotency.State, error) {
	switch {
	case acquired:
		return idempotency.Acquired, nil
	case fingerprint != "" && recFP != "" && fingerprint != recFP:
		return 0, fmt.Errorf("%w (key %q)", idempotency.ErrFingerprintMismatch, key)
	case recState == "completed":
		return idempotency.Completed, nil
	}
	return idempotency.InProgressElsewhere, nil
}

// Complete implements idempotency.Store.
func (s *Store) Complete(ctx context.Context, key string, token idempotency.Token, retention time.Duration) error {
	if err := checkDuration("retention", retention); err != nil {
		return err
	}
	return s.exec(ctx, "complete", s.completeSQL, key, string(token), millis(retention))
}

// Release implements idempotency.Store.
func (s *Store) Release(ctx context.Context, key string, token idempotency.Token) error {
	return s.exec(ctx, "release", s.releaseSQL, key, string(token))
}

// Extend implements idempotency.Store.
func (s *Store) Extend(ctx context.Context, key string, token idempotency.Token, lease time.Duration) error {
	if err := checkDuration("lease", lease); err != nil {
		return err
	}
	return s.exec(ctx, "extend", s.extendSQL, key, string(token), millis(lease))
}

func (s *Store) exec(ctx context.Context, op, sql string, args ...any) error {
	tag, err := s.db.Exec(ctx, sql, args...)
	if err != nil {
		return fmt.Errorf("pgstore: %s %q: %w", op, args[0], err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("%w (key %q)", idempotency.ErrStaleToken, args[0])
	}
	return nil
}

func millis(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func checkDuration(name string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("pgstore: %s %v: must be positive", name, d)
	}
	return nil
}
