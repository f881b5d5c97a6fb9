package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/internal/teststores"
	"github.com/custody-go/custody/idempotency/pgstore"
	"github.com/custody-go/custody/idempotency/storetest"
)

func newStore(t testing.TB, pool *pgxpool.Pool) (*pgstore.Store, string) {
	t.Helper()
	table := pgsql.TestTable(t, pool, "custody_idem_test")
	return teststores.PostgresOn(t, pool, table), table
}

func TestContract(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idempotency.Store { return teststores.Postgres(t) })
}

func TestBatchContract(t *testing.T) {
	storetest.RunBatch(t, func(t *testing.T) idempotency.BatchStore { return teststores.Postgres(t).(idempotency.BatchStore) })
}

func TestCreateSchemaIsRepeatable(t *testing.T) {
	pool := pgsql.TestPool(t)
	_, table := newStore(t, pool)
	if err := pgstore.CreateSchema(context.Background(), pool, pgstore.WithTable(table)); err != nil {
		t.Fatalf("second CreateSchema: %v", err)
	}
}

// New fails when the table is missing, and says how to create it, rather
// than hand out a store on which every message would wait.
func TestNewChecksTheTable(t *testing.T) {
	ctx := context.Background()
	pool := pgsql.TestPool(t)
	table := pgsql.TestTable(t, pool, "custody_idem_test")
	_, err := pgstore.New(ctx, pool, pgstore.WithTable(table))
	if err == nil || !strings.Contains(err.Error(), "does not exist") || !strings.Contains(err.Error(), "pgstore.CreateSchema") {
		t.Fatalf("New on a missing table = %v, want an error saying to call CreateSchema", err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+table+" (key text PRIMARY KEY, value text)"); err != nil {
		t.Fatal(err)
	}
	_, err = pgstore.New(ctx, pool, pgstore.WithTable(table))
	if err == nil || !strings.Contains(err.Error(), "lacks the store's columns") {
		t.Fatalf("New on another table of the same name = %v, want an error saying so", err)
	}
}

// New fails when PostgreSQL does not answer, saying what to check.
func TestNewChecksThatPostgresAnswers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=10") // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	_, err = pgstore.New(ctx, pool)
	if err == nil || !strings.Contains(err.Error(), "does not answer") || !strings.Contains(err.Error(), "check the connection string") {
		t.Fatalf("New with an unreachable PostgreSQL = %v, want an error saying it does not answer and what to check", err)
	}
}

// DDL returns what CreateSchema runs, for the table the options name.
func TestDDLNamesTheTable(t *testing.T) {
	ddl, err := pgstore.DDL(pgstore.WithTable("billing.keys"))
	if err != nil {
		t.Fatal(err)
	}
	if len(ddl) != 2 || !strings.Contains(ddl[0], `CREATE TABLE IF NOT EXISTS "billing"."keys"`) || !strings.Contains(ddl[1], `"keys_expires_at_idx"`) {
		t.Fatalf("DDL = %q", ddl)
	}
	if _, err := pgstore.DDL(pgstore.WithTable("a.b.c")); err == nil || !strings.Contains(err.Error(), "WithTable") {
		t.Fatalf("DDL with a bad table name = %v, want an error naming the option", err)
	}
}

