package pgtx

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/idempotency"
	"github.com/custody-go/custody/idempotency/internal/dupmetrics"
	"github.com/custody-go/custody/idempotency/internal/pgsql"
	"github.com/custody-go/custody/internal/backoff"
	"github.com/custody-go/custody/internal/option"
)

// MetricConflictRetries counts transactions run again after a
// serialization failure or a deadlock (see WithConflictRetries), with
// custody.consumer when given WithName.
const MetricConflictRetries = "custody.idempotency.conflict_retries"

// DefaultTable is the processed-keys table unless WithTable says otherwise.
const DefaultTable = "custody_processed"

// DB is what the handler needs from pgx; *pgxpool.Pool satisfies it.
type DB interface {
	BeginTx(ctx context.Context, opts pgx.TxOptions) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Func performs a message's effect through tx. It must not commit or roll
// back tx, and should make no change outside it that must happen once (see
// the package documentation).
type Func func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error

// Handler is a consumer.Handler that runs a Func exactly once per key within
// a PostgreSQL transaction.
type Handler struct {
	base
	fn Func
}

// base is what Handler and BatchHandler share: the database, the options,
// the metrics and the statements.
type base struct {
	db        DB
	cfg       config
	m         *dupmetrics.Set
	conflicts metric.Int64Counter

	claimSQL, fingerprintSQL, cleanupSQL string

	claimBatchSQL, fingerprintsSQL, unclaimSQL string
}

var _ consumer.Handler = (*Handler)(nil)

// Option configures a Handler.
type Option func(*config) error

type config struct {
	table        pgsql.Table
	keyFunc      func(*consumer.Message) string
	fingerprint  func(*consumer.Message) string
	txOptions    pgx.TxOptions
	overlapDelay time.Duration
	conflictRuns int
	meter        metric.MeterProvider
	name         string
}

// WithTable names the processed-keys table ("name" or "schema.name").
// Default DefaultTable ("custody_processed").
func WithTable(name string) Option {
	return func(c *config) error {
		t, err := pgsql.ParseTable(name)
		if err != nil {
			return fmt.Errorf("pgtx: WithTable(%q): %w", name, err)
		}
		c.table = t
		return nil
	}
}

// WithKeyFunc sets how the key is read from a message. Default
// idempotency.MessageID; an empty key fails the message with a permanent
// idempotency.ErrNoKey.
func WithKeyFunc(f func(*consumer.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("pgtx: WithKeyFunc(nil): pass a function or leave the option out")
		}
		c.keyFunc = f
		return nil
	}
}

// WithFingerprint stores a payload summary with each key; a duplicate whose
// fingerprint differs fails with a permanent
// idempotency.ErrFingerprintMismatch. Default: none.
func WithFingerprint(f func(*consumer.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return errors.New("pgtx: WithFingerprint(nil): pass a function such as idempotency.FingerprintBody, or leave the option out")
		}
		c.fingerprint = f
		return nil
	}
}

// WithTxOptions sets the transaction's isolation level and access mode.
// Default: the database's default (READ COMMITTED unless configured).
// Serialization failures under stricter levels are run again at once (see
// WithConflictRetries). IsoLevel, AccessMode and DeferrableMode
// must be empty or one of pgx's constants, and AccessMode not pgx.ReadOnly.
func WithTxOptions(o pgx.TxOptions) Option {
	return func(c *config) error {
		// pgx writes these values into BEGIN as they are, so one PostgreSQL
		// refuses (or a read-only mode spelled another way) would fail every
		// delivery, each retried until dead-lettered: refuse it here.
		switch o.IsoLevel {
		case "", pgx.Serializable, pgx.RepeatableRead, pgx.ReadCommitted, pgx.ReadUncommitted:
		default:
			return fmt.Errorf("pgtx: WithTxOptions: unknown IsoLevel %q; use one of pgx's TxIsoLevel constants", o.IsoLevel)
		}
		switch o.AccessMode {
		case "", pgx.ReadWrite:
		case pgx.ReadOnly:
			return errors.New("pgtx: WithTxOptions: a read-only transaction cannot record processed keys")
		default:
			return fmt.Errorf("pgtx: WithTxOptions: unknown AccessMode %q; use pgx.ReadWrite or leave it empty", o.AccessMode)
		}
		switch o.DeferrableMode {
		case "", pgx.Deferrable, pgx.NotDeferrable:
		default:
			return fmt.Errorf("pgtx: WithTxOptions: unknown DeferrableMode %q; use one of pgx's TxDeferrableMode constants", o.DeferrableMode)
		}
		c.txOptions = o
		return nil
	}
}

