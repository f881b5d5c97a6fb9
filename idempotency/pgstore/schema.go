package pgstore

import (
	"context"
	"errors"
	"fmt"
)

// DefaultTable is the table the store uses unless WithTable says otherwise.
const DefaultTable = "custody_idempotency"

// DDL returns the statements CreateSchema runs for a store made with the
// same options, for a migration tool. It fails only on an invalid option.
func DDL(opts ...Option) ([]string, error) {
	s, err := configure(opts)
	if err != nil {
		return nil, err
	}
	return s.ddl(), nil
}

func (s *Store) ddl() []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + s.t.Quoted + ` (
    key         text        PRIMARY KEY,
    token       text        NOT NULL,
    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
    fingerprint text        NOT NULL DEFAULT '',
    expires_at  timestamptz NOT NULL
)`,
		`CREATE INDEX IF NOT EXISTS ` + s.t.Index("expires_at_idx") + ` ON ` + s.t.Quoted + ` (expires_at)`,
	}
}

// CreateSchema creates the table and index of a store made with the same
// options, if they do not exist. Call it before New.
func CreateSchema(ctx context.Context, db DB, opts ...Option) error {
	if db == nil {
		return errors.New("pgstore: CreateSchema(nil): pass a *pgxpool.Pool")
	}
	s, err := configure(opts)
	if err != nil {
		return err
	}
	for _, q := range s.ddl() {
		if _, err := db.Exec(ctx, q); err != nil {
			return fmt.Errorf("pgstore: create schema: %w", err)
		}
	}
	return nil
}
