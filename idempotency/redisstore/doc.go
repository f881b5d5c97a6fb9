// Package redisstore is an idempotency.Store in Redis 7.0 or later (go-redis
// v9), shared by every consumer that connects to the same Redis.
//
// # Records
//
// Each key is one Redis string, named prefix + key, holding the state, the
// claim's token and the payload fingerprint. Its Redis expiry is the claim's
// lease while in progress and the retention once completed (each rounded up
// to whole milliseconds, Redis's precision, so that a claim is never held
// for less than asked), so Redis itself forgets records: there is nothing to
// clean up.
//
// # Operations and cost
//
//   - Claim is one SET key value NX PX lease GET (NX and GET together need
//     Redis 7.0): it creates the claim when the key is absent (or expired)
//     and otherwise returns the record that holds it, atomically, in one
//     round trip.
//   - Complete, Release and Extend are each one Lua script that compares the
//     token before changing anything (EVALSHA, one round trip).
//
// # Guarantees and limits
//
// Expiry is decided by the Redis server's clock, so consumers' clocks do not
// matter. A Redis without persistence forgets claims and completions when it
// restarts; after that, earlier messages are processed again if redelivered.
// With replication, a failover can lose writes not yet replicated, with the
// same effect. Use the PostgreSQL store, or the transactional form, when
// that is not acceptable.
package redisstore