// WithConflictRetries sets how many times a transaction that PostgreSQL
// aborted with a serialization failure (SQLSTATE 40001) or a deadlock
// (40P01) is run again, key claim and function both, before Handle returns
// the error (see the package documentation, section Conflicts). Returned
// at once, such an abort would use up one of the runtime's attempts and,
// under contention, could dead-letter a good message. The function must be
// safe to run again, which it is if every change it makes goes through tx.
// An error marked consumer.Permanent is never run again. Default 3; 0 turns
// this off; at most 100.
func WithConflictRetries(n int) Option {
	return func(c *config) error {
		if n < 0 || n > maxConflictRetries {
			return fmt.Errorf("pgtx: WithConflictRetries(%d): must be between 0 and %d", n, maxConflictRetries)
		}
		c.conflictRuns = n
		return nil
	}
}

const maxConflictRetries = 100

// conflictPause spaces the runs of a conflicting transaction: long enough
// for the transaction it conflicted with to finish, short and randomized so
// that two that keep colliding fall out of step.
var conflictPause = backoff.Exponential{Initial: 5 * time.Millisecond, Max: 200 * time.Millisecond, Multiplier: 2, Jitter: 0.5}

// WithOverlapRetryDelay sets how long an overlapping duplicate waits before
// it is tried again. Default 1s. Must be positive.
func WithOverlapRetryDelay(d time.Duration) Option {
	return func(c *config) error {
		if d <= 0 {
			return fmt.Errorf("pgtx: WithOverlapRetryDelay(%v): must be positive", d)
		}
		c.overlapDelay = d
		return nil
	}
}

// WithName sets the custody.consumer attribute of the helper's metrics, so
// that they join the consumer's own: pass the name given to
// consumer.WithName (or the adapter's default, such as "kafka:orders").
// Default none: the attribute is left out.
func WithName(name string) Option {
	return func(c *config) error {
		c.name = name
		return nil
	}
}

// WithMeterProvider sets where duplicates are counted (the same metric names
// as the idempotency middleware; a failed BEGIN, claim statement or
// fingerprint read counts as a store error with op "claim"), and
// transactions run again after a conflict (MetricConflictRetries). Default
// otel.GetMeterProvider().
func WithMeterProvider(mp metric.MeterProvider) Option {
	return func(c *config) error {
		if mp == nil {
			return errors.New("pgtx: WithMeterProvider(nil): pass a provider or leave the option out")
		}
		c.meter = mp
		return nil
	}
}

// New returns a Handler that runs fn for each message inside a transaction
// on db. It does not touch the database: call CreateSchema, or apply DDL
// with your migrations, first.
func New(db DB, fn Func, opts ...Option) (*Handler, error) {
	if fn == nil {
		return nil, errors.New("pgtx: New(nil func): pass the function that performs the effect")
	}
	b, err := newBase("New", db, opts)
	if err != nil {
		return nil, err
	}
	return &Handler{base: *b, fn: fn}, nil
}

// newBase checks the database and the options given to the constructor
// name, and builds what Handler and BatchHandler share.
func newBase(name string, db DB, opts []Option) (*base, error) {
	if db == nil {
		return nil, fmt.Errorf("pgtx: %s(nil db): pass a *pgxpool.Pool", name)
	}
	c := config{keyFunc: idempotency.MessageID, overlapDelay: time.Second, conflictRuns: 3}
	c.table, _ = pgsql.ParseTable(DefaultTable)
	if err := option.Apply(&c, opts); err != nil {
		return nil, err
	}
	if c.meter == nil {
		c.meter = otel.GetMeterProvider()
	}
	const scope = "github.com/custody-go/custody/idempotency/pgtx"
	m, err := dupmetrics.New(c.meter, scope, c.name)
	if err != nil {
		return nil, fmt.Errorf("pgtx: creating metrics: %w", err)
	}
	conflicts, err := c.meter.Meter(scope).Int64Counter(MetricConflictRetries,
		metric.WithDescription("Transactions run again after PostgreSQL aborted them with a serialization failure or a deadlock."),
		metric.WithUnit("{transaction}"))
	if err != nil {
		return nil, fmt.Errorf("pgtx: creating metrics: %w", err)
	}
	b := &base{db: db, cfg: c, m: m, conflicts: conflicts}
	b.prepareSQL()
	return b, nil
}

