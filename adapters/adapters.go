package adapters

import (
	"context"
	"errors"
	"strconv"
	"time"
)

// Source is one stream of deliveries from a broker: a queue, a consumer group
// over topics, a subscription. Its methods may be called concurrently.
// Ack, Nack and Extend must return in bounded time even when the broker does
// not answer (network adapters set their own I/O timeouts): the runtime
// waits for them.
//
// Ack, Nack and Extend take deliveries this Source's Receive returned (and,
// where any consumer's receipt will do, as with SQS and the memory broker,
// those of another Source on the same queue). An entry the Source cannot
// settle (a delivery it did not hand out, one whose channel or partition is
// gone) fails alone, in a [*BatchError]; the other entries of the call are
// settled as asked. Whatever the order of calls, a nil result for an entry
// must be true as far as the adapter can know: an Ack that succeeded for a
// delivery means the adapter neither hands its message out again nor gave
// it back, so an Ack of a delivery already nacked either still deletes its
// message (where the broker allows, as SQS does with a receipt handle not
// yet superseded) or fails. (The broker may still deliver it again when the
// ack never reaches it: a RabbitMQ ack is written after Ack returns and has
// no reply, and a connection that dies first loses it; SQS delivers at
// least once. Those are the broker's duplicates, which the idempotency
// layer absorbs.) Acking a delivery twice is harmless: the second Ack
// returns nil or fails that entry, and never disturbs other deliveries.
// After Close these calls either still work (an SQS receipt handle outlives
// the Source) or fail.
//
// Package adaptertest checks these rules against every adapter.
type Source interface {
	// Receive blocks until at least one delivery is available, ctx is done,
	// or the adapter's poll wait elapses, and returns at most max
	// deliveries, however large max is. An empty result with a nil error
	// is normal (a long poll that found nothing). After ctx is done it
	// returns ctx's error and hands out nothing, not even deliveries it
	// fetched ahead: the runtime stops receiving when shutdown begins.
	// Deliveries returned with an error (a partial failure, such as one
	// Kafka partition's fetch error among other partitions' records) are
	// held like any others: the runtime handles them and logs the error.
	// After Close, Receive returns an error wrapping [ErrClosed]; a Receive
	// waiting when Close is called returns.
	Receive(ctx context.Context, max int) ([]*Delivery, error)

	// Ack settles deliveries whose effect is complete. The broker must not
	// deliver them again.
	Ack(ctx context.Context, ds []*Delivery) error

	// Nack gives deliveries back, each to be redelivered no sooner than its
	// After (zero or less: as soon as the broker may). A delay longer than
	// the broker can hold a message back is cut to the longest it can
	// (SQS: what is left of 12 hours since the receive), never refused:
	// the retry policy, not the adapter, picks delays. Adapters whose
	// broker has no delayed redelivery report NackDelay=false in their
	// Capabilities; the runtime then waits in place and only nacks with
	// zero delay, to give back deliveries it will not run (at shutdown,
	// recalled, or behind a lost one of their lane).
	Nack(ctx context.Context, ns []Nack) error

	// Capabilities describes what the broker offers. It is read once, when
	// the consumer is built, and must not change afterwards.
	Capabilities() Capabilities

	// Close releases the adapter's resources. Deliveries not acked are left
	// to the broker to redeliver. Close is called once, by the runtime,
	// after everything it will ack has been acked.
	Close() error
}

// Extender is implemented by sources whose deliveries are held on a lease
// (SQS visibility timeout, JetStream AckWait, the memory broker). Extend
// renews the lease of each delivery to d from now. An entry whose message
// another consumer received since its lease ran out fails with an error
// wrapping [ErrLeaseLost]: the runtime then cancels its handler.
type Extender interface {
	Extend(ctx context.Context, ds []*Delivery, d time.Duration) error
}

// Recaller is implemented by sources that recall deliveries (see
// [Signal.Recall]). The channel Recalls returns receives a value (sent
// without blocking, so one value may stand for several recalls) after the
// source has recalled deliveries. The runtime then gives back at once the
// recalled deliveries that wait for a worker or behind a running job of
// their lane, rather than when a worker reaches them. Recalls is called once,
// when the consumer starts; the channel must not be closed before Close.
type Recaller interface {
	Recalls() <-chan struct{}
}

