package pgstore

import (
	"context"
	"fmt"
	"time"
)

// Cleanup deletes expired records, at most batch rows per statement so that
// no single statement holds many row locks or runs long, until none are
// left. It returns how many rows it deleted. Records whose retention has
// passed are forgotten: a redelivery of such a key runs the handler again,
// so keep the retention longer than the broker can redeliver a message.
func (s *Store) Cleanup(ctx context.Context, batch int) (int64, error) {
	if batch < 1 {
		return 0, fmt.Errorf("pgstore: Cleanup batch %d: must be at least 1", batch)
	}
	var total int64
	for {
		tag, err := s.db.Exec(ctx, s.cleanupSQL, batch)
		if err != nil {
			return total, fmt.Errorf("pgstore: cleanup: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// RunCleanup calls Cleanup every interval until ctx is done, and returns
// ctx's error. Errors from a round are passed to onError (which may be nil)
// and the next round tries again. Run it on a goroutine you own, in one or
// more processes; concurrent cleaners do not conflict.
func (s *Store) RunCleanup(ctx context.Context, interval time.Duration, batch int, onError func(error)) error {
	if interval <= 0 {
		return fmt.Errorf("pgstore: RunCleanup interval %v: must be positive", interval)
	}
	if batch < 1 {
		return fmt.Errorf("pgstore: RunCleanup batch %d: must be at least 1", batch)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		if _, err := s.Cleanup(ctx, batch); err != nil && ctx.Err() == nil && onError != nil {
			onError(err)
		}
	}
}
