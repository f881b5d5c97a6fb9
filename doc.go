// Package custody is a consumer runtime for message brokers. It keeps custody
// of every message from the moment it is received until its effect is
// durable, and only then acknowledges it.
//
// This package holds documentation only; the code lives in the packages below.
//
// # What custody guarantees
//
// This section is the contract; the README and the docs link here rather
// than restate it.
//
//   - Effect, then ack. A message is acknowledged only after its handler
//     returned nil, or after the dead-letter destination confirmed it holds a
//     copy; a failed dead-letter write keeps the original. This is
//     at-least-once delivery, the default and the only mode that cannot lose
//     work. (RabbitMQ's native dead-lettering is the one exception to the
//     confirmation: the broker moves a rejected message without a confirm,
//     and drops it if its dead-letter exchange routes it nowhere.)
//   - Nothing is lost by the consumer. If the process dies at any point,
//     every message whose effect did not complete is delivered again by the
//     broker.
//   - Leases are kept alive while, and only while, work runs. Every held
//     delivery (SQS visibility, JetStream AckWait, a Redis entry's idle
//     time, the memory broker's lease) is renewed at a third of its lease,
//     in batches, by one scheduler; a renewal that fails without the broker
//     saying the lease is gone is tried again while the lease lasts;
//     renewals stop before the ack; a lost lease cancels the handler's
//     context with a cause that says so.
//   - Offsets are committed only for durable prefixes. On Kafka the committed
//     offset never passes a record that is still running, even when later
//     records finished first, and a revoked partition is never committed by
//     its old owner.
//   - Poison messages leave the stream: after bounded retries with backoff, or
//     at once for errors marked permanent, they go to the dead-letter
//     destination (consumer.WithDeadLetter) with diagnostics, and stop
//     stalling their queue or partition. Without a destination (and without
//     a broker redrive policy) they are retried at the backoff's pace for
//     ever; New warns about it.
//   - A fault around the handler is not the message's fault (see Faults):
//     it uses up no attempt and dead-letters nothing.
//   - Order is kept where the broker promised it (Kafka partitions, SQS FIFO
//     groups, memory FIFO queues), and can be asked for per message key.
//     When a delivery is lost, the deliveries of its key queued behind it
//     are given back rather than run ahead of its redelivery.
//   - Shutdown drains: cancelling Run's context, or Consumer.Shutdown, stops
//     receiving, lets running handlers finish, acks them, gives back the
//     rest, and returns with no goroutine left behind.
//
// What custody does not guarantee:
//
//   - Exactly-once in general. A crash between the effect and the ack
//     repeats the effect; so do lost acks and rebalances. Acks are sent in
//     batches, so that window includes a batch's wait (a millisecond or less
//     on most brokers, 20 ms on SQS, the commit linger and a round trip on
//     Kafka: each adapter's documentation gives its figure). custody absorbs
//     such duplicates with an idempotency layer, and offers exactly-once
//     only within a named scope: an effect written to PostgreSQL in the same
//     transaction as its deduplication record (package idempotency/pgtx).
//   - One dead-letter copy per message. The copy is written first and the
//     original acked after; a crash or a failed ack between the two brings
//     the original back, and it is dead-lettered again. Deduplicate dead
//     letters by their original id (the custody-original-id header) where a
//     second copy matters.
//   - That a handler which ignores its context stops. Run waits for it;
//     Shutdown returns when its own context ends, while Run still waits.
//   - Order across keys, partitions or queues, or on brokers that promise
//     none, unless consumer.OrderByKey is asked for.
//
// At-most-once exists only as an explicit, loudly named option
// (consumer.WithAtMostOnceAckBeforeProcessingUnsafe) for data where losing
// some is acceptable.
//
// # The moving parts
//
//   - [github.com/custody-go/custody/consumer]: what users hold. Handler,
//     Message, Consumer, options, retry policy, dead-letter routing, ordering.
//   - [github.com/custody-go/custody/adapters]: the small contract brokers
//     implement; adapters translate, the runtime decides policy.
//   - [github.com/custody-go/custody/adapters/memory]: the embedded broker with
//     real lease semantics, for the quickstart and for testing handlers.
//   - [github.com/custody-go/custody/adapters/awssqs],
//     [github.com/custody-go/custody/adapters/rabbitmq],
//     [github.com/custody-go/custody/adapters/kafka],
//     [github.com/custody-go/custody/adapters/jetstream] and
//     [github.com/custody-go/custody/adapters/redisstream]: the broker
//     adapters. Each also offers a dead-letter destination (NewDeadLetter)
//     and, for operators, its backlog and a replay of its dead letters
//     (NewReplay).
//   - [github.com/custody-go/custody/adapters/adaptertest]: the conformance
//     suite every adapter passes.
//   - [github.com/custody-go/custody/idempotency]: deduplication middleware and
//     stores (memory, Redis, PostgreSQL), and exactly-once in scope for an
//     effect written to PostgreSQL (package idempotency/pgtx).
//   - [github.com/custody-go/custody/lease]: the lease keeper, one scheduler
//     for many leases.
//
// # Batches
//
// consumer.NewBatch runs a BatchHandler on up to WithBatchSize messages at
// once (a bulk insert, one produce call) and takes a result per message,
// each then settled on its own, as a single message is: the guarantees
// above hold message by message. The loss of any message's delivery
// cancels the batch; the batch-mates it cut short run again without using
// up an attempt.
//
// # Operations
//
// A Consumer reports its Status (running, paused, connection, backlog) and
// serves it as liveness and readiness handlers; it can be paused and
// resumed, and paused by itself by a kill switch that trips when too large
// a share of attempts fail over a window, then probes before it resumes.
// Dead letters can be replayed to their source queue with each broker's
// NewReplay, and every adapter reports its backlog (custody.backlog.*
// gauges). docs/operations.md is the operator's guide.
//
// # Faults
//
// A handler error marked consumer.Unavailable (a database down, a store
// unreachable), a failed dead-letter write or an idempotency store outage
// waits and tries again without using up an attempt or dead-lettering the
// message. Logs are levelled and rate-limited, so an outage reads as a few
// lines per kind.
//
// # Observability
//
// The runtime records OpenTelemetry metrics (custody.messages.received,
// .redelivered, .settled by outcome, .in_flight, custody.handler.duration,
// custody.handler.panics, custody.handler.unavailable,
// custody.lease.extensions, custody.lease.renewal_failures,
// custody.lease.lost, custody.ack.failures, custody.deadletter.failures,
// custody.batch.size, custody.batch.failed, custody.killswitch.trips and,
// with WithBacklogInterval, custody.backlog.waiting, .in_flight and
// .oldest_age) and one consumer span per handler attempt (per batch, with a
// link to each message's trace, for a batch handler), continuing the trace
// found in the message's headers and carrying, from its start,
// OpenTelemetry's messaging attributes (messaging.system, the queue or
// topic, the message id; a Kafka record's partition and offset). Each
// adapter adds its own under custody.<broker>.* (requests per operation,
// Kafka lag and commits, RabbitMQ frames and reconnects, JetStream and
// Redis pending counts), and the idempotency middleware counts duplicates
// (custody.idempotency.*).
package custody
