// Package rabbitmq is the custody adapter for RabbitMQ, over
// github.com/rabbitmq/amqp091-go: a [Source] that consumes one queue, a
// [DeadLetterExchange] sink, and a native dead-letter mode that rejects into
// the queue's own dead-letter exchange.
//
//	src, err := rabbitmq.New(ctx, "orders",
//		rabbitmq.WithURL("amqp://user:pass@rabbit:5672/"),
//		rabbitmq.WithPrefetch(128),
//		rabbitmq.WithDeclare(rabbitmq.QuorumQueue, nil))
//	dlq, err := rabbitmq.NewDeadLetterExchange(ctx, "", "orders.dlq", rabbitmq.WithURL(...))
//	c, err := consumer.New(src, handler, consumer.WithConcurrency(64), consumer.WithDeadLetter(dlq))
//
// # Connections and the queue
//
// New dials the broker (WithURL, WithConfig, WithTLS) or asks the caller's
// function for a connection (WithDialFunc), opens one channel, sets its
// prefetch (WithPrefetch, default 256; consumer.New refuses a concurrency
// above it, which the adapter reports as Capabilities.MaxUnacked, since the
// extra workers could never get a message; keep it at least the consumer's
// concurrency) and starts consuming with manual acks. By default it only
// checks that the queue exists; WithDeclare declares it, classic or quorum,
// with arguments. New fails if the first connection or the check fails;
// later failures are repaired in the background.
//
// # Acks are coalesced, and never cover an unfinished delivery
//
// Delivery tags on a channel grow one by one, and a basic.ack with
// multiple=true settles every outstanding tag up to the one it names. The
// adapter tracks each channel's tags with a completion-prefix tracker: when
// the runtime acks a delivery the adapter only records it, and once a
// contiguous run of finished tags from the oldest outstanding one is long
// enough (a quarter of the prefetch, at most 64) or a short linger passed
// (5 ms), it sends one multiple=true ack naming the last tag of the run. A
// tag whose handler has not finished stops the run, so no ack ever covers
// it. Finished deliveries stuck behind it are acked one by one when the run
// has not moved for a while (100 ms) or when they fill three quarters of the
// prefetch window, so one slow message does not stall the channel. Rejects
// (requeues and native dead letters) go out at once, one by one. Close sends
// every ack already decided before closing the channel. See
// WithAckCoalescing.
//
// Ack returns once the ack is recorded: AMQP acks are not confirmed by the
// broker, so sending it a few milliseconds later changes no guarantee. If
// the channel dies first, the message is redelivered (at least once).
//
// # Reconnecting without stale acks
//
// Each connection and channel is a generation, and every delivery carries
// the generation it came from. When the connection or channel dies (or the
// broker cancels the consumer), every delivery of that generation is lost:
// its handler's context is cancelled with a cause wrapping
// adapters.ErrConnectionLost, its pending ack is dropped and counted (the
// broker redelivers the message), and an Ack or Nack that arrives later for
// it is refused with ErrConnectionLost instead of being sent on the new
// channel, where the same tag names a different message. The adapter then
// redials with exponential backoff (WithReconnectBackoff) and resumes.
// Every amqp091 notification channel it registers is buffered for all the
// library can send on it and read by the adapter, so the client never
// blocks on them. Automatic recovery in amqp091 (Config.Recovery) is
// refused: it would reuse a channel behind the adapter's back.
//
// # Attempts
//
// Delivery.Attempt counts deliveries, 1 on the first. Quorum queues count
// redeliveries in x-delivery-count; classic queues only flag a redelivery,
// which counts as one more attempt (a lower bound). Retries are republished
// copies carrying HeaderAttempt, so their count is exact on both queue types.
// Like the broker, the count includes deliveries that were prefetched but
// never handled before a shutdown or a lost connection.
//
// # Retries: in place or through a delay queue
//
// Capabilities report NackDelay, so the runtime hands a failed delivery back
// with Nack(delay) and frees its worker at once. For a delay up to
// WithDelayQueueThreshold (default 5 s) the adapter keeps the delivery
// unacked (it holds a prefetch slot, no worker), then publishes its next
// attempt to the queue and acks the original after the broker confirmed
// the copy. Longer delays publish the copy at once to a delay queue
// (named "<queue>.custody-delay.<ms>ms", durable, created on first use)
// whose message TTL is the delay rounded up to a fixed ladder of steps and
// which dead-letters back to the queue; the original is acked after the
// confirm. So do short delays once half the prefetch window already waits
// in place (with a prefetch of 1, every delay), so that waiting retries
// never starve the channel. A delay-queue publish the broker does not
// confirm within 30 s (a resource alarm blocks publishers) is abandoned, so
// that Nack returns, and the retry waits in place instead; when the copy
// cannot be published after an in-place wait, the original is requeued
// (basic.nack, requeue=true). A delivery waiting in place also holds back
// the coalesced run behind it, so deliveries finished after it are acked one
// by one after the straggler wait. Nack with no delay requeues (basic.nack,
// requeue=true). The adapter never holds a delivery past three quarters of
// the consumer timeout
// (WithConsumerTimeout, RabbitMQ's default 30 min), where the broker would
// close the channel: it uses the delay queue instead, or, under
// WithoutDelayQueues, cuts the wait short and logs a warning. It also warns
// when deliveries stay unacked for more than half the consumer timeout.
//
// Republished copies go through the default exchange; they keep the body,
// the properties and the headers, drop the broker's own headers
// (x-delivery-count, x-death), and move aside to custody headers what the
// broker would act on again: a per-message TTL (HeaderOriginalExpiration),
// the CC and BCC headers, which would route the copy to more queues
// (HeaderOriginalCC, HeaderOriginalBCC), and a user-id other than the
// publishing user's, which the broker would refuse (HeaderOriginalUserID).
// They record the original exchange and routing key (HeaderOriginalExchange,
// HeaderOriginalRoutingKey). Publishing uses a connection of its own, so a
// broker that blocks publishers under a resource alarm does not also hold
// back the consumer's acks.
//
// # Dead letters
//
// A [DeadLetterExchange] publishes the original body and properties with
// the shared diagnostic headers (adapters.Diagnostics: error, attempts,
// first and last failure, original queue and id) plus the original exchange
// and routing key, persistent and mandatory, with publisher confirms: Send
// returns nil only once the broker confirmed the copy was routed and
// stored, and the runtime acks the original only then. An unroutable copy is
// an error, so the original is kept. The copy sets aside a TTL, CC, BCC and a
// foreign user-id as retries do, and drops HeaderAttempt, so a message
// replayed from the dead-letter queue starts its attempts afresh
// (custody-attempts keeps the count).
//
// [Source.NativeDeadLetter] instead rejects the delivery without requeue,
// so the broker moves it to the queue's own dead-letter exchange and adds
// x-death; it marks the delivery settled so the runtime does not ack it.
// The broker keeps no custody diagnostics in that mode (they are logged),
// and nothing confirms the move: a dead-letter exchange that does not exist
// or routes the message nowhere drops it.
//
// # Tracing
//
// AMQP headers become Delivery.Headers as strings (text as is, numbers in
// decimal, nested tables such as x-death as JSON), so W3C trace context
// (traceparent, tracestate) published in the headers reaches the runtime's
// processing span
// (once a propagator is set: OpenTelemetry's default global propagator is a
// no-op; see consumer.WithPropagator).
//
// # Native messages and identity
//
// Delivery.ID is the AMQP message-id property, kept across retries and dead
// letters; publishers should set one, since idempotency keys on it (it is
// empty otherwise). Delivery.Native holds the amqp091 Delivery (type
// amqp.Delivery; reach it with consumer.Message.As). Its Acknowledger is
// removed: settle only through the runtime.
package rabbitmq
