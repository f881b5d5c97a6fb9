package pgtx_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// terminate ends the server session behind tx from another connection, as
// an administrator, a failover or a crashed server would, and waits until
// it is gone.
func (f *fixture) terminate(t testing.TB, tx pgx.Tx) {
	t.Helper()
	var gone bool
	if err := f.pool.QueryRow(context.Background(), `SELECT pg_terminate_backend($1, 10000)`, tx.Conn().PgConn().PID()).Scan(&gone); err != nil || !gone {
		t.Errorf("pg_terminate_backend = %v, %v", gone, err)
	}
}

// terminateAfterBegin begins each transaction on the real pool, then
// terminates its session before the key's claim can run.
type terminateAfterBegin struct {
	*pgxpool.Pool
	f *fixture
	t testing.TB
}

func (d terminateAfterBegin) BeginTx(ctx context.Context, o pgx.TxOptions) (pgx.Tx, error) {
	tx, err := d.Pool.BeginTx(ctx, o)
	if err == nil {
		d.f.terminate(d.t, tx)
	}
	return tx, err
}

// A failure of the database around the transaction is no fault of the
// message: Handle marks it consumer.Unavailable, so the runtime waits
// without using up an attempt. Each case runs against the real server:
// the session terminated before the claim, while the function runs, and
// before the COMMIT (TestUnreachableDatabaseIsCountedAsStoreError: nothing
// listening). The retry, once the database
// answers, commits the effect once.
func TestDatabaseFailureIsUnavailable(t *testing.T) {
	t.Run("terminated before the claim", func(t *testing.T) {
		f := newFixture(t)
		f.handler(t, f.insertEffect) // the schema
		h, err := pgtx.New(terminateAfterBegin{f.pool, f, t}, f.insertEffect, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
		if err != nil {
			t.Fatal(err)
		}
		err = h.Handle(context.Background(), msg("m", "a"))
		if !consumer.IsUnavailable(err) {
			t.Fatalf("Handle with its session terminated before the claim = %v, want it marked unavailable", err)
		}
		if n := f.claimStoreErrors(t); n != 1 {
			t.Fatalf("store errors (claim) = %d, want 1", n)
		}
		if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
			t.Fatal("a transaction whose session was terminated left rows behind")
		}
	})
	for _, tc := range []struct {
		name string
		// more: the function runs another statement after its session was
		// terminated; without, the COMMIT finds out.
		more bool
	}{
		{"terminated while the function runs", true},
		{"terminated before the commit", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			first := true
			h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				if err := f.insertEffect(ctx, tx, m); err != nil {
					return err
				}
				if !first {
					return nil
				}
				first = false
				f.terminate(t, tx)
				if tc.more {
					_, err := tx.Exec(ctx, `SELECT 1`)
					return err
				}
				return nil
			})
			ctx := context.Background()
			err := h.Handle(ctx, msg("m", "a"))
			if !consumer.IsUnavailable(err) {
				t.Fatalf("Handle with its session terminated = %v, want it marked unavailable", err)
			}
			if f.rows(t, f.effects) != 0 {
				t.Fatal("the effect of a terminated session was committed")
			}
			if err := h.Handle(ctx, msg("m", "a")); err != nil {
				t.Fatalf("retry = %v, want nil", err)
			}
			if n := f.rows(t, f.effects); n != 1 {
				t.Fatalf("%d effect rows after the retry, want 1", n)
			}
		})
	}
}