func TestCleanupDeletesExpiredRowsInBatches(t *testing.T) {
	ctx := context.Background()
	pool := pgsql.TestPool(t)
	s, table := newStore(t, pool)

	// 25 completed records with a short retention, 5 expired claims, and
	// records that must stay: a live claim and a completed one kept long.
	for i := range 30 {
		key := "expired-" + string(rune('a'+i))
		_, tok, err := s.Claim(ctx, key, "", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if i < 25 {
			err = s.Complete(ctx, key, tok, time.Millisecond)
		} else {
			err = s.Extend(ctx, key, tok, time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	_, live, _ := s.Claim(ctx, "live-claim", "", time.Hour)
	_, kept, _ := s.Claim(ctx, "kept", "", time.Hour)
	if err := s.Complete(ctx, "kept", kept, time.Hour); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // longer than the short expiries

	n, err := s.Cleanup(ctx, 7)
	if err != nil {
		t.Fatalf("Cleanup: %v", err)
	}
	if n != 30 {
		t.Fatalf("Cleanup deleted %d rows, want the 30 expired ones", n)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 2 {
		t.Fatalf("%d rows left, want 2 (the live claim and the kept completion)", left)
	}
	if err := s.Complete(ctx, "live-claim", live, time.Hour); err != nil {
		t.Fatalf("the live claim did not survive cleanup: %v", err)
	}
	if st, _, _ := s.Claim(ctx, "kept", "", time.Hour); st != idempotency.Completed {
		t.Fatalf("kept = %v, want completed", st)
	}
	if _, err := s.Cleanup(ctx, 0); err == nil {
		t.Fatal("Cleanup with batch 0 succeeded")
	}
}

func TestRunCleanupStopsWithContext(t *testing.T) {
	pool := pgsql.TestPool(t)
	s, table := newStore(t, pool)
	ctx, cancel := context.WithCancel(context.Background())
	_, tok, _ := s.Claim(ctx, "k", "", time.Hour)
	_ = s.Complete(ctx, "k", tok, time.Millisecond)
	done := make(chan error, 1)
	go func() { done <- s.RunCleanup(ctx, 5*time.Millisecond, 100, func(err error) { t.Error(err) }) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		_ = pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n)
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("RunCleanup never deleted the expired row")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("RunCleanup = %v, want context.Canceled", err)
	}
}

func TestWithTableRejectsBadNames(t *testing.T) {
	ctx := context.Background()
	pool := pgsql.TestPool(t)
	for _, name := range []string{"", "a.b.c", "x; DROP TABLE y", "1abc", `a"b`} {
		_, err := pgstore.New(ctx, pool, pgstore.WithTable(name))
		if err == nil || !strings.Contains(err.Error(), "WithTable") {
			t.Errorf("WithTable(%q) = %v, want an error naming the option", name, err)
		}
	}
	table := "public." + pgsql.TestTable(t, pool, "custody_idem_test")
	if err := pgstore.CreateSchema(ctx, pool, pgstore.WithTable(table)); err != nil {
		t.Fatal(err)
	}
	if _, err := pgstore.New(ctx, pool, pgstore.WithTable(table)); err != nil {
		t.Errorf("WithTable(%s) = %v", table, err)
	}
}

func BenchmarkClaimComplete(b *testing.B) {
	pool := pgsql.TestPool(b)
	s, _ := newStore(b, pool)
	storetest.BenchmarkClaimComplete(b, s)
}

func BenchmarkClaimCompleteParallel(b *testing.B) {
	storetest.BenchmarkClaimCompleteParallel(b, teststores.Postgres(b), 8)
}

// A claim that waits on another transaction's insert of the same key finds,
// once that transaction commits, a live record its own snapshot cannot see:
// the statement returns no row at all. Claim must look again and report the
// record, not fail.
func TestClaimRacingAnUncommittedInsertSeesIt(t *testing.T) {
	ctx := context.Background()
	pool := pgsql.TestPool(t)
	s, table := newStore(t, pool)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (key, token, state, fingerprint, expires_at)
VALUES ('raced', 'other', 'completed', '', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}

	type result struct {
		state idempotency.State
		err   error
	}
	done := make(chan result, 1)
	go func() {
		st, _, err := s.Claim(ctx, "raced", "", time.Minute)
		done <- result{st, err}
	}()

	// Commit only once the claim waits on the insert's row lock, so that
	// its statement snapshot predates the record.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query LIKE 'WITH claimed AS%' AND strpos(query, $1) > 0)`, table).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the claim never waited on the uncommitted insert")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("Claim after the racing insert committed: %v", r.err)
	}
	if r.state != idempotency.Completed {
		t.Fatalf("Claim = %v, want Completed (the committed record)", r.state)
	}
}

// Keys PostgreSQL cannot store fail Claim with ErrUnstorableKey, which the
// middleware makes permanent, rather than with a database error it would
// retry until MaxAttempts; so do fingerprints (a raw hash, say).
func TestUnstorableKeysAreReported(t *testing.T) {
	s, _ := newStore(t, pgsql.TestPool(t))
	ctx := context.Background()
	for _, c := range []struct{ key, fp string }{
		{"bin\xff\xfe", ""}, {"nul\x00key", ""}, {strings.Repeat("k", 3000), ""}, {"k", "raw\xffhash"},
	} {
		if _, _, err := s.Claim(ctx, c.key, c.fp, time.Minute); !errors.Is(err, idempotency.ErrUnstorableKey) {
			t.Errorf("Claim(%.20q, %q) = %v, want ErrUnstorableKey", c.key, c.fp, err)
		}
	}
}

// In a batch, a key the store cannot hold fails alone: the statement that
// claims the others does not carry it, so PostgreSQL does not refuse them
// all for it.
func TestUnstorableKeyFailsAloneInABatch(t *testing.T) {
	s, _ := newStore(t, pgsql.TestPool(t))
	res := s.ClaimBatch(context.Background(), []idempotency.ClaimRequest{{Key: "good-1"}, {Key: "nul\x00key"}, {Key: "good-2"}}, time.Minute)
	if !errors.Is(res[1].Err, idempotency.ErrUnstorableKey) {
		t.Fatalf("ClaimBatch entry of a key with a NUL byte = %+v, want ErrUnstorableKey", res[1])
	}
	for _, i := range []int{0, 2} {
		if res[i].Err != nil || res[i].State != idempotency.Acquired {
			t.Fatalf("ClaimBatch entry %d beside an unstorable key = %+v, want acquired", i, res[i])
		}
	}
}

// The longest key the store promises to hold (pgsql.MaxKeyBytes) is claimed
// like any other: only longer ones are refused.
func TestLongestStorableKeyIsClaimed(t *testing.T) {
	s, _ := newStore(t, pgsql.TestPool(t))
	ctx := context.Background()
	// Random text, which PostgreSQL cannot compress to make it fit.
	var b strings.Builder
	for b.Len() < pgsql.MaxKeyBytes {
		fmt.Fprintf(&b, "%016x", rand.Uint64())
	}
	key := b.String()[:pgsql.MaxKeyBytes]
	state, tok, err := s.Claim(ctx, key, "", time.Minute)
	if err != nil || state != idempotency.Acquired {
		t.Fatalf("Claim of a %d-byte key = %v, %v; want Acquired", len(key), state, err)
	}
	if err := s.Complete(ctx, key, tok, time.Hour); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if state, _, err := s.Claim(ctx, key, "", time.Minute); err != nil || state != idempotency.Completed {
		t.Fatalf("Claim after Complete = %v, %v; want Completed", state, err)
	}
}
