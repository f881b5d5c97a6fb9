package pgtx

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/custody-go/custody/consumer"
)

// BatchFunc performs the effects of a batch's messages through tx: one
// multi-row INSERT, a COPY, one UPDATE ... FROM. It must not commit or roll
// back tx. b holds the messages whose keys are new, in the batch's order.
//
// Returning nil commits the transaction: every message of b is then done,
// but those the function failed with b.Fail, whose keys are taken out of
// the transaction and whose errors go to the runtime (to be retried or
// dead-lettered). A message it fails must therefore have no write of its
// own left in tx: check the messages before writing (and fail the bad ones
// with consumer.Permanent), or write a message that may fail inside a
// savepoint (tx.Begin) and roll that back. A failed statement aborts the
// whole transaction, savepoints aside; returning nil after one fails every
// message of b.
//
// Returning an error (or panicking) rolls the whole transaction back:
// every message of b fails with the error.
type BatchFunc func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error

// BatchHandler is a consumer.BatchHandler that runs a BatchFunc once per
// batch, in one PostgreSQL transaction with the processed-key rows of all
// the batch's messages, so that each message's effect commits exactly once
// (see NewBatch).
type BatchHandler struct {
	base
	fn BatchFunc
}

var _ consumer.BatchHandler = (*BatchHandler)(nil)

// NewBatch returns a BatchHandler that runs fn for each batch (see
// consumer.NewBatch) inside one transaction on db, with New's options and
// processed-keys table: a Handler and a BatchHandler given the same table
// deduplicate each other's messages. See the package documentation,
// section Batches, for what happens to each message, and for the lock
// table a batch's keys take.
func NewBatch(db DB, fn BatchFunc, opts ...Option) (*BatchHandler, error) {
	if fn == nil {
		return nil, errors.New("pgtx: NewBatch(nil func): pass the function that performs the batch's effects")
	}
	b, err := newBase("NewBatch", db, opts)
	if err != nil {
		return nil, err
	}
	return &BatchHandler{base: *b, fn: fn}, nil
}

func (h *base) prepareBatchSQL() {
	t := h.cfg.table.Quoted
	// claimSQL for many keys. The advisory locks are only tried, never
	// waited for, and a key is inserted only under its lock, so the INSERT
	// waits on no other transaction of this package and two batches
	// sharing keys cannot deadlock. It answers the keys whose lock another
	// transaction holds, the keys it inserted, and the keys of the first
	// kind already committed (a sequential duplicate, whichever delivery
	// holds the lock).
	h.claimBatchSQL = `WITH lock AS MATERIALIZED (
    SELECT key, fingerprint,
        pg_try_advisory_xact_lock(hashtextextended(($3::text::regclass)::oid::text || ':' || key, 0)) AS held
    FROM unnest($1::text[], $2::text[]) AS i(key, fingerprint)
), ins AS (
    INSERT INTO ` + t + ` (key, fingerprint)
    SELECT key, fingerprint FROM lock WHERE held
    ON CONFLICT (key) DO NOTHING
    RETURNING key
)
SELECT (SELECT coalesce(array_agg(key), '{}') FROM lock WHERE NOT held),
    (SELECT coalesce(array_agg(key), '{}') FROM ins),
    (SELECT coalesce(array_agg(key), '{}') FROM lock
     WHERE NOT held AND EXISTS (SELECT FROM ` + t + ` p WHERE p.key = lock.key))`
	h.fingerprintsSQL = `SELECT coalesce(array_agg(coalesce(p.fingerprint, '') ORDER BY i.ord), '{}')
FROM unnest($1::text[]) WITH ORDINALITY AS i(key, ord)
LEFT JOIN ` + t + ` p ON p.key = i.key`
	h.unclaimSQL = `DELETE FROM ` + t + ` WHERE key = ANY($1::text[])`
}

// What a batch's transaction found for a key.
type keyState int