// The function's own errors reach the runtime as they are, counted as the
// message's attempts: a plain error, a failed statement of its own (even
// one about a missing table, which in the handler's own claim would be an
// outage), a statement timeout, and a network error from something other
// than the database (an HTTP call, say). None of them is an outage of the
// transaction's database.
func TestFunctionErrorsPassThroughUnchanged(t *testing.T) {
	f := newFixture(t)
	boom := errors.New("boom")
	_, dialErr := net.Dial("tcp", "127.0.0.1:1") // nothing listens there: a real "connection refused"
	if dialErr == nil {
		t.Fatal("something listens on 127.0.0.1:1")
	}
	cases := []struct {
		name string
		fn   pgtx.Func
		want func(error) bool
	}{
		{"plain error", func(context.Context, pgx.Tx, *consumer.Message) error { return boom },
			func(err error) bool { return err == boom }},
		{"own statement fails", func(ctx context.Context, tx pgx.Tx, _ *consumer.Message) error {
			_, err := tx.Exec(ctx, `INSERT INTO custody_no_such_table VALUES (1)`)
			return err
		}, func(err error) bool { var pe *pgconn.PgError; return errors.As(err, &pe) && pe.Code == "42P01" }},
		{"statement timeout", func(ctx context.Context, tx pgx.Tx, _ *consumer.Message) error {
			if _, err := tx.Exec(ctx, `SET LOCAL statement_timeout = 10`); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT pg_sleep(5)`)
			return err
		}, func(err error) bool { var pe *pgconn.PgError; return errors.As(err, &pe) && pe.Code == "57014" }},
		{"another service's network error", func(context.Context, pgx.Tx, *consumer.Message) error {
			return fmt.Errorf("calling the payment provider: %w", dialErr)
		}, func(err error) bool { return errors.Is(err, dialErr) }},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := f.handler(t, c.fn)
			err := h.Handle(context.Background(), msg(fmt.Sprint("m-", i), "a"))
			if consumer.IsUnavailable(err) || !c.want(err) {
				t.Fatalf("Handle = %v, want the function's error unchanged, not marked unavailable", err)
			}
		})
	}
	if n := f.claimStoreErrors(t); n != 0 {
		t.Fatalf("store errors (claim) = %d for the function's own errors, want 0", n)
	}
}

// An outage of the database under a stream of valid messages, through the
// runtime on the memory broker with a dead-letter queue: no message is
// dead-lettered or redelivered (Message.Attempt stays 1) however far past
// MaxAttempts its transactions fail, and every effect commits once when the
// database is back.
func TestDatabaseOutageDeadLettersNothing(t *testing.T) {
	const (
		n           = 20
		maxAttempts = 3
	)
	f := newFixture(t)
	f.handler(t, f.insertEffect) // the schema, through the direct pool
	pool, link := teststores.PostgresVia(t)
	var (
		mu       sync.Mutex
		attempts []int
	)
	h, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, m.Attempt)
		mu.Unlock()
		return f.insertEffect(ctx, tx, m)
	}, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
	if err != nil {
		t.Fatal(err)
	}
	link.Cut()

	b := memory.NewBroker()
	for _, q := range []string{"q", "dlq"} {
		if err := b.CreateQueue(q, memory.QueueOptions{Lease: time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		if err := b.Publish(context.Background(), "q", memory.Message{ID: fmt.Sprintf("pay-%d", i), Body: []byte("a")}); err != nil {
			t.Fatal(err)
		}
	}
	dlq, err := b.DeadLetterQueue("dlq")
	if err != nil {
		t.Fatal(err)
	}
	src, err := b.Source("q", memory.WithPollWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(src, h, consumer.WithConcurrency(4), consumer.WithDeadLetter(dlq),
		consumer.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()

	deadLettered := func() int {
		s, err := b.Stats("dlq")
		if err != nil {
			t.Fatal(err)
		}
		return s.Visible
	}
	end := time.Now().Add(30 * time.Second)
	for deadLettered() == 0 && f.claimStoreErrors(t) < 2*n*maxAttempts {
		if time.Now().After(end) {
			t.Fatalf("only %d failed transactions in 30 s", f.claimStoreErrors(t))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if k := deadLettered(); k > 0 {
		t.Fatalf("%d of %d valid messages dead-lettered while the database was down", k, n)
	}

	link.Restore()
	wctx, wcancel := context.WithTimeout(context.Background(), time.Minute)
	defer wcancel()
	if err := b.WaitEmpty(wctx, "q"); err != nil {
		t.Fatalf("the queue did not drain once the database was back: %v", err)
	}
	if k := deadLettered(); k > 0 {
		t.Fatalf("%d of %d valid messages dead-lettered", k, n)
	}
	if rows := f.rows(t, f.effects); rows != n {
		t.Fatalf("%d effect rows for %d messages, want one each", rows, n)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, a := range attempts {
		if a != 1 {
			t.Fatalf("a function saw Attempt %d, want 1: the outage used up attempts", a)
		}
	}
	if s, _ := b.Stats("q"); s.Received != n {
		t.Fatalf("%d receives for %d messages, want each received once", s.Received, n)
	}
}
