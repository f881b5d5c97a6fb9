package pgtx_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/idempotency/pgtx"
	"github.com/custody-go/custody/internal/testkit/testbroker"
)

// fixture is a processed-keys table and an effects table of the test's own.
type fixture struct {
	pool      *pgxpool.Pool
	processed string
	effects   string
	reader    *sdkmetric.ManualReader
	mp        *sdkmetric.MeterProvider
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	pool := pgsql.TestPool(t)
	f := &fixture{
		pool:      pool,
		processed: pgsql.TestTable(t, pool, "custody_processed_test"),
		effects:   pgsql.TestTable(t, pool, "custody_effects_test"),
		reader:    sdkmetric.NewManualReader(),
	}
	f.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(f.reader))
	t.Cleanup(func() { _ = f.mp.Shutdown(context.Background()) })
	// No unique constraint: a duplicate effect must show as a second row.
	if _, err := pool.Exec(context.Background(), `CREATE TABLE `+f.effects+` (id bigserial PRIMARY KEY, message_id text NOT NULL, body text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return f
}

// insertEffect is the effect under test: one row per run.
func (f *fixture) insertEffect(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+f.effects+` (message_id, body) VALUES ($1, $2)`, m.ID, string(m.Body))
	return err
}

func (f *fixture) handler(t testing.TB, fn pgtx.Func, opts ...pgtx.Option) *pgtx.Handler {
	t.Helper()
	opts = append([]pgtx.Option{pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp)}, opts...)
	h, err := pgtx.New(f.pool, fn, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.CreateSchema(context.Background()); err != nil {
		t.Fatal(err)
	}
	return h
}

func (f *fixture) rows(t testing.TB, table string) int {
	t.Helper()
	var n int
	if err := f.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (f *fixture) duplicates(t testing.TB, kind string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := f.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != idempotency.MetricDuplicates {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, _ := dp.Attributes.Value("custody.duplicate.kind"); v.AsString() == kind {
					n += dp.Value
				}
			}
		}
	}
	return n
}

func msg(id, body string) *consumer.Message {
	return &consumer.Message{ID: id, Body: []byte(body), Attempt: 1, Partition: -1, Offset: -1}
}

func TestEffectAndKeyCommitTogetherAndDuplicateIsSkipped(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int32
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		runs.Add(1)
		return f.insertEffect(ctx, tx, m)
	})
	ctx := context.Background()
	for range 3 {
		if err := h.Handle(ctx, msg("m-1", "a")); err != nil {
			t.Fatal(err)
		}
	}
	if runs.Load() != 1 || f.rows(t, f.effects) != 1 || f.rows(t, f.processed) != 1 {
		t.Fatalf("runs %d, effect rows %d, key rows %d; want 1, 1, 1", runs.Load(), f.rows(t, f.effects), f.rows(t, f.processed))
	}
	if got := f.duplicates(t, "sequential"); got != 2 {
		t.Fatalf("sequential duplicates %d, want 2", got)
	}
}

func TestFailedEffectRollsBackWithItsKey(t *testing.T) {
	f := newFixture(t)
	boom := errors.New("boom")
	var runs atomic.Int32
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := f.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		if runs.Add(1) == 1 {
			return boom // after the write: it must be rolled back
		}
		return nil
	})
	ctx := context.Background()
	if err := h.Handle(ctx, msg("m", "a")); !errors.Is(err, boom) {
		t.Fatalf("Handle = %v, want the function's error", err)
	}
	if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
		t.Fatalf("after a failure: %d effect rows, %d key rows; want 0 and 0", f.rows(t, f.effects), f.rows(t, f.processed))
	}
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 2 || f.rows(t, f.effects) != 1 {
		t.Fatalf("retry: runs %d, effect rows %d; want 2 and 1", runs.Load(), f.rows(t, f.effects))
	}
}

func TestPanicRollsBack(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := f.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		panic("bug")
	})
	func() {
		defer func() { _ = recover() }()
		_ = h.Handle(context.Background(), msg("m", "a"))
	}()
	if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
		t.Fatalf("after a panic: %d effect rows, %d key rows; want 0 and 0", f.rows(t, f.effects), f.rows(t, f.processed))
	}
	var idle int
	// The connection went back to the pool without an open transaction.
	err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction' AND query LIKE '%`+f.effects+`%'`).Scan(&idle)
	if err != nil || idle != 0 {
		t.Fatalf("%d connections idle in transaction after a panic (%v)", idle, err)
	}
}