// Nack is one entry of a Nack call: a delivery to give back, and how long
// the broker should hold it back first.
type Nack struct {
	Delivery *Delivery
	After    time.Duration
}

// DeadLetter is a destination for messages that will not be processed: they
// failed MaxAttempts times, or failed with a permanent error.
//
// Send returns nil only once the message is durably stored at the
// destination (the publish was confirmed); the runtime acks the original only
// then.
type DeadLetter interface {
	Send(ctx context.Context, d *Delivery, f Failure) error
}

// OriginalSettler is implemented by a DeadLetter that disposes of the
// original itself when Send succeeds: it rejects the message into the
// broker's own dead-letter exchange, gives it back to the queue's redrive
// policy, or acks it in the same step as it writes the copy. When
// SettlesOriginal reports true for a delivery, the runtime neither acks nor
// nacks it after Send returned nil.
//
// It saves a call; correctness must not depend on it, since a wrapper
// around the destination (one that logs its writes, say) hides it: the
// Source's Ack of a delivery its own dead-letter destination disposed of
// succeeds without effect (it must not delete a message given back to a
// redrive policy), and so does a Nack. The conformance suite checks it.
type OriginalSettler interface {
	SettlesOriginal(d *Delivery) bool
}

// Failure is what the runtime knows about why a message is dead-lettered. The
// DeadLetter writes it beside the original message as diagnostics.
type Failure struct {
	// Err is the last error the handler returned (or the panic it raised).
	Err error
	// Permanent reports whether the handler marked the error permanent.
	Permanent bool
	// Attempts is the number of times the message was handled.
	Attempts int
	// FirstFailure and LastFailure bound the failures this runtime saw. When
	// earlier attempts happened in another process, FirstFailure is the
	// broker's first-receive time where it reports one.
	FirstFailure time.Time
	LastFailure  time.Time
	// Consumer names the consuming application (group, queue consumer).
	Consumer string
}

// Capabilities describes a Source to the runtime. The zero value describes a
// broker with no leases, no delivery count, no delayed redelivery and no
// batch limits.
type Capabilities struct {
	// Name identifies the source in telemetry and logs, for example
	// "sqs:orders" or "kafka:payments".
	Name string

	// System names the broker as OpenTelemetry's messaging conventions do
	// (messaging.system): "aws_sqs", "rabbitmq", "kafka". The runtime puts it
	// on its spans; empty leaves it out.
	System string

	// Lease is how long the broker keeps a received delivery invisible to
	// other consumers before redelivering it. Zero means deliveries are not
	// leased (they stay with this consumer until acked or until the
	// connection or assignment ends). When non-zero the Source must
	// implement Extender or the lease cannot be kept alive.
	Lease time.Duration

	// MaxLeaseAge caps how long a delivery may be held in total, counted
	// from its receive, Delivery.ReceivedAt (SQS: 12 hours of invisibility
	// per receive). Zero means no cap.
	MaxLeaseAge time.Duration

	// NackDelay reports whether Nack honours redeliverAfter: a nacked
	// message comes back no sooner than asked. Reported wrongly, it makes
	// the runtime's retries hot-loop through the broker. When false,
	// or when CountsDeliveries is false (a redelivery would start counting
	// attempts again, so MaxAttempts would never be reached), the runtime
	// retries in place.
	NackDelay bool

	// CountsDeliveries reports whether Delivery.Attempt comes from the broker
	// and survives redelivery to another process.
	CountsDeliveries bool

	// Ordered reports that the adapter sets Delivery.OrderingKey for
	// deliveries that must be processed in order. The runtime orders by
	// OrderingKey alone; an adapter that does not report Ordered leaves
	// every OrderingKey empty.
	Ordered bool

	// MaxUnacked is how many deliveries the broker hands out before it
	// waits for acks (AMQP prefetch). The runtime refuses a concurrency above
	// it, since the extra workers could never get a message, and holds no
	// more than it by default. Zero means no such bound.
	MaxUnacked int

	// FreeWhileQueued reports that a delivery waiting behind the running
	// delivery of its ordering lane costs the broker nothing: it holds no
	// lease (Lease zero) and no clock runs on it (MaxLeaseAge zero), and
	// MaxUnacked (non-zero) bounds the deliveries handed out. The runtime
	// then keeps such waiting deliveries out of its in-flight window and
	// bounds them, with the rest of what it holds, by MaxUnacked instead:
	// a lane whose running delivery takes long holds up that lane only,
	// not every other one. A Source that shares the window out over its
	// lanes itself (Kafka by partition) leaves it false.
	FreeWhileQueued bool

	// MaxReceive bounds the deliveries the runtime asks one Receive for.
	// Zero means unbounded. Receive still honours a larger max (returning
	// no more than it can), so a caller other than the runtime need not
	// know it.
	MaxReceive int

	// Receivers is how many Receive calls the runtime may run at once,
	// each for up to MaxReceive deliveries (SQS: several long polls). Zero
	// means one.
	Receivers int

	// Ack, Nack and Extend say how the runtime batches each operation for
	// this broker (see Batching). The zero value suits an in-process broker:
	// batches of any size, sent by the workers at once, one call at a time.
	Ack, Nack, Extend Batching
}

