// Package consumer runs a Handler over messages from any broker adapter,
// acknowledging each message only after its effect is done.
//
// # Handling
//
// A [Handler] is called once per attempt with a [Message]. Its return value
// decides what happens to the message:
//
//   - nil: the effect is done; the message is acked.
//   - an error: the attempt failed; the message is retried after a backoff,
//     until Retry.MaxAttempts attempts have been made, then dead-lettered.
//   - [Permanent](err): no retry can help (the payload does not parse); the
//     message is dead-lettered at once.
//   - [RetryAfter](err, d): retry no sooner than d.
//   - [Defer](err, d): not now, for a reason outside the message (its
//     original is still running elsewhere): try again no sooner than d,
//     without counting the attempt (except as a broker that counts
//     deliveries does: see Defer); a deferral never dead-letters.
//   - [Unavailable](err): a dependency is down (a database, a downstream
//     service, the idempotency store), which is not the message's fault:
//     no attempt is used up, the message is never dead-lettered for it, and
//     it waits in place, its lease kept alive, with a backoff that grows
//     while the outage lasts. Waiting messages hold their place in the
//     in-flight window, so intake stops during an outage rather than
//     running the queue into it.
//
// A panic in the handler is recovered and treated as an error, and so is a
// returned error whose Error, Unwrap or As method panics (a typed nil
// pointer, say: the attempt fails with a [PanicError] saying so; both are
// counted as panics). A handler that ends its goroutine with runtime.Goexit
// instead of returning (t.FailNow, or testify's require, in a handler under
// test) fails its attempt with [ErrHandlerExited]: the message is given
// back at once and the worker replaced.
//
// # Retries
//
// Retries never hot-loop: every wait before a retry or a deferral is at least
// a millisecond, whatever the backoff, RetryAfter or Defer asks for. Where
// the broker can redeliver after a delay (SQS visibility, RabbitMQ, the
// memory broker), the message is given back with that delay and no worker
// waits. Where it cannot (Kafka), where the message belongs to an ordered
// lane (whose order a redelivery could break), or where the broker counts no
// deliveries (each redelivery would look like a first attempt, and
// MaxAttempts would never be reached), the message waits in place: it stays
// held, its lease kept alive and its lane (if any) waiting behind it, but
// no worker waits with it, so other messages run meanwhile. Attempts are
// counted by the broker where it counts deliveries, otherwise by the
// runtime.
//
// # Dead letters
//
// With [WithDeadLetter], exhausted and permanently failing messages are
// written to the dead-letter destination with diagnostic headers (error,
// attempts, first and last failure time, original queue, partition and
// offset). The original is acked only after the write is confirmed; a failed
// write keeps the original, which waits in place (its lease kept alive, the
// handler not run again, the broker's delivery count not raised) and the
// write is tried again after a backoff. The two steps are not atomic: if the
// original's ack fails or the process stops between them, the original comes
// back and is dead-lettered again, so the destination can hold two copies of
// one message (same adapters.HeaderOriginalID).
//
// # Leases
//
// Every delivery held by the runtime (running, waiting for a worker or lane,
// retrying in place) has its lease renewed at a third of its length (see
// [WithLeaseRenewal]), in batches, until the handler finishes; renewal stops
// before the ack. A renewal that fails without the adapter saying the lease
// is gone (throttling, a network error) is tried again while the lease has
// time left. Total hold time is capped by [WithMaxProcessingTime]. When a
// delivery is lost (the adapter refused a renewal because the lease was gone,
// renewals failed until it ran out, the cap was reached, or the adapter lost
// the delivery by itself: a dead channel, a revoked partition), the handler's
// context is cancelled and context.Cause says why (it wraps
// adapters.ErrLeaseLost, ErrConnectionLost, ErrRevoked or ErrClosed). A
// handler that succeeds anyway is still acked after a lost lease (the broker
// may take the ack, sparing a duplicate), but not after the other causes,
// which the adapter would refuse: the delivery is settled lost, and the
// broker or the partition's new owner delivers it again.
//
// A handler's context is built when the handler first asks for its Done
// channel or its cause, or derives a cancellable context from it (as
// [WithHandlerTimeout] does for every attempt); until then its Err is
// answered from the delivery's state, so a handler that never looks at its
// context, without a handler timeout, costs no allocation for it. Either
// way it is cancelled once the attempt ends: a goroutine the handler left
// running sees that.
//
// # Batches
//
// [NewBatch] runs a [BatchHandler] instead: it gets up to [WithBatchSize]
// messages at once (100 by default, bounded by [WithBatchBytes], gathered
// for up to [WithBatchLinger]) and records an outcome per message with
// [Batch.Done] or [Batch.Fail], the latter taking any error a Handler may
// return. Each message is then settled on its own, as a Handler's attempt
// would be: its own lease (renewed while the batch runs), attempt count,
// backoff and dead-lettering. A message left without an outcome is not
// acked ([ErrNoOutcome]), and an error from HandleBatch fails the whole
// batch. A batch holds the messages of a lane (an ordering key, a Kafka
// partition, a FIFO group) in order; when one of them fails, the lane's
// later messages of the batch are not acked ahead of it: they run again
// after it. A batch handler that stops handling a lane at its first failure
// repeats no effect for them. [ChainBatch] wraps a BatchHandler in
// [BatchMiddleware], as Chain does a Handler (the idempotency package has
// one for batches).
//
// A batch's context is every one of its messages' context at once. When
// the delivery of any of them is lost while the batch runs, the context is
// cancelled and context.Cause says why, as for a Handler: the broker hands
// that message to another consumer, and the batch's effect must not run on
// beside it. The lost message is settled as a Handler's would be (acked if
// it was done and only its lease ran out; else left to the broker). Its
// batch-mates keep their outcomes: those recorded done are acked; those
// that failed once the context was cancelled (with HandleBatch's error, or
// an error recorded for them) failed for the cut, not for themselves, and
// run again at once, in place and in their lanes' order, using up no
// attempt and never dead-lettered for it. A bulk effect that is all or
// nothing loses nothing by stopping at the cancellation and returning its
// error.
//
// # Concurrency and order
//
// [WithConcurrency] handlers run at once. Deliveries the adapter marks with an
// ordering key (a Kafka partition or key, an SQS FIFO group) run one at a time
// per key, in order; [WithOrdering](OrderByKey) adds the same guarantee per
// Message.Key on brokers that promise no order. When a delivery is lost (its
// lease ran out, its channel died), the deliveries of its key queued behind
// it are given back at once instead of run, so that the lost one,
// redelivered, still comes first. Those received after the loss are run in
// turn: they are the key as the broker delivers it again, the lost one first
// (a Kafka partition assigned back to the same consumer while the lost
// record's handler still ran).
//
// Order has a price the in-flight bound makes visible. A key's failed
// delivery is retried in place, its backoff waited out while the key's
// later deliveries wait behind it. Where the broker leases deliveries (SQS
// FIFO, JetStream, Redis, the memory broker), each of those keeps its lease
// renewed while it waits and holds its place in the in-flight window
// ([WithMaxInFlight]) all the while: a key whose head keeps failing, or
// runs long, can so fill the window with its own backlog, and the consumer
// then receives nothing else, for any key, until the head moves on. Bound
// the handlers ([WithHandlerTimeout]), keep the retry policy's attempts and
// backoff to what the key can afford to wait, and size the window for the
// backlog one slow key may gather.
//
// Where a waiting delivery costs the broker nothing (the source declares
// [adapters.Capabilities.FreeWhileQueued]: no lease, no clock; Kafka by
// key), the deliveries queued behind their key's running one stay out of
// the window, and the source's MaxUnacked bounds everything the consumer
// holds instead (Kafka: WithMaxUnacked, 4096 by default, and per partition
// WithMaxUnackedPerPartition, 512, at which the partition's fetching
// pauses). A slow key then holds up its own key only, until its backlog
// reaches that bound. A queued delivery taken to run enters the window
// again, which the consumer lets grow past its bound for it: the receiver
// waits for the window to fall back.
//
// # Shutdown
//
// Cancelling Run's context, or calling [Consumer.Shutdown], stops receiving
// and gives back deliveries that have not started (or, with
// [WithLeaveUnfinishedOnShutdown], leaves them to their lease). Running
// handlers keep their contexts until the shutdown timeout
// ([WithShutdownTimeout]) or the end of Shutdown's context, whichever comes
// first; what finishes is acked, what does not is given back (or left, as
// above). Run then stops lease renewals, closes the source and returns; no
// goroutine it started is left running. Shutdown returns once Run has.
//
// # Acks
//
// Acks and nacks are sent in batches, never before the handler returned,
// shaped by the adapter's [adapters.Batching] for each operation: how many
// entries one call may carry, how long an entry may wait for company (the
// linger), and how many calls may be in flight. Where the adapter asks for
// a linger (SQS fills delete batches of ten; RabbitMQ waits a millisecond
// to fold acks into one multiple-ack frame), a few goroutines owned by the
// consumer make the calls, so a handler never waits for a round trip.
// Otherwise the workers send the pending acks themselves as soon as a batch
// is full, a worker runs out of work, or a millisecond has passed since the
// oldest was queued. A message's lease stops being renewed when its handler
// returns, before its ack is queued; the longest linger an adapter may ask
// for (one second) is far shorter than any lease it renews.
//
// # Logs
//
// The runtime logs through the slog.Logger given by [WithLogger]
// (slog.Default() by default). Every line carries the consumer's name
// ("consumer"), and a message's lines its ID ("id"). An acked message logs
// nothing. What is logged, and when:
//
//   - DEBUG: a failed attempt whose message is tried again after a backoff
//     ("attempt", "max_attempts", "retry_in", "retry": "in place" or
//     "redelivered", "error"), and a deferred one ([Defer]); a message of a
//     batch cut short by the loss of another, run again; a message given
//     back to the broker ("reason": "shutdown", "shutdown deadline",
//     "recalled by the adapter", "behind a lost message", "handler called
//     Goexit"), or left to its lease at shutdown.
//   - INFO: a delivery lost before it was settled other than by its lease
//     (a revoked partition, a closed channel: "cause"); the broker delivers
//     it again.
//   - WARN: a message dead-lettered ("reason": "permanent" or "exhausted",
//     "attempts", "error"); a dependency unavailable ([Unavailable]:
//     "waits", "retry_in", "error"); a lost lease ("cause"); a failed ack,
//     nack, lease renewal or receive; a dead-letter write cut short by the
//     shutdown deadline or by the loss of its delivery; a failed handler in
//     at-most-once mode; the shutdown timeout reached; and, from New, a
//     consumer without a dead-letter destination.
//   - ERROR: a handler that panicked ("panic", "stack"), returned an error
//     whose Error method panicked, or called runtime.Goexit; a message that
//     failed for good with no dead-letter destination to take it; a failed
//     dead-letter write.
//
// Each kind of line is rate-limited on its own: at most 10 lines in a
// window of 10 seconds, which opens with the first line after the last
// window closed. Past that the lines are counted, not written, and one line
// at their level, "custody: similar log lines suppressed by the rate
// limit", gives their message ("line") and number ("suppressed") when the
// next window opens or Run returns. A poison storm so writes about one
// dead-letter line a second, however fast messages fail; the metrics count
// every one (custody.messages.settled by outcome). A line whose level the
// logger discards costs one Enabled call and no allocation.
//
// # Operating a consumer
//
// [Consumer.Status] is a snapshot for the person on call: the state
// (running, paused, draining, stopped), the source's connection (for
// sources that report one: adapters.Connector), the last receive and ack,
// what is held and running, leases lost and dead letters over the last
// minute, a Kafka member's partitions, the backlog as last polled, and the
// kill switch. [Consumer.LiveHandler] and [Consumer.ReadyHandler] serve it
// to Kubernetes probes: liveness fails only when Run is not running or a
// Receive has hung for [StuckAfter]; readiness is false while the source
// connects or reconnects, while the consumer drains, and while its kill
// switch is tripped.
//
// [Consumer.Pause] stops intake without leaving the group or dropping what
// is held (leases stay renewed); held messages finish, or those not yet
// running are given back ([GiveBackWaiting]). [Consumer.Resume] starts it
// again. [WithKillSwitch] pauses intake by itself when too many attempts
// fail over a window, holds what waits without using up attempts, and
// probes with a few attempts before it resumes: a dependency's outage
// turns into a pause, not into dead letters or retries that hammer it.
//
// A source that can tell its backlog (adapters.BacklogReporter) is polled
// every [WithBacklogInterval] (30 s by default) for the gauges
// custody.backlog.waiting, .in_flight and .oldest_age. Every counter is
// reported from the start, at zero, so that it shows on a metrics page
// before the first message.
//
// # Telemetry
//
// Metrics and spans go to the OpenTelemetry providers given by
// [WithMeterProvider] and [WithTracerProvider] (the global ones by default);
// see the custody package documentation for the instrument names. Only a
// failed attempt counts as an error (custody.result "error" on its
// duration, an error status on its span): a deferral ([Defer]) is recorded
// as "deferred", and an attempt cut short by the shutdown deadline or by the
// loss of its delivery as "cancelled", each with a span event of that name,
// so that deploys and rebalances do not show as error rates.
package consumer