func TestOverlappingDuplicateIsTurnedAwayWithoutWaiting(t *testing.T) {
	f := newFixture(t)
	entered, leave := make(chan struct{}), make(chan struct{})
	var runs atomic.Int32
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if runs.Add(1) == 1 {
			close(entered)
			<-leave
		}
		return f.insertEffect(ctx, tx, m)
	}, pgtx.WithOverlapRetryDelay(3*time.Second))
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { first <- h.Handle(ctx, msg("m", "a")) }()
	// The first copy's transaction must end even when an assertion below
	// fails: the pool's Close, in the fixture's cleanup, waits for it.
	var once sync.Once
	release := func() { once.Do(func() { close(leave) }) }
	t.Cleanup(release)
	select {
	case <-entered:
	case err := <-first:
		t.Fatalf("the first copy returned %v before its effect ran", err)
	}

	// Bounded so that a version that waits on the lock fails instead of
	// hanging until the first transaction ends.
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err := h.Handle(tctx, msg("m", "a"))
	cancel()
	if !errors.Is(err, idempotency.ErrInProgressElsewhere) || !consumer.IsDeferred(err) || func() bool { d, ok := consumer.RetryDelay(err); return !ok || d != 3*time.Second }() {
		t.Fatalf("overlapping duplicate = %v, want Defer(ErrInProgressElsewhere, 3s)", err)
	}
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatal(err)
	}
	if runs.Load() != 1 || f.rows(t, f.effects) != 1 || f.duplicates(t, "overlapping") != 1 || f.duplicates(t, "sequential") != 1 {
		t.Fatalf("runs %d, effects %d, overlapping %d, sequential %d; want 1, 1, 1, 1",
			runs.Load(), f.rows(t, f.effects), f.duplicates(t, "overlapping"), f.duplicates(t, "sequential"))
	}
}

func TestFingerprintMismatchIsPermanent(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect, pgtx.WithFingerprint(idempotency.FingerprintBody))
	ctx := context.Background()
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatalf("same payload = %v, want skipped", err)
	}
	err := h.Handle(ctx, msg("m", "b"))
	if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrFingerprintMismatch) {
		t.Fatalf("other payload = %v, want a permanent ErrFingerprintMismatch", err)
	}
	if f.rows(t, f.effects) != 1 {
		t.Fatalf("%d effect rows, want 1", f.rows(t, f.effects))
	}
	if got := f.count(t, idempotency.MetricFingerprintMismatches, "", ""); got != 1 {
		t.Fatalf("fingerprint mismatches counted %d, want 1", got)
	}
}

func TestMessageWithoutKeyIsPermanent(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect)
	err := h.Handle(context.Background(), msg("", "a"))
	if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrNoKey) {
		t.Fatalf("keyless message = %v, want a permanent ErrNoKey", err)
	}
	if f.rows(t, f.effects) != 0 {
		t.Fatal("the effect ran for a keyless message")
	}
}

