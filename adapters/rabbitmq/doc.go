// Package rabbitmq is the custody adapter for RabbitMQ, over
// github.com/rabbitmq/amqp091-go: a [Source] that consumes one queue, a
// [DeadLetter] sink, a native dead-letter mode that rejects into the queue's
// own dead-letter exchange, and a [Replay] of dead-letter queues.
//
//	src, err := rabbitmq.New(ctx, "orders",
//		rabbitmq.WithURL("amqp://user:pass@rabbit:5672/"),
//		rabbitmq.WithPrefetch(128),
//		rabbitmq.WithDeclare(rabbitmq.QuorumQueue, nil))
//	dlq, err := rabbitmq.NewDeadLetter(ctx, "orders.dlx", "orders", rabbitmq.WithURL(...),
//		rabbitmq.WithDeclareDeadLetter("orders.dlq", rabbitmq.QuorumQueue, nil))
//	c, err := consumer.New(src, handler, consumer.WithConcurrency(64), consumer.WithDeadLetter(dlq))
//
// # Connections and the queue
//
// New dials the broker (WithURL, WithConfig, WithTLS) or asks the caller's
// function for a connection (WithDialFunc), opens one channel, sets its
// prefetch (WithPrefetch, default 256) and consumes with manual acks. The
// prefetch is Capabilities.MaxUnacked: consumer.New refuses a concurrency
// above it, since the extra workers could never get a message. By default
// New only checks that the queue exists; WithDeclare declares it, classic or
// quorum, with arguments. New fails if the first connection or the check
// fails; later failures are repaired in the background.
//
// # Acks go out at once, and never cover an unfinished delivery
//
// A basic.ack with multiple=true settles every outstanding tag of its
// channel up to the one it names. The adapter tracks each channel's tags
// with a completion-prefix tracker, and Ack writes the batch it is given
// before it returns: one multiple=true ack for the run of finished tags from
// the oldest outstanding one, naming the highest tag of the run still
// outstanding (the broker closes the channel on a multiple ack naming a tag
// it no longer holds), and one ack each for the deliveries left behind an
// unfinished tag, which no multiple ack may cover. The adapter keeps no ack
// back and has no timer: batching is the runtime's work (Capabilities.Ack
// lingers a millisecond, so that a run of finished deliveries goes out as
// one frame). Rejects (requeues and native dead letters) go out one by one.
// No delivery is acked or nacked twice.
//
// When Ack returns, its frames are written to the connection: a process
// killed right after does not get those messages back. AMQP acks have no
// reply, so a connection that dies before the broker reads them still loses
// them, and the broker delivers those messages again (at least once). An
// Ack for a delivery whose channel or connection the client knows to be
// closed, or whose frame could not be written, reports
// adapters.ErrConnectionLost. Close closes the channel, or the connection
// when the broker does not answer the channel's close within 5 s, and then
// reports it.
//
// # Reconnecting without stale acks
//
// Each connection and channel is a generation, and every delivery carries
// its generation. When the connection or channel dies (or the broker cancels
// the consumer), every delivery of that generation is lost: its handler's
// context is cancelled with a cause wrapping adapters.ErrConnectionLost, and
// a later Ack or Nack of it is refused with ErrConnectionLost (a dropped ack:
// the broker redelivers the message) instead of being sent on the new
// channel, where the same tag names a different message. The adapter redials
// with exponential backoff (WithReconnectBackoff) and resumes. It logs the
// lost channel and the reconnection, not each failed attempt: Receive hands
// the runtime the reconnection error (the address tried and the cause) once,
// and again only when the attempts fail another way. Every amqp091
// notification channel it registers is buffered for all the library can
// send on it and drained, so the client never blocks on them. Automatic
// recovery in amqp091 (Config.Recovery) is refused: it would reuse a channel
// behind the adapter's back.
//
// [Source.Connection] reports those transitions (adapters.Connector); the
// runtime's readiness (consumer.Status().Ready, Consumer.ReadyHandler) is
// false while the Source reconnects.
//
// # Backlog
//
// [Source.Backlog] (adapters.BacklogReporter, polled by the runtime for its
// custody.backlog.* gauges) asks the broker for the queue's ready messages
// with a passive queue.declare, on a channel opened for the call on the
// consuming connection. AMQP tells no unacked count (InFlight is -1: only
// the management API and rabbitmqctl know it) and no message's age
// (OldestAge is zero; the management API's head_message_timestamp tells it
// for classic queues whose messages carry a timestamp).
//
// # Attempts
//
// Delivery.Attempt is 1 on the first delivery where the Source counts
// deliveries (Capabilities.CountsDeliveries): on a quorum queue it declares
// (WithDeclare(QuorumQueue, ...)), which counts redeliveries in
// x-delivery-count, and with WithDelayQueues, whose copies carry the next
// attempt in HeaderAttempt; a redelivery a classic queue only flags counts
// as one more attempt, a lower bound. Otherwise (a classic queue, or one the
// Source only checks) Attempt is 0 unless the message carries a count
// (x-delivery-count, HeaderAttempt), and the runtime counts its own
// attempts. Like the broker's, a count includes deliveries prefetched but
// never handled before a shutdown or a lost connection.
//
// # Retries
//
// Without delay queues, the default, the broker cannot hold a message back:
// the Source reports NackDelay=false, and the runtime waits out a retry in
// place, the delivery unacked (a prefetch slot, no worker), and runs its
// handler on it again after the backoff. The message never leaves the Source
// meanwhile, whatever limits its queue has. Nack requeues at once
// (basic.nack, requeue=true), whatever the delay. A delivery waiting in place
// stops the run of finished tags, so those finished after it are acked one
// by one. The broker closes the channel of a delivery unacked for its
// consumer timeout (WithConsumerTimeout, RabbitMQ's default 30 min), which
// the Source reports, less a margin, as Capabilities.MaxLeaseAge; it warns
// when deliveries stay unacked for more than half of it.
//
// Waiting retries hold prefetch slots: while many wait, the broker sends
// fewer new messages, and with a prefetch of 1 none. WithDelayQueues frees
// them: the Source reports NackDelay, and Nack publishes each delayed
// delivery's next attempt to a delay queue and acks the original after the
// broker confirmed the copy, never before. A delay queue
// ("<queue>.custody-retry.<ms>ms", or for a queue name too long for that
// "<prefix of the queue name>~<hash>.custody-retry.<ms>ms", created on first
// use) is a durable quorum queue whose message TTL is the delay rounded up
// to a fixed ladder of steps, and which dead-letters expired copies back to
// the queue at least once: the broker keeps a copy the queue refuses (full,
// or missing) and offers it again every
// dead_letter_worker_publisher_confirm_timeout (3 minutes by default). New
// declares one to check that the broker (RabbitMQ 3.10 or later) and the
// user allow them.
//
// A copy the delay queue does not take (not declared, deleted, full by a
// policy, or not confirmed within 30 s under a resource alarm, when the
// broker stops reading and the adapter closes the publishing connection to
// end even a blocked write) is published to the queue itself at once,
// losing its delay but keeping its attempt count; when the queue refuses it
// too (full, with x-overflow reject-publish or reject-publish-dlx, by
// argument or policy), the original is requeued. Once confirmed into the
// delay queue the copy is out of the adapter's hands: a policy that sets
// overflow on the delay queue (it overrides the argument, and anything but
// reject-publish makes the dead-lettering at-most-once), a deleted or
// expired delay queue, or one that loses its quorum loses it. See
// docs/rabbitmq.md.
//
// Republished copies go through the default exchange. They keep the body,
// the properties and the headers, drop the broker's own headers
// (x-delivery-count, x-death, x-first-death-*, x-last-death-*), and move
// aside to custody headers what the broker would act on again: a
// per-message TTL (HeaderOriginalExpiration), the CC and BCC headers, which
// would route the copy to more queues (HeaderOriginalCC, HeaderOriginalBCC),
// and a user-id other than the publishing user's, which the broker would
// refuse (HeaderOriginalUserID). They record the original exchange and
// routing key (HeaderOriginalExchange, HeaderOriginalRoutingKey). Publishing
// uses a connection of its own, so a broker that blocks publishers under a
// resource alarm does not also hold back the consumer's acks.
//
// # Copies must fit one frame
//
// A message's properties and headers travel in one content header frame,
// which must fit the connection's negotiated frame_max (128 KiB by default);
// only the body is split across frames. The broker answers a larger frame by
// closing the whole connection (FRAME_ERROR). And a message the broker
// delivers larger than that (it adds x-death and x-first-death-* when it
// dead-letters a message, x-delivery-count when a quorum queue redelivers
// one) is refused by the consumer's client, which closes its connection and
// gets the message again: the queue stalls for good. So the adapter measures
// every copy exactly as the client encodes it, and sends none that does not
// fit frame_max less the room those broker headers take on the copy's way
// (a retry through a delay queue counts two dead-letter hops): the publish
// fails instead, and the connection stays up. (A message someone else
// publishes that close to the limit can stall a queue the same way; only its
// publisher can prevent that.)
//
// A retry's copy adds HeaderAttempt, HeaderFirstReceived and the original
// route; when that would not fit, it leaves out HeaderFirstReceived, then
// the original route (they only feed dead-letter diagnostics), but never the
// message's own headers, which its handler sees again. A copy for a delay
// queue that still does not fit goes to the queue itself, one hop fewer, and
// one that does not fit even then is not published: the original is
// requeued whole. A quorum queue counts those requeues (x-delivery-count),
// so the message still reaches the dead-letter destination after
// MaxAttempts; a classic queue only flags them, so it is retried until it
// succeeds (each time with a warning). Only a message whose properties and
// headers were already that close to the limit gets there (within the room
// kept for the broker's headers, typically under 1 KiB, and the few dozen
// bytes of the attempt counter). For dead-letter copies see below.
//
// # Dead letters
//
// NewDeadLetter checks its destination (the exchange; through the default
// exchange, the queue the routing key names), so that a wrong name fails
// there and not at the first poison message. WithDeclareDeadLetter declares
// the exchange, the queue and their binding instead, on every new connection
// and after an unroutable copy.
//
// A [DeadLetter] publishes the original body and properties with the shared
// diagnostic headers (adapters.Diagnostics: error, attempts, first and last
// failure, original queue and id) plus the original exchange and routing
// key, persistent and mandatory, with publisher confirms: Send returns nil
// only once the broker confirmed the copy routed and stored, and the runtime
// acks the original only then. An unroutable copy is an error, so the
// original is kept. The copy sets aside a TTL, CC, BCC and a foreign user-id
// as retries do, and drops HeaderAttempt, so a message replayed from the
// dead-letter queue starts its attempts afresh (custody-attempts keeps the
// count). It drops the diagnostic headers an earlier dead-letter trip left
// (adapters.IsDiagnosticHeader), so it describes its latest failure only;
// the original route kept by retries is read first.
//
// A sink that refuses a message makes the runtime keep the original and try
// again for ever, so a DeadLetter stores whatever any adapter hands it, and
// keeps recoverable what AMQP cannot carry as it is:
//
//   - header names longer than 255 bytes (an AMQP field name is a short
//     string) go into one header, HeaderOriginalHeaders, a JSON object from
//     name to value (invalid UTF-8 there becomes U+FFFD); every other name
//     and value, spaces, Unicode, empty and non-UTF-8 values included, is
//     copied byte for byte;
//   - another adapter's headers named like the broker's own (x-death,
//     x-delivery-count, x-first-death-*, x-last-death-*) are kept as
//     custody-original-<name>: under their own name a copy replayed from
//     the dead-letter queue would start at a stale attempt, and the broker
//     would overwrite a text x-death when it dead-letters the copy;
//   - an x-death that is not the broker's shape (an array of tables, counts
//     numeric) is kept as HeaderOriginalXDeath: RabbitMQ crashes the queue
//     that dead-letters a message carrying one, which would take the
//     dead-letter queue down when it dead-letters the copy (a TTL, a length
//     limit, a reject);
//   - a message id longer than 255 bytes is left off the message-id
//     property (adapters.HeaderOriginalID carries it);
//   - when the copy's properties and headers would not fit the frame (see
//     above, with room for the headers the broker adds if the dead-letter
//     queue dead-letters the copy in turn), headers are left out, largest
//     first, and named with their sizes and the reason in
//     HeaderDroppedHeaders: first the message's own (x-death and the
//     custody-original-* headers included), then, only if the copy would
//     not fit even without those, the diagnostics whose size comes from the
//     message or configuration (original key, id, queue, route, consumer).
//     The body and the other diagnostics (error, attempts, failure times,
//     partition, offset) are always kept; the values left out are lost.
//
// A body larger than the broker's max_message_size is still refused.
//
// [Source.NativeDeadLetter] instead rejects the delivery without requeue,
// so the broker moves it to the queue's own dead-letter exchange and adds
// x-death. It settles the original, so the runtime does not ack it (an Ack
// or Nack of it all the same succeeds without effect). The broker keeps no
// custody diagnostics in that mode (they are logged), and nothing confirms
// the move: a dead-letter exchange that does not exist or routes the
// message nowhere drops it.
//
// # Replaying dead letters
//
// [NewReplay] reads a dead-letter queue: what a DeadLetter wrote, and what
// the broker dead-lettered itself (x-death). [Replay.List] is a dry run
// (basic.get without ack; the broker takes the messages back).
// [Replay.Replay] publishes a copy of each dead letter selected, without the
// diagnostics and with adapters.HeaderReplayOf, with publisher confirms to
// its original queue (or its original route, WithReplayThroughExchange), and
// acks the dead letter only after the confirm, at a bounded rate. RabbitMQ
// does not deduplicate: a run cut short between a confirm and the ack leaves
// at most one duplicate, with the same message-id, which the idempotency
// middleware absorbs.
//
// # Telemetry
//
// Through the MeterProvider of [WithMeterProvider] (the global one by
// default) a Source reports custody.rabbitmq.acked (deliveries acked on the
// wire), custody.rabbitmq.ack.frames (basic.ack frames, by
// rabbitmq.multiple), custody.rabbitmq.acks.dropped (acks not written
// because their channel died or was closing), custody.rabbitmq.rejects
// (basic.nack frames, by rabbitmq.requeue), custody.rabbitmq.deliveries.lost
// (with their channel, or to Close), custody.rabbitmq.reconnects, and for
// its retries' copies custody.rabbitmq.publishes and
// custody.rabbitmq.publish.duration (seconds, until the confirm; by
// custody.rabbitmq.copy, delay_queue or queue, and error: not confirmed,
// refused or not sent), all with messaging.destination.name, its queue. A
// DeadLetter sink reports the last two for its copies (copy dead_letter),
// with its exchange and messaging.rabbitmq.destination.routing_key; a
// Replay for its copies (copy replay), with its dead-letter queue. Logs go
// to WithLogger's logger, slog.Default() by default.
//
// # Tracing
//
// AMQP headers become Delivery.Headers as strings (text as is, numbers in
// decimal, nested tables such as x-death as JSON), so W3C trace context
// (traceparent, tracestate) published in the headers reaches the runtime's
// processing span once a propagator is set (OpenTelemetry's default global
// propagator is a no-op; see consumer.WithPropagator).
//
// # Native messages and identity
//
// Delivery.ID is the AMQP message-id property, kept across retries and dead
// letters; publishers should set one, since idempotency keys on it (it is
// empty otherwise). Delivery.Native holds the amqp091 Delivery (type
// amqp.Delivery; reach it with consumer.Message.As). Its Acknowledger is
// removed: settle only through the runtime.
package rabbitmq