func (h *base) prepareSQL() {
	t := h.cfg.table.Quoted
	// The advisory lock (on a hash of table and key, released at commit or
	// rollback) tells a concurrent transaction for the same key apart from
	// a committed row without waiting on the row lock. Only when it is held
	// is the key inserted; a conflict then can only be a committed row.
	// When another transaction holds it, a committed row still makes this a
	// sequential duplicate (the holder is one too): done says so.
	// The table is identified by its OID, as the INSERT resolves it, not
	// by its name as written: handlers that call one table "t" and
	// "public.t" must take the same lock.
	h.claimSQL = `WITH lock AS MATERIALIZED (
    SELECT pg_try_advisory_xact_lock(hashtextextended(($3::text::regclass)::oid::text || ':' || $1, 0)) AS held
), ins AS (
    INSERT INTO ` + t + ` (key, fingerprint)
    SELECT $1, $2 FROM lock WHERE lock.held
    ON CONFLICT (key) DO NOTHING
    RETURNING true
)
SELECT lock.held, EXISTS (SELECT FROM ins),
    NOT lock.held AND EXISTS (SELECT FROM ` + t + ` WHERE key = $1)
FROM lock`
	h.fingerprintSQL = `SELECT fingerprint FROM ` + t + ` WHERE key = $1`
	h.cleanupSQL = `DELETE FROM ` + t + `
WHERE key IN (
    SELECT key FROM ` + t + `
    WHERE processed_at < now() - $1::float8 * interval '1 millisecond'
    ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)`

	h.prepareBatchSQL()
}

// Handle implements consumer.Handler.
func (h *Handler) Handle(ctx context.Context, m *consumer.Message) error {
	key, fp, err := h.keyOf(ctx, m)
	if err != nil {
		return err
	}
	for run := 1; ; run++ {
		err := h.handleOnce(ctx, m, key, fp)
		if !h.runAgain(ctx, run, err) {
			return err
		}
	}
}

// keyOf reads m's key and fingerprint, or fails m, permanently, when it has
// no key PostgreSQL can store.
func (h *base) keyOf(ctx context.Context, m *consumer.Message) (key, fp string, err error) {
	if key = h.cfg.keyFunc(m); key == "" {
		h.m.MissingKeys.Add(ctx, 1, h.m.Plain)
		return "", "", consumer.Permanent(idempotency.ErrNoKey)
	}
	if h.cfg.fingerprint != nil {
		fp = h.cfg.fingerprint(m)
	}
	if err := pgsql.CheckText(key, fp); err != nil {
		return "", "", consumer.Permanent(fmt.Errorf("pgtx: %w", err))
	}
	return key, fp, nil
}

// runAgain reports whether a transaction that failed with err on its run
// is to be run again, a conflict, after the pause it waits for.
func (h *base) runAgain(ctx context.Context, run int, err error) bool {
	if run > h.cfg.conflictRuns || !isConflict(err) || consumer.IsPermanent(err) {
		return false
	}
	h.conflicts.Add(ctx, 1, h.m.Plain)
	t := time.NewTimer(conflictPause.Delay(run))
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		t.Stop()
		return false
	}
}

// isConflict reports whether err is PostgreSQL aborting a transaction for
// overlapping with another one, rather than for anything it did.
func isConflict(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "40001" || pe.Code == "40P01")
}