const (
	stateUnknown     keyState = iota // the transaction failed before it could tell
	stateNew                         // recorded now: the message goes to the function
	stateCommitted                   // recorded before: a sequential duplicate
	stateOverlapping                 // held by another transaction: an overlapping duplicate
	stateMismatch                    // recorded before for another payload
)

// batchEntry is one message of a batch on its way through HandleBatch.
type batchEntry struct {
	m       *consumer.Message
	key, fp string
	first   int // the entry of the batch's first message with this key: its own for that one, -1 when the message has no usable key
	state   keyState
	result  error // what the function recorded for a new message (nil: done)
}

// HandleBatch implements consumer.BatchHandler.
func (h *BatchHandler) HandleBatch(ctx context.Context, b *consumer.Batch) error {
	es := make([]batchEntry, len(b.Messages))
	firsts := make(map[string]int, len(b.Messages))
	var claims []int // the entries whose keys the transaction records
	for i, m := range b.Messages {
		e := &es[i]
		e.m, e.first = m, -1
		var err error
		if e.key, e.fp, err = h.keyOf(ctx, m); err != nil {
			b.Fail(m, err)
			continue
		}
		if j, ok := firsts[e.key]; ok {
			e.first = j
			continue
		}
		e.first = i
		firsts[e.key] = i
		claims = append(claims, i)
	}
	if len(claims) == 0 {
		return nil
	}
	var err error
	for run := 1; ; run++ {
		err = h.runOnce(ctx, es, claims)
		if !h.runAgain(ctx, run, err) {
			break
		}
	}
	h.record(ctx, b, es, err)
	return nil
}

// runOnce runs one transaction for the entries claims, and records in each
// what it found. Its error is the transaction's: it fails the entries whose
// state is unknown or new.
func (h *BatchHandler) runOnce(ctx context.Context, es []batchEntry, claims []int) error {
	for _, i := range claims {
		es[i].state, es[i].result = stateUnknown, nil
	}
	n := len(claims)
	tx, err := h.db.BeginTx(ctx, h.cfg.txOptions)
	if err != nil {
		return h.ownFailures(ctx, n, fmt.Errorf("pgtx: begin transaction for a batch of %d keys: %w", n, err))
	}
	defer rollback(ctx, tx)

	keys := make([]string, n)
	fps := make([]string, n)
	for j, i := range claims {
		keys[j], fps[j] = es[i].key, es[i].fp
	}
	var busy, inserted, done []string
	if err := tx.QueryRow(ctx, h.claimBatchSQL, keys, fps, h.cfg.table.Quoted).Scan(&busy, &inserted, &done); err != nil {
		return h.ownFailures(ctx, n, fmt.Errorf("pgtx: record a batch of %d keys: %w", n, err))
	}
	found := make(map[string]keyState, len(inserted)+len(busy))
	for _, k := range inserted {
		found[k] = stateNew
	}
	for _, k := range busy {
		found[k] = stateOverlapping
	}
	for _, k := range done {
		found[k] = stateCommitted
	}
	var fresh, recorded []int // entries
	for _, i := range claims {
		switch found[es[i].key] {
		case stateNew:
			es[i].state = stateNew
			fresh = append(fresh, i)
		case stateOverlapping:
			es[i].state = stateOverlapping
		default: // locked here and not inserted, or committed while locked elsewhere
			es[i].state = stateCommitted
			if es[i].fp != "" {
				recorded = append(recorded, i)
			}
		}
	}
	if err := h.checkFingerprints(ctx, tx, es, recorded); err != nil {
		for _, i := range claims {
			es[i].state = stateUnknown
		}
		return h.ownFailures(ctx, n, err)
	}
	if len(fresh) == 0 {
		return nil // nothing to commit
	}

	msgs := make([]*consumer.Message, len(fresh))
	for j, i := range fresh {
		msgs[j] = es[i].m
	}
	sub := consumer.BatchOf(msgs)
	if err := h.fn(ctx, tx, sub); err != nil || aborted(tx) {
		return funcError(ctx, tx, err, fmt.Sprintf("a batch of %d keys", len(fresh)))
	}
	var failed []string
	for j, i := range fresh {
		if err, ok := sub.Result(msgs[j]); ok && err != nil {
			es[i].result = err
			failed = append(failed, es[i].key)
		}
	}
	if len(failed) > 0 {
		if _, err := tx.Exec(ctx, h.unclaimSQL, failed); err != nil {
			return ownStatementError(ctx, fmt.Errorf("pgtx: take the keys of %d failed messages out of the batch: %w", len(failed), err))
		}
	}
	if err := tx.Commit(ctx); err != nil {
		// If the commit did happen and only its reply was lost, the
		// retries find the keys and are skipped.
		return ownStatementError(ctx, fmt.Errorf("pgtx: commit a batch of %d keys: %w", len(fresh), err))
	}
	return nil
}

