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
// for (at most WithMaxFetch, 64): the server answers at once with what is
// ready. When nothing is, it waits up to WithPollWait (5 s) for one message,
// then pulls the rest of the room without waiting. Nothing is fetched ahead
// of the runtime's asking. The consumer acks explicitly; its MaxAckPending
// is reported as Capabilities.MaxUnacked, so the runtime refuses a
// concurrency above it and holds no more than it by default. MaxAckPending
// counts across every process bound to the consumer: give it at least the
// sum of their in-flight windows (consumer.WithMaxInFlight), or some of
// them will wait for others' acks.
//
// Every delivery carries the message's headers as Headers (the first value
// of each), where the runtime finds the W3C trace context (traceparent,
// tracestate; once a propagator is set, see consumer.WithPropagator). ID is
// "<stream>:<stream sequence>", the same on every redelivery; Attempt is the
// server's NumDelivered; PublishedAt and FirstReceivedAt are the time the
// stream stored the message (JetStream does not say when it first delivered
// it, and it did no earlier). Key is the subject, or a header
// (WithKeyHeader), so consumer.OrderByKey runs one message per subject at
// a time, in stream order; WithOrderedKeys makes that the Source's own
// ordering. A handler reaches the jetstream.Msg with m.As(&msg) (do not ack
// it yourself); [Message] does the same from a Delivery.
//
// # Leases
//
// The consumer's AckWait is the lease: the runtime renews every held
// delivery, running or waiting, at a third of it, with InProgress (+WPI),
// which resets the server's timer to the full AckWait. Renewals ask for the
// server's reply, so a renewal that did not land (the connection was down)
// fails and the runtime tries again while the lease lasts; once the
// connection is back, renewals of what is still held resume. The Source
// keeps, per delivery, when its lease runs out at the earliest (the send
// time of its last answered renewal, or of the pull that fetched it, plus
// AckWait); a renewal asked for after that fails with adapters.ErrLeaseLost
// and is not sent, since the server may have given the message to another
// consumer, whose lease it would extend. Renewals stop before the ack.
//
// A consumer with a BackOff list is refused: the server then times
// redeliveries by BackOff[n] instead of AckWait, which shifts every delayed
// nak of the runtime by BackOff[n] minus AckWait and gives later deliveries
// leases of other lengths than the one the runtime renews by.
//
// # Acks, retries and shutdown
//
// Ack sends each delivery's ack as an acknowledged ack (the "double ack"):
// an entry succeeds only once the server replied that it processed it.
// JetStream has no batched ack, so n acks are n requests and n replies;
// Ack sends them all at once and awaits the replies together, on one
// subscription. The Source asks the runtime (Capabilities.Ack and Nack) to
// make these calls on goroutines of its own, up to 8 at once, each with
// what gathered within 200 µs, so that no handler's worker waits for a
// reply. An ack that is not answered within WithRequestTimeout (10 s)
// fails, and the message may come back. The fire-and-forget ack would save
// the reply; docs/jetstream.md measures what it costs.
//
// Nack naks with the retry policy's delay (NakWithDelay), so a retry waits
// in the server, not in the process, and a bare nak never burns through
// redeliveries in milliseconds. A delivery is settled once: a Nack after its
// Ack (or an Ack after its Nack) fails that entry without a request. An Ack
// or Nack of a delivery one of the package's dead-letter destinations
// settled succeeds without a request (see Dead letters). Acks,
// naks and renewals name their message by stream sequence, so one sent for
// a delivery the server has since handed to another consumer would act on
// that consumer's delivery: a nak or renewal of a delivery whose lease may
// have run out fails with adapters.ErrLeaseLost instead of being sent.
//
// At shutdown the runtime naks with no delay what did not finish. Close
// ends a Receive waiting, gives back at once what a pull brings after that,
// and leaves the connection open.
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
//     consumer's MaxDeliver (which must equal the runtime's MaxAttempts,
//     checked at start-up) and the server's MAX_DELIVERIES advisory.
//     MaxDeliver counts deliveries, including those given back unstarted at
//     shutdown or lost with a connection, so a message may be left there
//     after fewer handler runs than MaxAttempts.
//
// Both report that they settle the original (adapters.OriginalSettler), so
// the runtime does not ack it. A wrapper around them (one that logs its
// writes, say) hides that, and the runtime then acks the original: that Ack,
// like a Nack, succeeds without a request, since the server delivers the
// message no more.
//
// New refuses a consumer with a MaxDeliver limit unless WithMaxAttempts says
// the runtime's MaxAttempts and MaxDeliver is not below it: the server would
// stop delivering a message, with only an advisory, before the runtime
// dead-letters it.
//
// # Reconnects and server restarts
//
// An ack names its message by stream sequence, never by a per-connection
// tag, so an ack sent after a reconnect cannot land on another message.
// Deliveries stay held across a reconnect; their acks and renewals resume
// with the connection. A server that restarts keeps the consumer's state in
// file storage, and redelivers what was unacked once its AckWait ran out.
//
// The Source reports its connection (adapters.Connector) from nats.go's
// status changes (nats.Conn.StatusChanged, which leaves your connection
// handlers alone): connected, reconnecting while the client reconnects,
// disconnected once the connection is closed or draining, or the Source
// closed. The runtime's Status().Ready, and its readiness probe, are false
// while it is not connected.
//
// # Deleting and recreating a stream
//
// Do not delete a stream and create it again under the same name while a
// Source reads it: stop the consumers first (Run has returned), or give the
// new stream another name. An ack, nak or renewal names its message by
// stream name, consumer name and stream sequence, and the new stream numbers
// its messages from 1 again, so one sent for a delivery of the old stream
// acts on the new stream's message of that sequence: an ack settles a
// message no handler ran, which is then never delivered. Nothing in the
// acknowledgement tells the two streams apart, so the Source could only
// guard against this with a request to the server before every Ack, Nack
// and Extend, and would still race with the deletion. (A durable consumer
// deleted and created again on the same stream is harmless: a sequence
// still names the same message.)
//
// # Backlog and metrics
//
// [Source.Backlog] (adapters.BacklogReporter), which the runtime polls for
// its custody.backlog.* gauges and Status().Backlog, asks the server for the
// consumer's info: NumPending is the messages waiting, NumAckPending those
// in flight (held, or given back and waiting to be delivered again), and,
// while messages wait, a second request reads the next one the consumer
// will deliver, whose timestamp gives the oldest waiting message's age.
//
// custody.jetstream.pending (gauge: the consumer's backlog as of the latest
// fetch) and custody.jetstream.requests (counter, by request kind and
// error), with the stream and consumer names; [Source.Stats] counts the
// same for tests and benchmarks. See docs/jetstream.md for configuration,
// costs and what JetStream adds and lacks beside SQS.
package jetstream