func TestCleanupDeletesOldKeysInBatches(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect)
	ctx := context.Background()
	for i := range 12 {
		if err := h.Handle(ctx, msg(string(rune('a'+i)), "x")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.pool.Exec(ctx, `UPDATE `+f.processed+` SET processed_at = now() - interval '2 hours' WHERE key < 'k'`); err != nil {
		t.Fatal(err)
	}
	n, err := h.Cleanup(ctx, time.Hour, 4)
	if err != nil || n != 10 {
		t.Fatalf("Cleanup = %d, %v; want the 10 old keys", n, err)
	}
	if f.rows(t, f.processed) != 2 {
		t.Fatalf("%d keys left, want 2", f.rows(t, f.processed))
	}
}

func TestInvalidOptionsFailNamingTheOption(t *testing.T) {
	pool := pgsql.TestPool(t)
	fn := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	cases := map[string]pgtx.Option{
		"WithTable":             pgtx.WithTable("bad name"),
		"WithKeyFunc":           pgtx.WithKeyFunc(nil),
		"WithFingerprint":       pgtx.WithFingerprint(nil),
		"WithTxOptions":         pgtx.WithTxOptions(pgx.TxOptions{AccessMode: pgx.ReadOnly}),
		"WithOverlapRetryDelay": pgtx.WithOverlapRetryDelay(0),
		"WithMeterProvider":     pgtx.WithMeterProvider(nil),
	}
	for name, opt := range cases {
		if _, err := pgtx.New(pool, fn, opt); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("invalid %s: %v, want an error naming it", name, err)
		}
	}
	if _, err := pgtx.New(pool, nil); err == nil {
		t.Error("New with a nil func succeeded")
	}
}

// Keys PostgreSQL cannot store (binary Kafka keys, say) fail the same way on
// every attempt: they must fail at once, permanently, without running the
// effect, rather than be retried until MaxAttempts with a database error.
func TestUnstorableKeyIsPermanent(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect)
	for _, key := range []string{"bin\xff\xfe", "nul\x00key", strings.Repeat("k", 3000)} {
		err := h.Handle(context.Background(), msg(key, "a"))
		if !consumer.IsPermanent(err) || !errors.Is(err, idempotency.ErrUnstorableKey) {
			t.Errorf("key %.20q: %v, want a permanent ErrUnstorableKey", key, err)
		}
	}
	if f.rows(t, f.effects) != 0 {
		t.Fatal("the effect ran for a key that cannot be recorded")
	}
}