// checkFingerprints marks the entries recorded, whose keys were committed
// before, that were recorded for another payload.
func (h *BatchHandler) checkFingerprints(ctx context.Context, tx pgx.Tx, es []batchEntry, recorded []int) error {
	if len(recorded) == 0 {
		return nil
	}
	keys := make([]string, len(recorded))
	for j, i := range recorded {
		keys[j] = es[i].key
	}
	var old []string
	err := tx.QueryRow(ctx, h.fingerprintsSQL, keys).Scan(&old)
	if err == nil && len(old) != len(keys) {
		err = fmt.Errorf("the statement answered %d keys of %d", len(old), len(keys))
	}
	if err != nil {
		return fmt.Errorf("pgtx: read the fingerprints of %d keys: %w", len(keys), err)
	}
	for j, i := range recorded {
		if old[j] != "" && old[j] != es[i].fp {
			es[i].state = stateMismatch
		}
	}
	return nil
}

// record sets each message's outcome on b, given the last transaction's
// error, and counts the duplicates.
func (h *BatchHandler) record(ctx context.Context, b *consumer.Batch, es []batchEntry, txErr error) {
	for i := range es {
		e := &es[i]
		switch {
		case e.first < 0: // recorded already
		case e.first != i:
			h.recordDuplicate(ctx, b, e, &es[e.first], txErr)
		default:
			b.Fail(e.m, h.outcome(ctx, e, txErr))
		}
	}
}

// outcome is the outcome of the first message of its key.
func (h *BatchHandler) outcome(ctx context.Context, e *batchEntry, txErr error) error {
	switch e.state {
	case stateCommitted:
		h.m.Duplicates.Add(ctx, 1, h.m.Sequential)
		return nil
	case stateOverlapping:
		return h.overlapping(ctx, e.key)
	case stateMismatch:
		return h.mismatch(ctx, e.key, "")
	case stateNew:
		if txErr != nil {
			return txErr
		}
		return e.result
	}
	return txErr // stateUnknown
}

// recordDuplicate sets the outcome of e, a later message with the key of p.
func (h *BatchHandler) recordDuplicate(ctx context.Context, b *consumer.Batch, e, p *batchEntry, txErr error) {
	var err error
	switch {
	case e.fp != "" && p.fp != "" && e.fp != p.fp:
		err = h.mismatch(ctx, e.key, ", twice in one batch")
	case p.state == stateOverlapping, p.state == stateNew && (txErr != nil || p.result != nil):
		// Another transaction holds the key, or the first one's effect did
		// not commit (its retry or this one runs it): this one waits.
		err = h.overlapping(ctx, e.key)
	case p.state == stateNew || p.state == stateCommitted:
		h.m.Duplicates.Add(ctx, 1, h.m.Sequential)
	case p.state == stateMismatch:
		err = h.mismatch(ctx, e.key, "")
	default: // stateUnknown
		err = txErr
	}
	b.Fail(e.m, err)
}
