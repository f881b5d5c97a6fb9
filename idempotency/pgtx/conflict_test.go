package pgtx_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// lostUpdate is two messages that each add one to a shared counter, read
// then written, under SERIALIZABLE. Each transaction's first run waits, after
// its read, until the other has read too, so that they always overlap and
// PostgreSQL aborts one of them with a serialization failure.
type lostUpdate struct {
	f       *fixture
	counter string
	read    sync.WaitGroup
	runs    sync.Map // message ID -> *atomic.Int32
}

func newLostUpdate(t *testing.T) *lostUpdate {
	f := newFixture(t)
	u := &lostUpdate{f: f, counter: pgsql.TestTable(t, f.pool, "custody_counter_test")}
	ctx := context.Background()
	if _, err := f.pool.Exec(ctx, `CREATE TABLE `+u.counter+` (id int PRIMARY KEY, n int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	if _, err := f.pool.Exec(ctx, `INSERT INTO `+u.counter+` VALUES (1, 0)`); err != nil {
		t.Fatal(err)
	}
	u.read.Add(2)
	return u
}

func (u *lostUpdate) increment(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	runs, _ := u.runs.LoadOrStore(m.ID, new(atomic.Int32))
	var n int
	if err := tx.QueryRow(ctx, `SELECT n FROM `+u.counter+` WHERE id = 1`).Scan(&n); err != nil {
		return err
	}
	if runs.(*atomic.Int32).Add(1) == 1 {
		u.read.Done()
		both := make(chan struct{})
		go func() { u.read.Wait(); close(both) }()
		select {
		case <-both:
		case <-time.After(30 * time.Second):
			return errors.New("the other transaction never read the counter")
		}
	}
	_, err := tx.Exec(ctx, `UPDATE `+u.counter+` SET n = $1 WHERE id = 1`, n+1)
	return err
}

// handleBoth runs both messages through h at once and returns their errors.
func (u *lostUpdate) handleBoth(h *pgtx.Handler) []error {
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errs[i] = h.Handle(ctx, msg(fmt.Sprintf("m%d", i), "+1"))
		})
	}
	wg.Wait()
	return errs
}

func (u *lostUpdate) value(t *testing.T) int {
	t.Helper()
	var n int
	if err := u.f.pool.QueryRow(context.Background(), `SELECT n FROM `+u.counter+` WHERE id = 1`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

var serializable = pgtx.WithTxOptions(pgx.TxOptions{IsoLevel: pgx.Serializable})

func TestSerializationFailureRunsTheTransactionAgain(t *testing.T) {
	u := newLostUpdate(t)
	h := u.f.handler(t, u.increment, serializable)
	for i, err := range u.handleBoth(h) {
		if err != nil {
			t.Errorf("message %d: Handle = %v, want nil: a serialization failure is not the message's fault", i, err)
		}
	}
	if n := u.value(t); n != 2 {
		t.Errorf("counter = %d, want 2 (each message's effect once)", n)
	}
	if n := u.f.rows(t, u.f.processed); n != 2 {
		t.Errorf("%d keys recorded, want 2", n)
	}
	if n := u.f.count(t, pgtx.MetricConflictRetries, "custody.consumer", ""); n < 1 {
		t.Errorf("%s = %d, want at least 1", pgtx.MetricConflictRetries, n)
	}
	if n := u.f.claimStoreErrors(t); n != 0 {
		t.Errorf("%d store errors counted, want none: a conflict is not the database failing", n)
	}
}

// Without retries the same workload fails one message: what the test above
// would see if Handle did not run the transaction again.
func TestSerializationFailureWithoutRetriesGoesToTheRuntime(t *testing.T) {
	u := newLostUpdate(t)
	h := u.f.handler(t, u.increment, serializable, pgtx.WithConflictRetries(0))
	failed := 0
	for _, err := range u.handleBoth(h) {
		if err == nil {
			continue
		}
		failed++
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "40001" {
			t.Errorf("Handle = %v, want the serialization failure (40001)", err)
		}
	}
	if failed != 1 {
		t.Errorf("%d messages failed, want 1", failed)
	}
	if n := u.value(t); n != 1 {
		t.Errorf("counter = %d, want 1 (the failed message rolled back)", n)
	}
}

func TestConflictRetriesAreBounded(t *testing.T) {
	f := newFixture(t)
	for _, tc := range []struct {
		name     string
		err      error
		retries  int
		wantRuns int32
	}{
		{"serialization failure", &pgconn.PgError{Code: "40001"}, 2, 3},
		{"deadlock", fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: "40P01"}), 1, 2},
		{"permanent", consumer.Permanent(&pgconn.PgError{Code: "40001"}), 3, 1},
		{"other error", &pgconn.PgError{Code: "23505"}, 3, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs atomic.Int32
			h := f.handler(t, func(context.Context, pgx.Tx, *consumer.Message) error {
				runs.Add(1)
				return tc.err
			}, pgtx.WithConflictRetries(tc.retries))
			err := h.Handle(context.Background(), msg("k-"+tc.name, "x"))
			if !errors.Is(err, tc.err) {
				t.Errorf("Handle = %v, want the function's error %v", err, tc.err)
			}
			if got := runs.Load(); got != tc.wantRuns {
				t.Errorf("function ran %d times, want %d", got, tc.wantRuns)
			}
		})
	}
	if n := f.rows(t, f.processed); n != 0 {
		t.Errorf("%d keys recorded, want none: every run rolled back", n)
	}
}

func TestConflictPauseEndsWithTheDelivery(t *testing.T) {
	f := newFixture(t)
	ctx, cancel := context.WithCancel(context.Background())
	var runs atomic.Int32
	h := f.handler(t, func(context.Context, pgx.Tx, *consumer.Message) error {
		runs.Add(1)
		cancel() // the delivery ends while the conflict's pause is under way
		return &pgconn.PgError{Code: "40001"}
	}, pgtx.WithConflictRetries(100))
	if err := h.Handle(ctx, msg("k", "x")); err == nil {
		t.Fatal("Handle = nil, want the conflict")
	}
	if got := runs.Load(); got != 1 {
		t.Errorf("function ran %d times, want 1: no run after the delivery's context ended", got)
	}
}

func TestConflictRetriesOutOfRangeFailAtNew(t *testing.T) {
	pool := pgsql.TestPool(t)
	fn := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	for _, n := range []int{-1, 101} {
		if _, err := pgtx.New(pool, fn, pgtx.WithConflictRetries(n)); err == nil || !strings.Contains(err.Error(), "WithConflictRetries") {
			t.Errorf("WithConflictRetries(%d): New = %v, want an error naming the option", n, err)
		}
	}
}