// A copy of an already committed key is a sequential duplicate (skipped and
// acked) even while another copy's transaction holds the key's advisory
// lock: counting it as overlapping and deferring it misreported the cause
// and brought the message back for nothing.
func TestCommittedKeyIsSequentialWhileAnotherCopyHoldsTheLock(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect)
	ctx := context.Background()
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatal(err)
	}
	// Other copies' transactions, between taking the lock and finding the
	// row: hold the advisory locks the handler takes for "m" and for "n",
	// which was never committed.
	other, err := f.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	for _, key := range []string{"m", "n"} {
		if _, err := other.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended(($1::text::regclass)::oid::text || ':' || $2, 0))`, f.processed, key); err != nil {
			t.Fatal(err)
		}
	}
	// The lock is the handler's: a copy of the uncommitted key overlaps.
	if err := h.Handle(ctx, msg("n", "a")); !errors.Is(err, idempotency.ErrInProgressElsewhere) {
		t.Fatalf("copy of a key whose lock is held = %v, want ErrInProgressElsewhere (does the test take the handler's lock?)", err)
	}
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatalf("copy of a committed key = %v, want nil (skipped)", err)
	}
	if f.duplicates(t, "sequential") != 1 || f.duplicates(t, "overlapping") != 1 || f.rows(t, f.effects) != 1 {
		t.Fatalf("sequential %d, overlapping %d, effects %d; want 1, 1 (the uncommitted key), 1",
			f.duplicates(t, "sequential"), f.duplicates(t, "overlapping"), f.rows(t, f.effects))
	}
}

// Transaction options PostgreSQL refuses fail every delivery at BEGIN (or,
// read-only however spelled, at the claim), so each message would be retried
// to the dead-letter queue: New must refuse them, naming the option.
func TestTxOptionsThatCannotWorkFailAtNew(t *testing.T) {
	pool := pgsql.TestPool(t)
	fn := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	for _, o := range []pgx.TxOptions{
		{IsoLevel: "repeatable-read"},
		{AccessMode: "READ ONLY"},
		{DeferrableMode: "later"},
	} {
		if _, err := pgtx.New(pool, fn, pgtx.WithTxOptions(o)); err == nil || !strings.Contains(err.Error(), "WithTxOptions") {
			t.Errorf("WithTxOptions(%+v) = %v, want an error naming the option", o, err)
		}
	}
	for _, o := range []pgx.TxOptions{
		{},
		{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadWrite, DeferrableMode: pgx.NotDeferrable},
		{IsoLevel: pgx.RepeatableRead},
		{IsoLevel: pgx.ReadCommitted},
		{IsoLevel: pgx.ReadUncommitted, DeferrableMode: pgx.Deferrable},
	} {
		if _, err := pgtx.New(pool, fn, pgtx.WithTxOptions(o)); err != nil {
			t.Errorf("WithTxOptions(%+v) = %v, want accepted", o, err)
		}
	}
}

// count returns the value of counter name for the attribute key=value.
func (f *fixture) count(t testing.TB, name, key, value string) int64 {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := f.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
				if v, _ := dp.Attributes.Value(attribute.Key(key)); v.AsString() == value {
					n += dp.Value
				}
			}
		}
	}
	return n
}

// cancelAfterBegin begins each transaction on the real pool, then ends the
// delivery's context, as a shutdown deadline does that passes just as the
// key is being claimed.
type cancelAfterBegin struct {
	*pgxpool.Pool
	cancel context.CancelFunc
}

func (d cancelAfterBegin) BeginTx(ctx context.Context, o pgx.TxOptions) (pgx.Tx, error) {
	tx, err := d.Pool.BeginTx(ctx, o)
	d.cancel()
	return tx, err
}

func (f *fixture) claimStoreErrors(t testing.TB) int64 {
	t.Helper()
	return f.count(t, idempotency.MetricStoreErrors, "custody.idempotency.op", "claim")
}

// A database that cannot be reached fails the delivery at BEGIN, before the
// claim statement, as unavailable: the message is not at fault. Operators
// must see it in store_errors, as they do with the middleware's stores.
func TestUnreachableDatabaseIsCountedAsStoreError(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	// Nothing listens on port 1: every BEGIN fails to connect.
	down, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=5")
	if err != nil {
		t.Fatal(err)
	}
	defer down.Close()
	h, err := pgtx.New(down, f.insertEffect, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("m", "a")); !consumer.IsUnavailable(err) {
		t.Fatalf("Handle against an unreachable database = %v, want it marked unavailable (the message waits, using up no attempt)", err)
	}
	if n := f.claimStoreErrors(t); n != 1 {
		t.Fatalf("store errors (claim) = %d after BEGIN failed on an unreachable database, want 1", n)
	}
}

// A delivery whose own context ended while it claimed its key (the
// shutdown deadline, a lost broker lease) is not the database's fault: the
// middleware does not count it as a store error, and neither may pgtx, or
// every deploy raises the store alert.
func TestCancelledDeliveryIsNoStoreError(t *testing.T) {
	f := newFixture(t)
	f.handler(t, f.insertEffect) // creates the processed table
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h, err := pgtx.New(cancelAfterBegin{f.pool, cancel}, f.insertEffect, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Handle(ctx, msg("m", "a")); !errors.Is(err, context.Canceled) {
		t.Fatalf("Handle with its context ended during the claim = %v, want context.Canceled", err)
	}
	if n := f.claimStoreErrors(t); n != 0 {
		t.Fatalf("store errors (claim) = %d after a delivery's own context ended, want 0", n)
	}
	if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
		t.Fatal("a cancelled claim left rows behind")
	}
}

// With WithName, the duplicates and refusals carry the consumer's name as
// custody.consumer, as the runtime's metrics do.
func TestMetricsCarryTheConsumerName(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, f.insertEffect, pgtx.WithName("orders"))
	ctx := context.Background()
	for range 2 {
		if err := h.Handle(ctx, msg("m-1", "a")); err != nil {
			t.Fatal(err)
		}
	}
	_ = h.Handle(ctx, msg("", "no key"))
	if got := f.count(t, idempotency.MetricDuplicates, "custody.consumer", "orders"); got != 1 {
		t.Errorf("duplicates named orders = %d, want 1", got)
	}
	if got := f.count(t, idempotency.MetricMissingKeys, "custody.consumer", "orders"); got != 1 {
		t.Errorf("missing keys named orders = %d, want 1", got)
	}
}

// TestOverlapIsSeenWhateverTheTableIsCalled: two handlers that name the same
// processed table differently ("t" and "public.t": two services, or two
// versions of one) must still see each other's copies of a key as
// overlapping. The advisory lock was taken on a hash of the name as written,
// so the second copy did not see the first's lock, waited on its row lock
// until it committed, and then skipped as a sequential duplicate.
func TestOverlapIsSeenWhateverTheTableIsCalled(t *testing.T) {
	f := newFixture(t)
	entered, leave := make(chan struct{}), make(chan struct{})
	first := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		close(entered)
		<-leave
		return f.insertEffect(ctx, tx, m)
	})
	second := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		t.Error("the second copy ran while the first was in flight")
		return f.insertEffect(ctx, tx, m)
	}, pgtx.WithTable("public."+f.processed))
	ctx := context.Background()
	firstDone := make(chan error, 1)
	go func() { firstDone <- first.Handle(ctx, msg("m", "a")) }()
	<-entered

	// The first copy stays in flight until the second returns, or 10 s
	// (a version that waits on the row lock then finishes as sequential).
	secondDone := make(chan error, 1)
	go func() { secondDone <- second.Handle(ctx, msg("m", "a")) }()
	var err error
	select {
	case err = <-secondDone:
		close(leave)
	case <-time.After(10 * time.Second):
		close(leave)
		err = <-secondDone
	}
	if !errors.Is(err, idempotency.ErrInProgressElsewhere) {
		t.Errorf("the copy under the other table name returned %v while the first was in flight, want ErrInProgressElsewhere", err)
	}
	if err := <-firstDone; err != nil {
		t.Fatal(err)
	}
	if n := f.rows(t, f.effects); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
}

// Turning fingerprints on for a table that already holds keys recorded
// without one: a copy of such a key is a sequential duplicate, skipped as
// before, not a mismatch sent to the dead-letter queue. The old record has
// no fingerprint to compare with.
func TestKeyRecordedWithoutFingerprintIsSkippedOnceFingerprintsAreOn(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	if err := f.handler(t, f.insertEffect).Handle(ctx, msg("m", "a")); err != nil {
		t.Fatal(err)
	}
	h := f.handler(t, f.insertEffect, pgtx.WithFingerprint(idempotency.FingerprintBody))
	if err := h.Handle(ctx, msg("m", "a")); err != nil {
		t.Fatalf("copy of a key recorded without a fingerprint = %v, want nil (skipped)", err)
	}
	if f.rows(t, f.effects) != 1 || f.duplicates(t, "sequential") != 1 {
		t.Fatalf("effects %d, sequential %d; want 1 and 1", f.rows(t, f.effects), f.duplicates(t, "sequential"))
	}
}

// commitCutter is a TCP proxy in front of the test database that, while
// armed, breaks the connection that sends COMMIT: before the COMMIT reaches
// the server (dropSent) or after the server answered it, dropping the
// answer (dropReply). Either way the client cannot tell what happened.
type commitCutter struct {
	ln        net.Listener
	server    string
	armed     atomic.Bool
	dropReply bool
	cuts      atomic.Int32
	wg        sync.WaitGroup
}

func newCommitCutter(t *testing.T, dropReply bool) (*commitCutter, *pgxpool.Pool) {
	t.Helper()
	pgsql.TestPool(t) // skips when the database is unreachable
	u, err := url.Parse(testbroker.Addr(pgsql.URLEnv, "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &commitCutter{ln: ln, server: u.Host, dropReply: dropReply}
	if _, _, err := net.SplitHostPort(c.server); err != nil {
		c.server = net.JoinHostPort(c.server, "5432")
	}
	c.wg.Go(c.accept)
	u.Host = ln.Addr().String()
	pool, err := pgxpool.New(context.Background(), u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		ln.Close()
		c.wg.Wait()
	})
	return c, pool
}

func (c *commitCutter) accept() {
	for {
		client, err := c.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", c.server)
		if err != nil {
			client.Close()
			continue
		}
		var cut atomic.Bool // COMMIT seen: the next answer is dropped
		closeBoth := func() { client.Close(); server.Close() }
		c.wg.Go(func() {
			defer closeBoth()
			buf := make([]byte, 64<<10)
			for {
				n, err := client.Read(buf)
				if err != nil {
					return
				}
				if c.armed.Load() && bytes.Contains(buf[:n], []byte("commit\x00")) {
					c.cuts.Add(1)
					if !c.dropReply {
						return // the COMMIT never reaches the server
					}
					cut.Store(true)
				}
				if _, err := server.Write(buf[:n]); err != nil {
					return
				}
			}
		})
		c.wg.Go(func() {
			defer closeBoth()
			buf := make([]byte, 64<<10)
			for {
				n, err := server.Read(buf)
				if err != nil || cut.Load() {
					return // the server answered the COMMIT: drop the answer
				}
				if _, err := client.Write(buf[:n]); err != nil {
					return
				}
			}
		})
	}
}

// A COMMIT whose outcome the handler cannot know (the connection broke
// before it reached the server, or after the server committed and before
// the answer came back) fails the delivery, never acks it; the retry then
// runs the effect if it was not committed and skips it if it was, so the
// effect is committed exactly once either way.
func TestCommitWithUnknownOutcomeIsRetriedExactlyOnce(t *testing.T) {
	for _, tc := range []struct {
		name       string
		dropReply  bool
		sequential int64
	}{
		{"lost before the server", false, 0},
		{"answer lost after the commit", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			cutter, pool := newCommitCutter(t, tc.dropReply)
			f.handler(t, func(context.Context, pgx.Tx, *consumer.Message) error { return nil }) // the schema
			var runs atomic.Int32
			h, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
				runs.Add(1)
				return f.insertEffect(ctx, tx, m)
			}, pgtx.WithTable(f.processed), pgtx.WithMeterProvider(f.mp))
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			cutter.armed.Store(true)
			if err := h.Handle(ctx, msg("pay-1", "a")); !consumer.IsUnavailable(err) {
				t.Fatalf("Handle for a COMMIT whose answer never came = %v, want it marked unavailable (never nil: the message would be acked unknowing)", err)
			}
			cutter.armed.Store(false)
			if cutter.cuts.Load() != 1 {
				t.Fatalf("%d COMMITs cut, want 1", cutter.cuts.Load())
			}
			// The redelivery, until the first transaction has ended on the
			// server (it may be deferred while the server notices).
			end := time.Now().Add(30 * time.Second)
			for {
				err = h.Handle(ctx, msg("pay-1", "a"))
				if err == nil || !consumer.IsDeferred(err) || time.Now().After(end) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			if err != nil {
				t.Fatalf("redelivery = %v, want nil", err)
			}
			if n := f.rows(t, f.effects); n != 1 || f.rows(t, f.processed) != 1 {
				t.Fatalf("effect rows %d, key rows %d after the redelivery; want exactly 1 each", n, f.rows(t, f.processed))
			}
			if got := f.duplicates(t, "sequential"); got != tc.sequential {
				t.Fatalf("sequential duplicates %d, want %d (runs %d)", got, tc.sequential, runs.Load())
			}
		})
	}
}

// A function that swallows a failed statement's error and returns nil
// leaves an aborted transaction, which cannot commit. That is the
// function's failure, counted as an attempt: marked unavailable, as the
// rollback at COMMIT was before, the message would wait for ever instead
// of being retried and, in the end, dead-lettered.
func TestAbortedTransactionIsTheFunctionsFailure(t *testing.T) {
	f := newFixture(t)
	h := f.handler(t, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := f.insertEffect(ctx, tx, m); err != nil {
			return err
		}
		_, _ = tx.Exec(ctx, `INSERT INTO custody_no_such_table VALUES (1)`) // error ignored
		return nil
	})
	err := h.Handle(context.Background(), msg("m", "a"))
	if err == nil || consumer.IsUnavailable(err) || !strings.Contains(err.Error(), "savepoint") {
		t.Fatalf("Handle = %v, want the function's failure, saying the transaction was aborted", err)
	}
	if f.rows(t, f.effects) != 0 || f.rows(t, f.processed) != 0 {
		t.Fatal("an aborted transaction left rows behind")
	}
}
