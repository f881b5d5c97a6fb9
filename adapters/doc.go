// Package adapters is the contract between the custody runtime and a message
// broker, in the spirit of database/sql/driver and gocloud's pubsub/driver:
// adapters translate, the runtime (package consumer) decides policy.
//
// # The pieces
//
// A [Source] receives [Delivery] values, acknowledges them (the effect is
// done; never show this message again) and nacks them (give this message
// back, to be redelivered after a delay). A Source whose broker keeps
// deliveries on a lease also implements [Extender]. A [DeadLetter] is a
// destination for messages that cannot be processed.
//
// # Who does what
//
// The runtime owns every decision about time. It asks Receive only for
// what it can hold, running up to [Capabilities.Receivers] calls at once; it
// renews the lease of every delivery it holds, through Extend, with one
// lease keeper; it gathers acks, nacks and renewals into batches, lingers to
// fill them and bounds the calls in flight, as the adapter's [Batching]
// declares; it retries the entries of a call that failed for a transient
// reason ([Retryable]); it counts attempts where the broker does not, and
// picks every delay.
//
// An adapter translates: it turns exactly the batch it is given into broker
// calls, at once, and reports per entry what the broker said
// ([BatchError]). It does not fetch ahead of what Receive was asked for,
// renew leases, linger, or retry on its own. What it knows about its broker
// (the lease length, the delivery count, batch limits, ordering) it
// declares in [Capabilities].
//
// # Losing a delivery
//
// A delivery can be lost: its lease expired and another consumer took it,
// its channel closed, its partition was revoked. An entry of Ack, Nack or
// Extend that the broker refuses for that reason fails with an error
// wrapping [ErrLeaseLost] (or ErrConnectionLost, ErrRevoked), and the
// runtime loses the delivery. A loss the adapter learns of outside those
// calls (a channel's death) it reports through the delivery's [Signal],
// which the runtime watches: the handler's context is cancelled with the
// cause ([context.Cause] says why). A handler that still returns nil gets
// its ack sent where the broker might take it (a lease that ran out); the
// adapter refuses it where it can tell (a fenced partition, a dead channel).
// Either way nothing is lost; the message may be redelivered.
//
// # Recalling a delivery
//
// An adapter that wants deliveries back soon, but can still take their acks,
// calls [Signal.Recall] instead: the Kafka adapter does so for the records
// of a partition being revoked, so that its revoke waits only for the
// handlers actually running. The runtime gives a recalled delivery back (a
// Nack with no delay) if its handler has not started, or before a retry in
// place; a running handler is left alone and its ack still counts. A Source
// that recalls deliveries also implements [Recaller], so that the runtime
// need not wait for a free worker to give back those that wait.
//
// # Batch results
//
// Ack, Nack, Extend return nil when every entry succeeded, a [*BatchError]
// naming the entries that failed, or any other error when the whole call
// failed.
//
// # Conformance
//
// Package adaptertest holds the behavioural suite every adapter runs.
package adapters
