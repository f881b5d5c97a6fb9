package pgtx_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/pgtx"
)

// bulkInsert is the batch's effect under test: one row per message, all in
// one statement.
func (f *fixture) bulkInsert(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	ids := make([]string, len(msgs))
	bodies := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i], bodies[i] = m.ID, string(m.Body)
	}
	_, err := tx.Exec(ctx, `INSERT INTO `+f.effects+` (message_id, body) SELECT * FROM unnest($1::text[], $2::text[])`, ids, bodies)
	return err
}

// insertAll inserts every message of b and records nothing: a committed
// transaction makes them done.
func (f *fixture) insertAll(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
	return f.bulkInsert(ctx, tx, b.Messages)
}

func (f *fixture) batchHandler(t testing.TB, fn pgtx.BatchFunc, opts ...pgtx.Option) *pgtx.BatchHandler {
	t.Helper()
	opts = append([]pgtx.Option{pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp)}, opts...)
	h, err := pgtx.NewBatch(f.pool, fn, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.CreateSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return h
}

// effects returns how many effect rows each message id has.
func (f *fixture) effectsByID(t testing.TB) map[string]int {
	t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT message_id, count(*) FROM `+f.effects+` GROUP BY message_id`)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		byID[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return byID
}

func ids(msgs []*consumer.Message) []string {
	var s []string
	for _, m := range msgs {
		s = append(s, m.ID)
	}
	return s
}

// kind names what was recorded for m: "done", "none", or the kind of its
// error.
func kind(b *consumer.Batch, m *consumer.Message) string {
	err, ok := b.Result(m)
	switch {
	case !ok:
		return "none"
	case err == nil:
		return "done"
	case consumer.IsPermanent(err):
		return "permanent"
	case consumer.IsUnavailable(err):
		return "unavailable"
	case consumer.IsDeferred(err):
		return "deferred"
	}
	return "failed"
}

func batchOf(ids ...string) *consumer.Batch {
	msgs := make([]*consumer.Message, len(ids))
	for i, id := range ids {
		msgs[i] = msg(id, "body of "+id)
	}
	return consumer.BatchOf(msgs)
}

func wantKinds(t *testing.T, b *consumer.Batch, want ...string) {
	t.Helper()
	for i, m := range b.Messages {
		if got := kind(b, m); got != want[i] {
			t.Errorf("message %q: outcome %s, want %s", m.ID, got, want[i])
		}
	}
}

// A batch's effects and keys commit together, in one transaction: the
// function sees only the new messages, and a redelivered batch, or a
// message the single-message Handler already processed, is skipped.
func TestBatchEffectsCommitWithTheirKeys(t *testing.T) {
	f := newFixture(t)
	var seen [][]string
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		seen = append(seen, ids(b.Messages))
		return f.insertAll(ctx, tx, b)
	})
	ctx := context.Background()
	if err := f.handler(t, f.insertEffect).Handle(ctx, msg("m-2", "body of m-2")); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		b := batchOf("m-1", "m-2", "m-3")
		if err := h.HandleBatch(ctx, b); err != nil {
			t.Fatal(err)
		}
		wantKinds(t, b, "done", "done", "done")
	}
	if len(seen) != 1 || !slices.Equal(seen[0], []string{"m-1", "m-3"}) {
		t.Fatalf("the function saw %v, want [[m-1 m-3]]: a recorded key ran again", seen)
	}
	for id, n := range f.effectsByID(t) {
		if n != 1 {
			t.Errorf("%s has %d effect rows, want 1", id, n)
		}
	}
	if f.rows(t, f.effects) != 3 || f.rows(t, f.processed) != 3 {
		t.Fatalf("%d effect rows and %d keys, want 3 and 3", f.rows(t, f.effects), f.rows(t, f.processed))
	}
	if got := f.duplicates(t, "sequential"); got != 4 {
		t.Fatalf("sequential duplicates %d, want 4", got)
	}
}

// The messages the function fails keep no key: they are retried, and
// their retry runs the effect, once. The others of the batch commit; a
// message left without an outcome is done, since its transaction
// committed.
func TestBatchFailedMessagesKeepNoKey(t *testing.T) {
	f := newFixture(t)
	var calls atomic.Int32
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		first := calls.Add(1) == 1
		var good []*consumer.Message
		for _, m := range b.Messages {
			switch {
			case m.ID == "flaky" && first:
				b.Fail(m, errors.New("not yet"))
			case m.ID == "poison":
				b.Fail(m, consumer.Permanent(errors.New("cannot parse")))
			default:
				good = append(good, m)
				if m.ID != "unrecorded" {
					b.Done(m)
				}
			}
		}
		return f.bulkInsert(ctx, tx, good)
	})
	ctx := context.Background()
	b := batchOf("ok", "flaky", "poison", "unrecorded")
	if err := h.HandleBatch(ctx, b); err != nil {
		t.Fatal(err)
	}
	wantKinds(t, b, "done", "failed", "permanent", "done")
	retry := batchOf("flaky", "ok")
	if err := h.HandleBatch(ctx, retry); err != nil {
		t.Fatal(err)
	}
	wantKinds(t, retry, "done", "done")
	want := map[string]int{"ok": 1, "flaky": 1, "unrecorded": 1}
	if got := f.effectsByID(t); !equalCounts(got, want) {
		t.Fatalf("effect rows by message %v, want %v", got, want)
	}
	if n := f.rows(t, f.processed); n != 3 {
		t.Fatalf("%d keys recorded, want 3 (not the poison message's)", n)
	}
}

func equalCounts(a, b map[string]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// A function that fails (an error, a panic) rolls the whole transaction
// back, keys and effects: every new message fails with its error, and the
// duplicates of the batch keep their outcomes.
func TestBatchFunctionErrorRollsBackEverything(t *testing.T) {
	for _, how := range []string{"error", "panic"} {
		t.Run(how, func(t *testing.T) {
			f := newFixture(t)
			ctx := context.Background()
			if err := f.handler(t, f.insertEffect).Handle(ctx, msg("old", "x")); err != nil {
				t.Fatal(err)
			}
			boom := errors.New("bulk insert failed")
			h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
				if err := f.insertAll(ctx, tx, b); err != nil {
					return err
				}
				b.DoneAll()
				if how == "panic" {
					panic(boom)
				}
				return boom
			})
			b := batchOf("a", "old", "b")
			func() {
				defer func() {
					if p := recover(); p != nil && p != boom {
						panic(p)
					}
				}()
				if err := h.HandleBatch(ctx, b); err != nil {
					t.Fatalf("HandleBatch = %v, want the outcomes recorded per message", err)
				}
			}()
			if how == "error" {
				wantKinds(t, b, "failed", "done", "failed")
				if err, _ := b.Result(b.Messages[0]); !errors.Is(err, boom) {
					t.Fatalf("outcome %v, want the function's error", err)
				}
			}
			if f.rows(t, f.effects) != 1 || f.rows(t, f.processed) != 1 {
				t.Fatalf("%d effect rows and %d keys after a failed batch, want 1 and 1 (the earlier message's)", f.rows(t, f.effects), f.rows(t, f.processed))
			}
		})
	}
}

// Two messages of one batch with one key are one effect: the later one is
// done once the first one's effect commits, deferred when it does not, and
// refused when its payload differs.
func TestBatchDuplicateKeysInOneBatch(t *testing.T) {
	f := newFixture(t)
	var seen [][]string
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		seen = append(seen, ids(b.Messages))
		var good []*consumer.Message
		for _, m := range b.Messages {
			if m.ID == "b" {
				b.Fail(m, errors.New("not yet"))
				continue
			}
			good = append(good, m)
		}
		return f.bulkInsert(ctx, tx, good)
	}, pgtx.WithFingerprint(idempotency.FingerprintBody))
	b := consumer.BatchOf([]*consumer.Message{msg("a", "1"), msg("b", "1"), msg("a", "1"), msg("b", "1"), msg("a", "2")})
	if err := h.HandleBatch(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	if len(seen) != 1 || !slices.Equal(seen[0], []string{"a", "b"}) {
		t.Fatalf("the function saw %v, want [[a b]]", seen)
	}
	wantKinds(t, b, "done", "failed", "done", "deferred", "permanent")
	if err, _ := b.Result(b.Messages[4]); !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Fatalf("same key, other payload: %v, want ErrFingerprintMismatch", err)
	}
	if n := f.rows(t, f.effects); n != 1 {
		t.Fatalf("%d effect rows, want 1", n)
	}
}

// A key another transaction is processing right now is deferred as an
// overlapping duplicate without waiting for it; the batch's other messages
// commit.
func TestBatchOverlappingKeyIsDeferredWithoutWaiting(t *testing.T) {
	f := newFixture(t)
	// Made before the other transaction holds the table: CreateSchema's
	// CREATE INDEX IF NOT EXISTS would wait for it.
	h := f.batchHandler(t, f.insertAll, pgtx.WithOverlapRetryDelay(3*time.Second))
	entered, leave := make(chan struct{}), make(chan struct{})
	single := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		close(entered)
		<-leave
		return f.insertEffect(ctx, tx, m)
	})
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- single.Handle(ctx, msg("busy", "x")) }()
	var once sync.Once
	release := func() { once.Do(func() { close(leave) }) }
	t.Cleanup(release)
	<-entered

	b := batchOf("a", "busy", "b")
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second) // a version that waits fails instead of hanging
	err := h.HandleBatch(tctx, b)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	wantKinds(t, b, "done", "deferred", "done")
	if err, _ := b.Result(b.Messages[1]); !errors.Is(err, idempotency.ErrInProgressElsewhere) || func() bool { d, _ := consumer.RetryDelay(err); return d != 3*time.Second }() {
		t.Fatalf("overlapping key: %v, want Defer(ErrInProgressElsewhere, 3s)", err)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if f.rows(t, f.effects) != 3 || f.duplicates(t, "overlapping") != 1 {
		t.Fatalf("%d effect rows, %d overlapping duplicates; want 3 and 1", f.rows(t, f.effects), f.duplicates(t, "overlapping"))
	}
}

// A function that swallows a failed statement's error and returns nil
// leaves an aborted transaction, which cannot commit: the batch fails with
// an error saying so, as the function's own failure (not an outage, which
// would make the messages wait for ever), and nothing commits.
func TestBatchAbortedTransactionIsTheFunctionsFailure(t *testing.T) {
	f := newFixture(t)
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		if err := f.insertAll(ctx, tx, b); err != nil {
			return err
		}
		_, _ = tx.Exec(ctx, `INSERT INTO custody_no_such_table VALUES (1)`) // error ignored
		return nil
	})
	b := batchOf("a", "b")
	if err := h.HandleBatch(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	wantKinds(t, b, "failed", "failed")
	if err, _ := b.Result(b.Messages[0]); err == nil || !strings.Contains(err.Error(), "savepoint") {
		t.Fatalf("outcome %v, want an error saying the transaction was aborted", err)
	}
	if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
		t.Fatal("an aborted batch left rows behind")
	}
}

// Messages without a key, or with one PostgreSQL cannot store, fail
// permanently before the transaction; the rest of the batch commits.
func TestBatchKeylessAndUnstorableKeysArePermanent(t *testing.T) {
	f := newFixture(t)
	var seen []string
	h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		seen = ids(b.Messages)
		return f.insertAll(ctx, tx, b)
	})
	b := batchOf("a", "", "nul\x00key", "b")
	if err := h.HandleBatch(context.Background(), b); err != nil {
		t.Fatal(err)
	}
	wantKinds(t, b, "done", "permanent", "permanent", "done")
	if err, _ := b.Result(b.Messages[1]); !errors.Is(err, idempotency.ErrNoKey) {
		t.Errorf("keyless: %v, want ErrNoKey", err)
	}
	if err, _ := b.Result(b.Messages[2]); !errors.Is(err, idempotency.ErrUnstorableKey) {
		t.Errorf("NUL in the key: %v, want ErrUnstorableKey", err)
	}
	if !slices.Equal(seen, []string{"a", "b"}) {
		t.Fatalf("the function saw %v, want [a b]", seen)
	}
}

// A failure of the database around the function marks the new messages
// unavailable (they wait, using up no attempt), and the retry commits each
// effect once: the session terminated while the function runs, and before
// the commit; and a database that cannot be reached, counted as a store
// error for each message.
func TestBatchDatabaseFailureIsUnavailable(t *testing.T) {
	for _, more := range []bool{true, false} {
		t.Run(fmt.Sprintf("statement after termination=%v", more), func(t *testing.T) {
			f := newFixture(t)
			first := true
			h := f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
				if err := f.insertAll(ctx, tx, b); err != nil {
					return err
				}
				if !first {
					return nil
				}
				first = false
				f.terminate(t, tx)
				if more {
					_, err := tx.Exec(ctx, `SELECT 1`)
					return err
				}
				return nil
			})
			ctx := context.Background()
			b := batchOf("a", "b")
			if err := h.HandleBatch(ctx, b); err != nil {
				t.Fatal(err)
			}
			wantKinds(t, b, "unavailable", "unavailable")
			if f.rows(t, f.effects) != 0 {
				t.Fatal("the effects of a terminated session were committed")
			}
			retry := batchOf("a", "b")
			if err := h.HandleBatch(ctx, retry); err != nil {
				t.Fatal(err)
			}
			wantKinds(t, retry, "done", "done")
			if n := f.rows(t, f.effects); n != 2 {
				t.Fatalf("%d effect rows after the retry, want 2", n)
			}
		})
	}
	t.Run("unreachable", func(t *testing.T) {
		f := newFixture(t)
		ctx := context.Background()
		down, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=5")
		if err != nil {
			t.Fatal(err)
		}
		defer down.Close()
		h, err := pgtx.NewBatch(down, f.insertAll, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
		if err != nil {
			t.Fatal(err)
		}
		b := batchOf("a", "b", "c")
		if err := h.HandleBatch(ctx, b); err != nil {
			t.Fatal(err)
		}
		wantKinds(t, b, "unavailable", "unavailable", "unavailable")
		if n := f.claimStoreErrors(t); n != 3 {
			t.Fatalf("store errors (claim) = %d for a batch of 3 against an unreachable database, want 3", n)
		}
	})
}

// Two batches that each add their messages to one counter, read then
// written, under SERIALIZABLE, forced to overlap: PostgreSQL aborts one,
// and the whole transaction runs again, so both batches' effects commit.
func TestBatchSerializationFailureRunsTheTransactionAgain(t *testing.T) {
	u := newLostUpdate(t)
	h := u.f.batchHandler(t, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
		return u.increment(ctx, tx, b.Messages[0])
	}, serializable)
	var wg sync.WaitGroup
	batches := []*consumer.Batch{batchOf("m0"), batchOf("m1")}
	for _, b := range batches {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := h.HandleBatch(ctx, b); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for _, b := range batches {
		wantKinds(t, b, "done")
	}
	if n := u.value(t); n != 2 {
		t.Errorf("counter = %d, want 2", n)
	}
	if n := u.f.count(t, pgtx.MetricConflictRetries, "custody.consumer", ""); n < 1 {
		t.Errorf("%s = %d, want at least 1", pgtx.MetricConflictRetries, n)
	}
}

func TestNewBatchRefusesNilArguments(t *testing.T) {
	f := newFixture(t)
	if _, err := pgtx.NewBatch(nil, f.insertAll); err == nil || !strings.Contains(err.Error(), "NewBatch(nil db)") {
		t.Errorf("NewBatch(nil db) = %v", err)
	}
	if _, err := pgtx.NewBatch(f.pool, nil); err == nil || !strings.Contains(err.Error(), "NewBatch(nil func)") {
		t.Errorf("NewBatch(nil func) = %v", err)
	}
	if _, err := pgtx.NewBatch(f.pool, f.insertAll, pgtx.WithConflictRetries(-1)); err == nil || !strings.Contains(err.Error(), "WithConflictRetries") {
		t.Errorf("NewBatch with a bad option = %v", err)
	}
}
