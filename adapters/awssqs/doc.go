// Package awssqs is the custody adapter for Amazon SQS, over
// github.com/aws/aws-sdk-go-v2/service/sqs.
//
// A [Source] reads one queue through a client you own (an *sqs.Client, or
// anything with the methods of [Client]); the runtime in package consumer
// drives it:
//
//	client := sqs.NewFromConfig(awsCfg)
//	src, err := awssqs.New(ctx, client, queueURL)
//	dlq, err := awssqs.NewDeadLetter(ctx, client, dlqURL)
//	c, err := consumer.New(src, handler,
//		consumer.WithConcurrency(32),
//		consumer.WithDeadLetter(dlq))
//	err = c.Run(ctx)
//
// # Receiving
//
// Each Receive is one ReceiveMessage call, long-polling (20 s by default)
// for up to ten messages, or fewer when the runtime has less room; it
// returns what that call brought. The runtime runs up to eight Receive
// calls at once on a standard queue, one on a FIFO queue (WithPollers). The
// Source fetches nothing ahead: every message it received is in the
// runtime's hands, its lease kept by the runtime, or already visible again.
// A Receive whose context ends (shutdown) while its call is in flight
// returns at once and hands out nothing; the call's answer, when it comes,
// is made visible again at once. Close cuts the calls still in flight: a
// message SQS had picked for a cut call stays invisible until its
// visibility timeout runs out (SQS does not say which messages it picked).
//
// Every delivery carries the message's attributes as Headers (Binary ones in
// base64), which is where the runtime finds the W3C trace context
// (traceparent, tracestate; once a propagator is set, see
// consumer.WithPropagator); Attempt is SQS's ApproximateReceiveCount, asked
// for through both AttributeNames and MessageSystemAttributeNames (with the
// other system attributes the Source uses, and AWSTraceHeader, the X-Ray
// trace the message was sent in); Key is the FIFO MessageGroupId. [Message], [GroupID] and [DeduplicationID] reach
// the received types.Message from a handler's consumer.Message (m.As(&msg)
// does too).
//
// # Leases
//
// A received message is invisible to other consumers for the queue's
// visibility timeout (read when the Source is created, or set with
// WithVisibilityTimeout): the Source's lease. The runtime renews every
// message it holds, running or waiting, at a third of it, through Extend
// (ChangeMessageVisibilityBatch, ten entries a request). Renewals stop
// before the delete. SQS keeps a message invisible for at most 12 hours per
// receive, counted from the ReceiveMessage call (SQS starts them before the
// answer arrives). The Source announces a cap (Capabilities.MaxLeaseAge)
// shorter by the long poll's wait and a few seconds, so the runtime, which
// counts from Delivery.ReceivedAt, gives up first: the handler's context is
// cancelled with lease.ErrMaxHold (or, should the adapter's count run out
// first, [ErrMaxVisibility]; both wrap adapters.ErrLeaseLost) and the
// message comes back.
//
// A batch entry SQS refuses because the receipt handle no longer names an
// in-flight message (the timeout ran out and the message was received again
// or deleted) fails alone, wrapping adapters.ErrLeaseLost: the runtime
// loses that delivery, and the other entries stand. An entry SQS fails on
// its side fails alone too, and a request that fails for a passing reason
// (the network, throttling, a server error) fails whole: [Source.IsRetryable]
// reports both worth another try, and the runtime sends them again; the
// Source never retries. A lost delivery's receipt handle, which may be
// stale, is never sent in a visibility change again. A running message
// whose renewal SQS has not answered when a twelfth of the timeout is left
// is lost by the runtime's lease keeper, so its handler's context is
// cancelled before SQS can hand the message to another consumer. Delete and
// visibility requests time out after 30 s, a receive after its long poll's
// wait plus 30 s: a request SQS never answers holds neither the runtime,
// its shutdown, nor a poller (a FIFO queue has only one); it fails like any
// other.
//
// # Acks, retries and shutdown
//
// The Source declares batches of ten for Ack, Nack and Extend, up to four
// calls of each at once; the runtime waits at most WithAckLinger (20 ms) to
// fill a batch of acks and WithNackLinger (10 ms) one of nacks, and each
// batch is one request. Ack deletes with DeleteMessageBatch, so at steady
// state a message costs a tenth of a receive and a tenth of a delete: 0.2
// requests. Nack makes each message visible again after its retry delay
// (ChangeMessageVisibilityBatch, a timeout per entry), so a retry waits in
// SQS, not in the process. On FIFO queues the runtime retries in place
// instead, to keep group order.
//
// At shutdown the runtime nacks with no delay what did not finish: other
// consumers get it at once instead of after the visibility timeout.
//
// # FIFO queues
//
// On a FIFO queue (name ending in .fifo) every delivery's OrderingKey is its
// MessageGroupId: the runtime runs one message per group at a time, in
// order, while groups run concurrently; SQS itself never hands out a group's
// next message while one is in flight. Each poll carries its own
// ReceiveRequestAttemptId, which the SDK's retries of that poll reuse: when
// a receive's answer is lost, the retry gets the same messages back instead
// of leaving them invisible, and their groups blocked, for a visibility
// timeout.
//
// # Dead letters
//
// Two ways, pick one per consumer:
//
//   - [NewDeadLetter] returns a [DeadLetter] that sends a copy (body,
//     attributes, AWSTraceHeader, FIFO group) to a queue you name, with the
//     runtime's diagnostics in one JSON attribute (custody-diagnostics); the
//     runtime deletes the original only after SQS accepted the copy. A
//     message dead-lettered again after a replay gets fresh diagnostics. It
//     also takes other brokers' deliveries, carrying in the diagnostics what
//     SQS would refuse. NewDeadLetter checks that the queue exists and can
//     be read, so a wrong URL fails at start-up, not at the first poison
//     message.
//   - [Source.NativeDeadLetter] leaves it to the queue's redrive policy: the
//     message is made visible again and SQS moves it when its receive count
//     passes maxReceiveCount. It checks at start-up that maxReceiveCount
//     equals the consumer's MaxAttempts.
//
// # Replaying dead letters
//
// [NewReplay] returns a [Replay] of a dead-letter queue. Its List is a dry
// run: the dead letters with their diagnostics, received for a moment and
// given back (SQS cannot show a message otherwise; each List adds one to
// their receive counts). Its Replay moves a selection back to their original
// queues at a bounded rate, one at a time: copy, wait for SQS's
// confirmation, delete. The copy is the message as it was sent, marked with
// custody-replay-of; FIFO copies keep their group and carry a deduplication
// id derived from the dead letter's id, so that a run repeated after a crash
// within SQS's five-minute deduplication interval sends no second copy. On
// a standard queue such a crash can send one message back twice: see
// [Replay.Replay].
//
// # Backlog
//
// [Source.Backlog] asks SQS for the queue's ApproximateNumberOfMessages
// (waiting) and ApproximateNumberOfMessagesNotVisible (in flight) in one
// GetQueueAttributes request; the runtime polls it at a low rate
// (consumer.WithBacklogInterval) for its backlog gauges. SQS's API does not
// tell the age of the oldest message, so none is reported.
//
// # Telemetry
//
// Through the MeterProvider of [WithMeterProvider] (the global one by
// default), with messaging.destination.name set to the queue's name:
//
//   - custody.sqs.requests: SQS requests, by operation (ReceiveMessage,
//     DeleteMessageBatch, ChangeMessageVisibilityBatch, GetQueueAttributes
//     for a backlog poll) and result (ok; empty: a receive that brought
//     nothing; error: the request failed whole);
//   - custody.sqs.entries.failed: batch entries SQS failed, by operation and
//     reason (lease_lost: the receipt handle no longer names a message in
//     flight; sqs: a fault on SQS's side, which the runtime sends again;
//     refused: any other);
//   - custody.sqs.received: messages received;
//   - custody.sqs.released: messages received but not handed out (their
//     Receive gave up, or the Source closed), made visible again.
//
// The runtime's own metrics (package consumer) count what happened to each
// message.
//
// # Cost
//
// SQS bills per request: custody.sqs.requests, or [Stats] in a test,
// counts them; see docs/sqs.md for measured requests per message and
// throughput against raw loops.
package awssqs
