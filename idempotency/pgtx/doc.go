// Package pgtx runs a message's database effect exactly once: the effect and
// the record that the message was processed commit in one PostgreSQL
// transaction, and the runtime acks the message only after that commit.
//
// # Use
//
//	h, err := pgtx.New(pool, func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
//		_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, $2)`, ...)
//		return err
//	})
//	err = h.CreateSchema(ctx) // or apply h.DDL() with your migrations
//	c, err := consumer.New(src, h)
//
// # How it works
//
// For each delivery the handler reads the key (an empty one fails with a
// permanent idempotency.ErrNoKey; one PostgreSQL cannot store, such as
// invalid UTF-8, a NUL byte or more than 2,600 bytes, with a permanent
// idempotency.ErrUnstorableKey), begins a transaction and, first, inserts
// the message's key into the processed table (custody_processed by default).
// Then:
//
//   - The key was inserted: the function runs inside the same transaction.
//     If it returns nil the transaction commits, and only then does Handle
//     return nil so that the runtime acks. If it returns an error (or
//     panics), the transaction rolls back, the key row with it, and the
//     error goes to the runtime to retry or dead-letter (marked
//     consumer.Unavailable when the database failed under it: see below).
//   - The key was already there, committed: the message was processed
//     before (a sequential duplicate), even if another delivery of the key
//     holds its lock right now. The transaction rolls back, the function
//     does not run, and Handle returns nil, so the message is acked. With
//     WithFingerprint, a committed key recorded for another payload fails
//     with a permanent idempotency.ErrFingerprintMismatch instead.
//   - Another transaction is processing the key right now and it is not
//     committed yet (an overlapping duplicate): Handle returns
//     consumer.Defer wrapping idempotency.ErrInProgressElsewhere without
//     waiting for it. The check uses a transaction-scoped advisory lock on
//     a hash of the table's OID and the key (pg_try_advisory_xact_lock), so
//     it never blocks on the other transaction's row lock and never holds a
//     connection idle, and handlers that name the table differently ("t",
//     "public.t") agree.
//
// # Batches
//
// NewBatch is the same for batch handlers (consumer.NewBatch): one
// transaction per batch, so that a bulk effect (one multi-row INSERT, a
// COPY) commits with the processed-key rows of every message it covers:
//
//	h, err := pgtx.NewBatch(pool, func(ctx context.Context, tx pgx.Tx, b *consumer.Batch) error {
//		rows := make([][]any, 0, len(b.Messages))
//		for _, m := range b.Messages {
//			p, err := parse(m.Body)
//			if err != nil {
//				b.Fail(m, consumer.Permanent(err)) // before writing: its key is taken out
//				continue
//			}
//			rows = append(rows, []any{m.ID, p.Amount})
//		}
//		_, err := tx.CopyFrom(ctx, pgx.Identifier{"payments"}, []string{"id", "amount"}, pgx.CopyFromRows(rows))
//		return err
//	})
//	c, err := consumer.NewBatch(src, h, consumer.WithBatchSize(100))
//
// One statement records the keys of the whole batch: the messages whose
// keys are new go to the function, the sequential duplicates are done at
// once, and the overlapping ones deferred, as for one message; a message
// without a usable key fails at once, with no transaction. A message whose
// key an earlier message of the batch has does not go to the function: it
// is done once that one's effect commits, and deferred when it does not.
// What the function's result does to its messages is [BatchFunc]'s
// contract; the duplicates keep their outcomes whatever it returns. The
// failures of the database and the conflicts are handled as for one
// message (below), for the whole transaction; a failed BEGIN or key
// statement counts a store error for each message of the batch.
//
// Each key's advisory lock is held until the batch's transaction ends, so
// a batch of n keys takes n entries of PostgreSQL's shared lock table,
// which holds max_locks_per_transaction × (max_connections +
// max_prepared_transactions) of them (6,400 by default): keep the batch
// size times the concurrent batches well below that, or raise
// max_locks_per_transaction.
//
// # What is exactly once, and what is not
//
// Covered: every write the function makes through tx, to the database the
// transaction runs in. Each key's writes commit at most once (the primary
// key on the processed table forbids a second commit) and at least once (a
// delivery is acked only after its commit; a crash, a lost ack, a commit
// whose reply was lost, or a redelivery to another consumer all end in a
// redelivery that finds the key and is skipped). This holds for any number
// of consumers sharing the database.
//
// Not covered: anything else the function does. An HTTP call, a message
// published to a broker, a write through another connection or to another
// database, a file, a cache, or an email is not part of the transaction: it
// happens again whenever the transaction rolls back or the process dies
// before committing, and a retried delivery repeats it. Use the idempotency
// middleware (at least once, never concurrent) or a transactional outbox
// table written through tx for those. Also not covered: two different keys
// for one business operation (choose the KeyFunc so that a re-published
// message keeps its key), and keys deleted by Cleanup before their last
// redelivery.
//
// # Conflicts
//
// Under REPEATABLE READ or SERIALIZABLE (see WithTxOptions), PostgreSQL
// aborts a transaction that overlaps another one in a way it cannot
// serialize, and at any level one caught in a deadlock. Either abort says
// nothing about the message, so Handle runs the whole transaction again,
// key claim included, after a short randomized pause, up to
// WithConflictRetries times (3 by default), and only then returns the
// error for the runtime to retry or dead-letter. Every run but the last
// rolled back, so the function's writes through tx still commit once.
//
// # When the database fails
//
// A failure of the database around the function's transaction is no fault
// of the message: a BEGIN, key claim, fingerprint read or COMMIT that fails
// for any reason but the data (no connection, a lost one, a server shutting
// down or out of resources, a missing table, a role refused), and a
// function whose error came with its session gone (terminated, crashed, or
// dropped by the network). Handle returns such an error marked
// consumer.Unavailable: the runtime uses up no attempt and never
// dead-letters the message for it; the message waits in place with a
// growing backoff until the database answers. The function's own errors go
// to the runtime unchanged, a failed statement or a statement timeout
// included, and so does a network error from anything else it calls: only
// the state of the transaction's connection tells, not the type of the
// error. A function that returns nil after one of its statements failed
// (which aborts the transaction) fails too, with an error saying so: its
// transaction cannot commit, and that is not the database's fault.
//
// # Connections that vanish
//
// A transaction whose client vanished without the server noticing (a
// network partition, a dead client host) stays open and keeps its key's
// lock until PostgreSQL ends the session; every redelivery of that key
// meanwhile is deferred as an overlapping duplicate. Set
// idle_in_transaction_session_timeout (and TCP keepalives) for the role or
// database the consumers use, a little above the longest handler, so that
// such a key frees itself in minutes rather than hours.
//
// # Retention
//
// Rows stay in the processed table until [Handler.Cleanup] deletes rows
// older than the retention you choose. Keep it longer than the broker can
// redeliver a message (and longer than any replay you might do).
package pgtx
