// Package jetstream is the custody adapter for NATS JetStream, over
// github.com/nats-io/nats.go/jetstream.
//
// A [Source] reads one durable pull consumer of a stream through a
// jetstream.JetStream you own; the runtime in package consumer drives it:
//
//	nc, err := nats.Connect(url)
//	js, err := jetstream.New(nc)
//	src, err := custodyjs.New(ctx, js, "ORDERS", "shipper",
//		custodyjs.WithCreate(jetstream.ConsumerConfig{AckWait: 30 * time.Second}))
//	dlq, err := custodyjs.NewDeadLetter(ctx, js, "ORDERS_DLQ.shipper")
//	c, err := consumer.New(src, handler,
//		consumer.WithConcurrency(64),
//		consumer.WithDeadLetter(dlq))
//	err = c.Run(ctx)
//
// (custodyjs is this package, renamed beside nats.go's own jetstream.)
//
// # Receiving
//
// Receive makes a no-wait pull for as many messages as the runtime has room
// for (at most WithMaxFetch, 64); when nothing is ready, it waits up to
// WithPollWait (5 s) for one message, then pulls the rest of the room
// without waiting: a busy consumer costs one pull per batch, and an idle
// one gets a message as soon as it is published. Nothing is fetched ahead
// of the runtime's asking. The consumer's MaxAckPending is reported as
// Capabilities.MaxUnacked, so the runtime refuses a concurrency above it
// and holds no more than it by default. MaxAckPending counts across every
// process bound to the consumer: give it at least the sum of their
// in-flight windows (consumer.WithMaxInFlight), or some will wait for
// others' acks.
//
// Headers are the message's headers (the first value of each), where the
// runtime finds the W3C trace context (see consumer.WithPropagator). ID is
// "<stream>:<stream sequence>", the same on every redelivery; Attempt is
// the server's NumDelivered; PublishedAt and FirstReceivedAt are when the
// stream stored the message (JetStream does not say when it first delivered
// it, and it did no earlier). Key is the subject, or a header
// (WithKeyHeader), so consumer.OrderByKey runs one message per subject at a
// time, in stream order; WithOrderedKeys makes that the Source's own
// ordering. A handler reaches the jetstream.Msg with m.As(&msg) (do not ack
// it yourself); [Message] does the same from a Delivery.
//
// # Leases
//
// The consumer's AckWait is the lease: the runtime renews every held
// delivery at a third of it with InProgress (+WPI), which resets the
// server's timer to the full AckWait. Renewals await the server's reply, so
// one that did not land fails and the runtime tries again while the lease
// lasts. Acks, naks and renewals name their message by stream sequence, so
// one sent after the server gave the message to another consumer would act
// on that consumer's delivery. The Source therefore keeps, per delivery,
// when its lease runs out at the earliest (the send time of its last
// answered renewal, or of its pull, plus AckWait); a renewal or nak asked
// for after that fails with adapters.ErrLeaseLost and is not sent.
//
// A consumer with a BackOff list is refused: the server would time
// redeliveries by BackOff[n] instead of AckWait, which shifts every delayed
// nak by BackOff[n] minus AckWait and gives later deliveries leases other
// than the one the runtime renews by.
//
// # Acks, retries and shutdown
//
// Ack sends acknowledged acks (the "double ack"): an entry succeeds only
// once the server replied. JetStream has no batched ack, so n acks are n
// requests; Ack sends them all at once and awaits the replies together, on
// one subscription. Capabilities.Ack and Nack ask the runtime to make these
// calls on its own goroutines, up to 8 at once, each with what gathered
// within 200 µs, so that no worker waits for a reply. An ack not answered
// within WithRequestTimeout (10 s) fails, and the message may come back.
// docs/jetstream.md measures what the fire-and-forget ack would save.
//
// Nack naks with the retry policy's delay (NakWithDelay), so a retry waits
// in the server, not in the process, and a nak never burns through
// redeliveries in milliseconds. A delivery is settled once: a Nack after
// its Ack (or an Ack after its Nack) fails that entry without a request. At
// shutdown the runtime naks with no delay what did not finish. Close ends a
// Receive waiting, gives back at once what a pull brings after that, and
// leaves the connection open.
//
// # Dead letters
//
// Two ways, pick one per consumer:
//
//   - [NewDeadLetter] publishes a copy (body, headers, diagnostics) to a
//     subject a stream captures (or that it creates, WithCreateStream) and
//     waits for the stream's PubAck; it then terminates the original
//     (+TERM). A failed publish keeps the original.
//   - [Source.NativeDeadLetter] leaves poison messages in the stream, to the
//     consumer's MaxDeliver (which must equal the runtime's MaxAttempts) and
//     the server's MAX_DELIVERIES advisory. MaxDeliver counts deliveries,
//     including those given back unstarted or lost with a connection, so a
//     message may be left there after fewer handler runs than MaxAttempts.
//
// Both settle the original themselves (adapters.OriginalSettler), so the
// runtime does not ack it. A wrapper that hides this makes the runtime ack
// it: that Ack, like a Nack, succeeds without a request.
//
// New refuses a consumer with a MaxDeliver limit unless WithMaxAttempts
// says the runtime's MaxAttempts and MaxDeliver is not below it: the server
// would otherwise stop delivering a message, with only an advisory, before
// the runtime dead-letters it.
//
// # Reconnects and server restarts
//
// Since an ack names its message by stream sequence, never by a
// per-connection tag, one sent after a reconnect cannot land on another
// message. Deliveries stay held across a reconnect; their acks and renewals
// resume with the connection. A server that restarts keeps the consumer's
// state in file storage, and redelivers what was unacked once its AckWait
// ran out.
//
// The Source reports its connection (adapters.Connector) from nats.go's
// status changes (nats.Conn.StatusChanged, which leaves your connection
// handlers alone); the runtime's Status().Ready, and its readiness probe,
// are false while it is not connected.
//
// # Deleting and recreating a stream
//
// Do not delete a stream and create it again under the same name while a
// Source reads it: stop the consumers first, or give the new stream another
// name. The new stream numbers its messages from 1 again, so an ack sent
// for a delivery of the old stream settles the new stream's message of that
// sequence, which no handler ran and which is then never delivered. Nothing
// in the acknowledgement tells the two streams apart; guarding against it
// would take a request before every Ack, Nack and Extend, and would still
// race with the deletion. (A durable consumer deleted and created again on
// the same stream is harmless: a sequence still names the same message.)
//
// # Backlog and metrics
//
// [Source.Backlog] (adapters.BacklogReporter) asks the server for the
// consumer's info: NumPending is the messages waiting, NumAckPending those
// in flight, and, while messages wait, a second request reads the next one
// the consumer will deliver, whose timestamp gives the oldest waiting
// message's age.
//
// Metrics: custody.jetstream.pending (gauge: the consumer's backlog as of
// the latest fetch) and custody.jetstream.requests (counter, by request
// kind and error), with the stream and consumer names; [Source.Stats]
// counts the same for tests and benchmarks. docs/jetstream.md covers
// configuration, costs and what JetStream adds and lacks beside SQS.
package jetstream
