// Package lease keeps many broker leases alive with one scheduler.
//
// A lease-based broker (SQS visibility timeout, JetStream AckWait, the memory
// broker) redelivers a message to another consumer when its lease runs out.
// A [Keeper] renews every lease it tracks when a fraction (one third by
// default) of the lease has elapsed, extending it back to the full length, so
// a slow handler is never raced by a redelivery of its own message.
//
// # Semantics
//
//   - Tracking starts at receive time, so deliveries waiting in a buffer are
//     covered as well as running ones.
//   - Renewals are batched: every lease due now, or due soon, goes out in one
//     call of at most MaxBatch deliveries.
//   - [Lease.Stop] ends renewals for a delivery: a renewal taken but not yet
//     sent is not sent, and one on the wire is waited for, so once Stop
//     returns no extension of it is in flight or will be sent (the runtime
//     calls Stop after the handler finished and before the ack). If the
//     keeper is losing the delivery, Stop waits for the loss: once Stop
//     returns, [adapters.Signal.LostCause] tells whether the keeper lost it,
//     and the keeper never loses it afterwards.
//   - Total hold time is capped (MaxHold, counted from receipt). At the cap the
//     keeper stops renewing and loses the delivery. The last extension runs
//     to the cap; the keeper does not renew the lease again before it.
//   - A renewal the adapter refuses because the lease is gone (its error
//     wraps [adapters.ErrLeaseLost]: a stale receipt, the message received
//     again or deleted) loses the delivery at once: its
//     [adapters.Signal.Lose] is called with that cause, which cancels its
//     handler's context.
//   - Any other failure (a network error, throttling, a timeout) leaves the
//     lease as the broker last granted it, so the renewal is tried again,
//     every sixth of the lease by default (at half of what is left, when
//     that is sooner), while the lease has more than a twelfth of its length
//     left; past that the delivery is lost with a cause wrapping
//     [adapters.ErrLeaseLost] and the last failure. A call not answered
//     by then is cut short, however long Config.Timeout is, and counts as
//     such a failure: the delivery is lost before its lease runs out at the
//     broker, not when a call that outlived the lease gives up, while
//     another consumer already runs the message. A renewal cut short
//     because Run's context ended is not a failure: the keeper is stopping.
//
// # Cost
//
// One goroutine runs the schedule over a heap of due times; renewals run on a
// small, fixed number of goroutines. No timer or goroutine exists per lease.
// [Keeper.StartAll] tracks a received batch under one lock and without
// allocating, in Lease values the caller allocates with its own
// per-delivery state; a Lease only names the keeper's record of the
// delivery, which the keeper reuses once the lease is stopped. Tracking a
// lease usually costs one comparison in the heap (leases of one keeper fall
// due in the order they start), and wakes the scheduler only when it falls
// due before every lease already tracked. [Lease.Stop] costs one lock and no
// search of the heap, however many leases are tracked: it leaves the
// lease's entry behind, which the scheduler skips, and the heap is
// compacted (in linear time, paid for by those Stops) once such entries
// outnumber the tracked leases, so it stays within about twice their
// number.
package lease
