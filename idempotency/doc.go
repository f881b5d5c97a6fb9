// Package idempotency absorbs duplicate deliveries: it claims a message's
// idempotency key before the handler performs the effect and marks the key
// completed after, so that the effect of each key runs once as far as the
// store can tell, and never twice at the same time.
//
// Brokers deliver at least once. Duplicates come from lost acks, consumers
// that crash between the effect and the ack, rebalances, leases that run
// out under a working handler, and producers that publish twice. This
// package turns them into skipped or postponed deliveries, and counts them.
//
// # Use
//
//	store, _ := pgstore.New(ctx, pool) // or redisstore.New(ctx, rdb), idempotency.NewMemoryStore()
//	mw, err := idempotency.New(store,
//		idempotency.WithKeyFunc(func(m *consumer.Message) string { return m.Headers["order-id"] }),
//		idempotency.WithFingerprint(idempotency.FingerprintBody),
//	)
//	c, err := consumer.New(src, consumer.Chain(handler, mw))
//
// # What happens to a delivery
//
// The key comes from the KeyFunc, by default the broker's stable message
// identity ([MessageID]). A message without a key fails with a permanent
// [ErrNoKey] (to the dead-letter destination): a guessed key would let
// duplicates through or swallow distinct messages. Then the key is claimed:
//
//   - Acquired: the handler runs, its claim extended (every fifth of the
//     lease by default) so that no other delivery takes the key over
//     mid-effect. If an extension is refused, or cannot be made before the
//     claim would run out, the handler's context is cancelled with cause
//     [ErrClaimLost], and what it returns is marked consumer.Unavailable
//     (see below) unless it is consumer.Permanent. When the handler returns
//     nil the key is marked completed and kept for the retention; when it
//     returns an error or panics, the claim is released for the retry. A
//     claim answered only after its lease had run out holds nothing: the
//     handler does not run, the claim is given back, and Handle fails as
//     when the store cannot be reached, with an error wrapping ErrClaimLost.
//   - Completed: a sequential duplicate. The handler is skipped and the
//     message acked.
//   - In progress elsewhere: an overlapping duplicate. The handler is not
//     run; Handle returns consumer.Defer wrapping [ErrInProgressElsewhere],
//     so the message comes back when the other delivery has likely
//     finished. The runtime never dead-letters a message for deferrals
//     alone; where it counts attempts a deferral uses none up, but where
//     the broker counts deliveries (SQS, RabbitMQ, the memory broker) each
//     one raises the count that MaxAttempts and a broker redrive policy
//     read (see consumer.Defer). Two deliveries of one key never run at
//     once while the claim is held.
//   - Fingerprint mismatch: with WithFingerprint, a key recorded for a
//     different payload fails with a permanent [ErrFingerprintMismatch]
//     instead of being skipped: two messages sharing a key is a producer
//     bug that a silent skip would hide.
//   - A key or fingerprint the store cannot hold (pgstore: not valid UTF-8,
//     a NUL byte, a key over 2,600 bytes) fails with a permanent
//     [ErrUnstorableKey] naming why; hash binary keys in the KeyFunc.
//
// # When the store fails
//
// A store that cannot claim the key (unreachable, timing out, full, or
// answering too late or nonsense) is no fault of the message: Handle fails
// with an error marked consumer.Unavailable, so the runtime uses up no
// attempt and never dead-letters the message for it; the message waits in
// place, its lease kept alive, with a backoff that grows while the outage
// lasts. Each such failure is counted ([MetricStoreErrors], op "claim");
// the log gets a warning when claims start failing, at most one every 30
// seconds while they go on, and a line when the store claims keys again.
// Only a message's own faults are permanent: no key, a fingerprint
// mismatch, a key the store cannot hold.
//
// Sequential and overlapping duplicates are counted apart
// ([MetricDuplicates], kind attribute): many sequential ones point at lost
// acks or crashes; many overlapping ones at leases shorter than the handler.
//
// # What it guarantees, and what not
//
// The middleware records that an effect happened after it happened. A crash
// between the two, or a store that cannot be reached for Complete, leaves
// the key claimed but not completed, and once the claim's lease runs out a
// redelivery runs the effect again: duplicates are rare and never
// concurrent, but the effect is at least once. When the effect is a write
// to PostgreSQL, the pgtx package commits it with the dedup record in one
// transaction: exactly once for that write.
//
// A failed Complete is tried again, three tries in all within the store
// timeout (a repeated Complete is harmless). If every try fails, the
// message is not failed (the effect happened; failing would run it again)
// but logged and counted ([MetricStoreErrors], or [MetricClaimsLost] when
// the claim had been taken over).
//
// A handler that never returns keeps its claim, whatever the broker does
// with its lease, and the redeliveries of its message are deferred for that
// long: the price of never running one key twice at once. Give handlers a
// bound (consumer.WithHandlerTimeout) and make them return when their
// context is done.
//
// # Batches
//
// [NewBatch] is the middleware for batch handlers (consumer.NewBatch), with
// New's options and, message by message, New's outcomes:
//
//	mw, err := idempotency.NewBatch(store)
//	c, err := consumer.NewBatch(src, consumer.ChainBatch(bulk, mw), consumer.WithBatchSize(100))
//
// It claims every key of the batch and records the outcome of each message
// whose key it did not acquire. The others go to the next handler as a
// batch of their own, their claims renewed together while it runs; then it
// completes the keys of the messages the handler marked done and releases
// the rest, each message keeping the outcome the handler recorded, or none
// (consumer.ErrNoOutcome). When the handler returns an error or panics,
// every claim is released and the error stands for the whole batch; when a
// claim is lost while it runs, its context is cancelled with ErrClaimLost,
// and the errors it returns are marked consumer.Unavailable unless they are
// Permanent.
//
// A message whose key an earlier message of the batch has is never passed
// on: it is done once the earlier one is done, deferred as an overlapping
// duplicate when it is not, and refused as a fingerprint mismatch when
// their fingerprints differ. With a [BatchStore] (the memory, Redis and
// PostgreSQL stores are) a batch costs one claim call, one completion call
// and one renewal call per interval, whatever its size.
//
// # Stores
//
// [MemoryStore] holds records in the process; the redisstore and pgstore
// packages share them between processes. Every store passes the same
// contract suite, storetest.Run.
package idempotency
