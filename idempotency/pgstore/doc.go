// Package pgstore is an idempotency.Store in a PostgreSQL table (pgx v5),
// shared by every consumer that uses the same database.
//
// # Table
//
// One row per key. [CreateSchema] creates the table and its index if they
// do not exist; [DDL] returns the same statements for a migration tool.
// Either comes before [New], which checks that the table is there. With
// the default table name they are:
//
//	CREATE TABLE IF NOT EXISTS custody_idempotency (
//	    key         text        PRIMARY KEY,
//	    token       text        NOT NULL,
//	    state       text        NOT NULL CHECK (state IN ('in_progress', 'completed')),
//	    fingerprint text        NOT NULL DEFAULT '',
//	    expires_at  timestamptz NOT NULL
//	);
//	CREATE INDEX IF NOT EXISTS custody_idempotency_expires_at_idx
//	    ON custody_idempotency (expires_at);
//
// # Operations and cost
//
//   - Claim is one INSERT ... ON CONFLICT DO UPDATE ... WHERE expires_at <=
//     now(): it creates the claim, or takes over a record whose lease or
//     retention has run out, and otherwise reports the record that holds
//     the key, in one round trip.
//   - Complete, Release and Extend are one UPDATE or DELETE each, matched on
//     key and token and on the claim being unexpired.
//   - Expired rows stay until [Store.Cleanup] (or [Store.RunCleanup] on a
//     schedule) deletes them in batches; they are ignored, and overwritten
//     by a new claim, in the meantime.
//
// # Guarantees and limits
//
// Expiry is decided by the database server's clock (now()), so consumers'
// clocks do not matter. Records are as durable as the database. The store
// records that an effect happened; it does not make the effect and the
// record one atomic step. When the effect is itself a write to the same
// database, use the idempotency/pgtx helper instead, which commits both in
// one transaction.
//
// Keys and fingerprints are text columns, and the key is indexed: Claim
// refuses a key or fingerprint that is not valid UTF-8 or holds a NUL byte,
// and a key over 2,600 bytes, with an error wrapping
// idempotency.ErrUnstorableKey, which the middleware makes permanent. Hash
// binary keys (a Kafka record key, say) in the KeyFunc.
package pgstore
