package pgstore

import (
	"context"
	"fmt"
)

// DefaultTable is the table the store uses unless WithTable says otherwise.
const DefaultTable = "custody_idempotency"

// DDL returns the statements CreateSchema runs, for a migration tool.
func (s *Store) DDL() []string {
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

// CreateSchema creates the store's table and index if they do not exist.
func (s *Store) CreateSchema(ctx context.Context) error {
	for _, q := range s.DDL() {
		if _, err := s.db.Exec(ctx, q); err != nil {
			return fmt.Errorf("pgstore: create schema: %w", err)
		}
	}
	return nil
}
