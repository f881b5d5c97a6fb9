// Package memory is an embedded message broker with real lease semantics:
// the default broker for custody's quickstart, the reference adapter for the
// conformance suite, and a fast, faithful broker for testing your own
// handlers without infrastructure.
//
// # Semantics
//
// A [Broker] holds named queues. A received message stays invisible for the
// queue's lease (its visibility timeout, with millisecond granularity); if it
// is not acked by then it is delivered again, to whichever consumer asks
// next, and the earlier delivery is lost (its handler's context is cancelled
// and its ack has no effect). Leases can be extended while work runs; a nack
// makes a message visible again after a delay. Every message counts its
// receives, so the runtime knows the attempt number across consumers.
//
// FIFO queues deliver each group (Message.Key) in publish order and hold the
// group back while one of its messages is in flight; every message published
// to one needs a Key. A queue with MaxReceiveCount moves a message to its
// DeadLetterQueue instead of delivering it again, as an SQS redrive policy
// does; as with SQS, the two queues must be of the same type, FIFO or
// standard.
//
// # Testing with it
//
// [Source.SetFaults] makes acks, nacks, extensions or receives fail;
// [Source.Crash] makes a consumer vanish without acking, as a killed process
// does; [DeadLetterQueue.SetFault] makes dead-letter writes fail.
// [Broker.Stats] and [Broker.Messages] show what the broker holds.
//
// A handler test publishes its messages, runs a consumer on a Source, and
// waits with [Broker.WaitEmpty] until the queue is empty (every message
// acked, dead-lettered ones included, since the runtime acks the original
// after the dead-letter write) before it checks the handler's effects and
// the dead-letter queue. A retry policy with a short constant
// backoff keeps retries from slowing the test.
//
// # Replaying dead letters
//
// [Broker.Replay] returns a [Replay] of a dead-letter queue. Its List is a
// dry run: the dead letters with their diagnostics (adapters.ReadDeadLetter),
// read without a receive; adapters.GroupDeadLetters groups them by error,
// consumer and hour. Its Replay moves a selection (adapters.ReplayOptions:
// Select, Max, a Rate of 10 a second by default) back to the queues named
// in their adapters.HeaderOriginalQueue header, in the order they were
// written, with their IDs, keys and headers, without the diagnostics (or
// with them packed into adapters.HeaderReplayDiagnostics), and marked with
// adapters.HeaderReplayOf. Each move is one step under the broker's lock, so
// a replay cut short and run again moves every dead letter exactly once.
// Backlog of a [Source] reports the queue's visible and in-flight messages
// and the age of the oldest visible one.
//
// Nothing is persisted: the broker lives as long as the process. The IDs it
// generates for messages published without one carry a random prefix per
// broker, so they do not repeat after a restart: an idempotency store keyed
// on message IDs (Redis, PostgreSQL) may outlive the broker.
package memory