// BatchError reports which entries of a batch call failed. Failed maps the
// index of each failed delivery in the batch to its error; entries not named
// succeeded.
type BatchError struct {
	Failed map[int]error
}

func (e *BatchError) Error() string {
	for _, err := range e.Failed {
		if len(e.Failed) == 1 {
			return "custody: 1 entry of the batch failed: " + err.Error()
		}
		return "custody: " + strconv.Itoa(len(e.Failed)) + " entries of the batch failed, for example: " + err.Error()
	}
	return "custody: batch failed"
}

// EntryError returns the error for entry i of a batch call that returned err:
// nil when that entry succeeded.
func EntryError(err error, i int) error {
	if err == nil {
		return nil
	}
	var be *BatchError
	if errors.As(err, &be) {
		return be.Failed[i]
	}
	return err
}

// Errors adapters return and wrap, so the runtime and users can tell causes
// apart with errors.Is.
var (
	// ErrLeaseLost means the delivery can no longer be acked by this
	// consumer: its lease expired and it may already be with another one.
	ErrLeaseLost = errors.New("custody: lease lost; the broker will redeliver the message")
	// ErrConnectionLost means the channel or connection that carried the
	// delivery is gone; the broker will redeliver it.
	ErrConnectionLost = errors.New("custody: connection lost; the broker will redeliver the message")
	// ErrRevoked means the delivery's partition was revoked or lost in a
	// rebalance; its new owner will process it.
	ErrRevoked = errors.New("custody: partition revoked; its new owner will process the message")
	// ErrClosed means the source was closed.
	ErrClosed = errors.New("custody: source closed")
)

// Batching describes how the runtime may batch one operation (Ack, Nack or
// Extend) for a Source: the adapter declares what its broker rewards, the
// runtime does the batching, lingering and retrying, and the adapter turns
// each batch it is given into broker calls at once.
type Batching struct {
	// MaxEntries is the largest batch one call takes (SQS: 10). Zero means
	// no limit of the broker's; the runtime then bounds batches itself.
	MaxEntries int
	// Linger is the longest a batch may wait to fill. Zero suits cheap,
	// local calls (an in-process broker, an AMQP ack that has no reply):
	// the runtime's workers make them, as soon as no worker is about to add
	// to the batch, and within a millisecond. A broker that bills per
	// request (SQS) asks for a linger; the runtime then makes the calls on
	// goroutines of its own, so that no handler waits for one. The lease
	// keeper never renews a lease late: for Extend, it gathers leases due
	// within a quarter of the renewal interval instead.
	Linger time.Duration
	// MaxCalls is how many calls of the operation may be under way at once.
	// Zero means one.
	MaxCalls int
}

// Retryable is implemented by sources that can tell an entry's transient
// failure (throttling, a fault on the broker's side) from a final one. The
// runtime tries again, a few times with a pause, the entries of an Ack or
// Nack for which IsRetryable reports true. Without it, the runtime tries
// again the entries of a call that failed whole (the network) and no
// others. An entry lost to this consumer (ErrLeaseLost, ErrConnectionLost,
// ErrRevoked, ErrClosed) is never tried again.
type Retryable interface {
	IsRetryable(err error) bool
}

// NackAll returns a Nack entry for each of ds, all with the same delay.
func NackAll(ds []*Delivery, after time.Duration) []Nack {
	ns := make([]Nack, len(ds))
	for i, d := range ds {
		ns[i] = Nack{Delivery: d, After: after}
	}
	return ns
}
