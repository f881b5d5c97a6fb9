// Package adapters is the contract between the custody runtime and a message
// broker, in the spirit of database/sql/driver and gocloud's pubsub/driver:
// adapters translate, the runtime (package consumer) decides policy.
//
// # The pieces
//
// A [Source] receives [Delivery] values in batches, acknowledges them
// (the effect is done; never show this message again), and nacks them (give
// this message back, to be redelivered after a delay). A Source whose broker
// keeps deliveries on a lease also implements [Extender], and the runtime's
// lease keeper renews every held delivery through it. A [DeadLetter] is a
// destination for messages that cannot be processed.
//
// Adapters never retry a handler, never decide when to ack and never count
// attempts on their own behalf: they report what the broker says (its delivery
// count, its lease length, its batch limits) through [Capabilities] and the
// Delivery fields, and the runtime does the rest in one place.
//
// # Losing a delivery
//
// Every Delivery can be lost: its lease expired and another consumer took it,
// its channel closed, its partition was revoked. The adapter calls
// [Delivery.Lose] with a cause as soon as it knows; the runtime wires the
// handler's context to that call (once the handler asks for its Done channel
// or cause), so the handler sees ctx.Done() with [context.Cause] explaining
// why. A handler that still returns nil gets its ack sent: the adapter
// refuses it where it can tell (a fenced partition, a dead channel), and the
// broker may ignore it (SQS with a stale receipt handle). Either way nothing
// is lost; the message may be redelivered.
//
// # Recalling a delivery
//
// An adapter that wants deliveries back soon, but can still take their acks,
// calls [Delivery.Recall] instead: the Kafka adapter does so for the records
// of a partition being revoked, so that its revoke waits only for the
// handlers actually running. The runtime gives a recalled delivery back
// (a Nack with no delay) if its handler has not started, or before a retry
// in place; a running handler is left alone and its ack still counts. To
// keep a lane's order, recall every delivery of the lane handed out after a
// recalled one, the latest first. A Source that recalls deliveries also
// implements [Recaller], so that the runtime need not wait for a free worker
// to give back those that wait.
//
// # Batch results
//
// Ack, Nack, Extend and friends work on batches. They return nil when every
// entry succeeded, a [*BatchError] naming the entries that failed, or any
// other error when the whole call failed.
//
// # Conformance
//
// Package adaptertest holds the behavioural suite every adapter runs.
package adapters