// handleOnce runs one transaction for m.
func (h *Handler) handleOnce(ctx context.Context, m *consumer.Message, key, fp string) error {
	tx, err := h.db.BeginTx(ctx, h.cfg.txOptions)
	if err != nil {
		// BEGIN is where an unreachable database shows first.
		return h.ownFailures(ctx, 1, fmt.Errorf("pgtx: begin transaction for key %q: %w", key, err))
	}
	defer rollback(ctx, tx)

	var held, inserted, done bool
	if err := tx.QueryRow(ctx, h.claimSQL, key, fp, h.cfg.table.Quoted).Scan(&held, &inserted, &done); err != nil {
		return h.ownFailures(ctx, 1, fmt.Errorf("pgtx: record key %q: %w", key, err))
	}
	if !held && !done {
		return h.overlapping(ctx, key)
	}
	if !inserted {
		if fp != "" {
			var old string
			if err := tx.QueryRow(ctx, h.fingerprintSQL, key).Scan(&old); err != nil {
				return h.ownFailures(ctx, 1, fmt.Errorf("pgtx: read fingerprint of key %q: %w", key, err))
			}
			if old != "" && old != fp {
				return h.mismatch(ctx, key, "")
			}
		}
		h.m.Duplicates.Add(ctx, 1, h.m.Sequential)
		return nil
	}

	if err := h.fn(ctx, tx, m); err != nil || aborted(tx) {
		return funcError(ctx, tx, err, fmt.Sprintf("key %q", key))
	}
	if err := tx.Commit(ctx); err != nil {
		// If the commit did happen and only its reply was lost, the
		// retry finds the key and is skipped.
		return ownStatementError(ctx, fmt.Errorf("pgtx: commit key %q: %w", key, err))
	}
	return nil
}

// rollback ends tx unless it committed (a no-op then), on a context of its
// own: the delivery's may be done. Deferred, it also runs on a panic in the
// function.
func rollback(ctx context.Context, tx pgx.Tx) {
	rctx, done := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer done()
	_ = tx.Rollback(rctx)
}

// ownFailures is what a failed BEGIN, claim or fingerprint read of a
// transaction of n keys returns: the error marked consumer.Unavailable when
// the database failed (see ownStatementFailed), and counted as n store
// errors with op "claim", as the middleware counts failed Claims. A
// conflict is left to be run again, and a delivery whose own context ended
// is none of the database's doing: neither is counted or marked.
func (h *base) ownFailures(ctx context.Context, n int, err error) error {
	if ctx.Err() != nil || isConflict(err) {
		return err
	}
	h.m.StoreErrors.Add(ctx, int64(n), h.m.OpClaim)
	if ownStatementFailed(err) {
		return consumer.Unavailable(err)
	}
	return err
}

// DDL returns the statements CreateSchema runs, for a migration tool.
func (h *base) DDL() []string {
	t := h.cfg.table
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.Quoted + ` (
    key          text        PRIMARY KEY,
    fingerprint  text        NOT NULL DEFAULT '',
    processed_at timestamptz NOT NULL DEFAULT now()
)`,
		`CREATE INDEX IF NOT EXISTS ` + t.Index("processed_at_idx") + ` ON ` + t.Quoted + ` (processed_at)`,
	}
}

// CreateSchema creates the processed-keys table and its index if they do not
// exist.
func (h *base) CreateSchema(ctx context.Context) error {
	for _, q := range h.DDL() {
		if _, err := h.db.Exec(ctx, q); err != nil {
			return fmt.Errorf("pgtx: create schema: %w", err)
		}
	}
	return nil
}

// Cleanup deletes keys processed more than retention ago, batch rows per
// statement, and returns how many it deleted. A message redelivered after
// its key was deleted is processed again: keep retention longer than the
// broker can redeliver.
func (h *base) Cleanup(ctx context.Context, retention time.Duration, batch int) (int64, error) {
	if retention <= 0 {
		return 0, fmt.Errorf("pgtx: Cleanup retention %v: must be positive", retention)
	}
	if batch < 1 {
		return 0, fmt.Errorf("pgtx: Cleanup batch %d: must be at least 1", batch)
	}
	var total int64
	for {
		tag, err := h.db.Exec(ctx, h.cleanupSQL, float64(retention)/float64(time.Millisecond), batch)
		if err != nil {
			return total, fmt.Errorf("pgtx: cleanup: %w", err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(batch) {
			return total, nil
		}
	}
}

// overlapping counts an overlapping duplicate of key and returns its
// outcome.
func (h *base) overlapping(ctx context.Context, key string) error {
	h.m.Duplicates.Add(ctx, 1, h.m.Overlapping)
	return consumer.Defer(fmt.Errorf("%w (key %q)", idempotency.ErrInProgressElsewhere, key), h.cfg.overlapDelay)
}

// mismatch counts a fingerprint mismatch of key and returns its outcome;
// more is added to the key in the error.
func (h *base) mismatch(ctx context.Context, key, more string) error {
	h.m.Mismatches.Add(ctx, 1, h.m.Plain)
	return consumer.Permanent(fmt.Errorf("%w (key %q%s)", idempotency.ErrFingerprintMismatch, key, more))
}
