// Package awssqs is the custody adapter for Amazon SQS, over
// github.com/aws/aws-sdk-go-v2/service/sqs.
//
// A [Source] reads one queue through a client you own (an *sqs.Client, or
// anything with the methods of [Client]); the runtime in package consumer
// drives it:
//
//	client := sqs.NewFromConfig(awsCfg)
//	src, err := awssqs.New(ctx, client, queueURL)
//	dlq, err := awssqs.NewDeadLetterQueue(ctx, client, dlqURL)
//	c, err := consumer.New(src, handler,
//		consumer.WithConcurrency(32),
//		consumer.WithDeadLetter(dlq))
//	err = c.Run(ctx)
//
// # Receiving
//
// Each ReceiveMessage call long-polls (20 s by default) for up to ten
// messages. Up to eight calls run at once on a standard queue, one on a FIFO
// queue (WithPollers), one per ten messages
// of room the runtime has, so receives stay full while earlier batches are
// handled, and no call asks for more than there is room for. A poll may
// still come back after the Receive that started it returned, and the runtime
// asks again only when a batch fits; the Source renews the visibility of
// messages waiting for it at a third of the timeout (Stats.BufferRenewed),
// so none runs out unseen, and hands none out while such a renewal is on the
// wire, so that it cannot land after the runtime's ack or nack. Such a
// renewal not answered when a twelfth of a message's timeout is left is
// given up, and the message handed out lost (adapters.ErrLeaseLost): SQS may
// give it to another consumer once its visibility runs out, and may even
// accept a renewal with the stale receipt handle after that.
//
// Every delivery carries the message's attributes as Headers (Binary ones in
// base64), which is where the runtime finds the W3C trace context
// (traceparent, tracestate; once a propagator is set, see
// consumer.WithPropagator); Attempt is SQS's ApproximateReceiveCount, asked
// for through both AttributeNames and MessageSystemAttributeNames (with the
// other system attributes the Source uses, and AWSTraceHeader, the X-Ray
// trace the message was sent in); Key is the FIFO MessageGroupId. [Message],
// [GroupID] and [DeduplicationID] reach the received types.Message from a
// handler's consumer.Message (m.As(&msg) does too).
//
// # Leases
//
// A received message is invisible to other consumers for the queue's
// visibility timeout (read from the queue when the Source is created, or set
// with WithVisibilityTimeout). That is the Source's lease: the runtime renews
// every message it holds, running or waiting, at a third of it, through
// Extend, with ChangeMessageVisibilityBatch requests of up to ten. Renewals
// stop before the delete, and SQS's limit of 12 hours of invisibility per
// receive is respected, counted from when the ReceiveMessage call was made
// (SQS starts it before the answer arrives). The Source announces a cap
// (Capabilities.MaxLeaseAge) shorter by the long poll's wait and a few
// seconds, so the runtime, which counts from Delivery.ReceivedAt, gives up
// first: the handler's context is cancelled with the runtime's
// lease.ErrMaxHold (or, should the adapter's count run out first,
// [ErrMaxVisibility]; both wrap adapters.ErrLeaseLost) and the message comes
// back.
//
// A batch entry SQS refuses because the receipt handle no longer names an
// in-flight message (the timeout ran out and the message was received again
// or deleted) marks that delivery lost with adapters.ErrLeaseLost and is
// counted in [Stats].LeaseLost; the other entries of the batch stand. Entries
// that fail on SQS's side are retried alone, a few times (so is a retry
// request that fails whole). A message waiting in the Source whose renewals
// fail until its visibility timeout runs out is marked lost as well: another
// consumer may have it by then. A lost delivery's receipt handle is never
// sent in a visibility change again, since it may be stale. A running
// message whose renewal SQS has not answered when a twelfth of the timeout
// is left is marked lost by the runtime's lease keeper, so its handler's
// context is cancelled before SQS can hand the message to another consumer.
// Every delete and visibility request times out after 30 s, so a request SQS
// never answers holds neither the runtime nor its shutdown; it fails like
// any other. A receive times out after its long poll's wait plus 30 s, so a
// hung poll gives its poller back (a FIFO queue has only one).
//
// # Acks, retries and shutdown
//
// Ack deletes with DeleteMessageBatch. The runtime gathers acks into batches
// of ten, waiting at most WithAckLinger (20 ms) to fill one, so at steady
// state a message costs one tenth of a receive and one tenth of a delete:
// 0.2 requests. Nack makes a message visible again after the retry delay
// (ChangeMessageVisibilityBatch), so a retry waits in SQS, not in the
// process; nacks from concurrent workers share requests (WithNackLinger).
// FIFO queues are retried in place by the runtime instead, to keep group
// order.
//
// At shutdown the runtime nacks with no delay what did not finish, and Close
// releases what was received but never handed out: other consumers get them
// at once instead of after the visibility timeout.
//
// # FIFO queues
//
// On a FIFO queue (name ending in .fifo) every delivery's OrderingKey is its
// MessageGroupId: the runtime runs one message per group at a time, in order,
// while groups run concurrently. SQS itself never hands out a group's next
// message while one is in flight. Each poll carries its own
// ReceiveRequestAttemptId, which the SDK's retries of that poll reuse: when
// a receive's answer is lost, the retry gets the same messages back instead
// of leaving them invisible, and their groups blocked, for a visibility
// timeout.
//
// # Dead letters
//
// Two ways, pick one per consumer:
//
//   - [DeadLetterQueue] sends a copy (body, attributes, AWSTraceHeader, FIFO
//     group) to a queue you name, with the runtime's diagnostics in one JSON
//     attribute (custody-diagnostics); the runtime deletes the original only
//     after SQS accepted the copy. A message dead-lettered again after a
//     replay gets fresh diagnostics, none of the earlier trip's. It also takes
//     other brokers' deliveries, carrying in the diagnostics what SQS would
//     refuse (see [NewDeadLetterQueue]). NewDeadLetterQueue checks that the
//     queue exists and can be read, so a wrong URL fails at start-up rather
//     than at the first poison message.
//   - [Source.Redrive] leaves it to the queue's redrive policy: the message is
//     made visible again and SQS moves it when its receive count passes
//     maxReceiveCount. It checks at start-up that maxReceiveCount equals the
//     consumer's MaxAttempts. A release not answered before the handler's
//     context ends (at the shutdown deadline) marks the delivery lost: the
//     message may be with another consumer already, so its receipt handle is
//     not used again (the runtime does not nack it).
//
// # Cost
//
// SQS bills per request. [Stats] counts them; see docs/sqs.md for measured
// requests per message and throughput against raw loops.
package awssqs
