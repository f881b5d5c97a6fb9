// Package kafka is the custody adapter for Apache Kafka, over franz-go
// (github.com/twmb/franz-go/pkg/kgo). A [Source] consumes a consumer group's
// topics; a [DeadLetter] produces records that will not be processed to a
// dead-letter topic.
//
//	src, err := kafka.New(ctx,
//		kafka.WithBrokers("kafka-1:9092", "kafka-2:9092"),
//		kafka.WithGroup("payments-service"),
//		kafka.WithTopics("payments"),
//		kafka.WithOrderingScope(kafka.ByKey),
//		kafka.WithClientOptions(kgo.DialTLSConfig(tlsCfg), kgo.SASL(mechanism)),
//	)
//	dlq, err := src.NewDeadLetter(ctx, "payments.dlq")
//	c, err := consumer.New(src, handler, consumer.WithConcurrency(256), consumer.WithDeadLetter(dlq))
//
// A group with nothing committed starts at the earliest record (franz-go's
// default); kgo.ConsumeResetOffset(kgo.NewOffset().AtEnd()) through
// [WithClientOptions] starts it at the end.
//
// [New] reaches the cluster within its context, and fails with the cause
// when no broker answers. Later connection trouble does not end the
// Source: franz-go connects again by itself, and the Source logs (see
// [WithLogger]) a broker address it cannot connect to once, not once per
// attempt, and the connection back.
//
// # Ordering
//
// Kafka keeps order per partition. [WithOrderingScope] chooses which
// records must not overlap, and the Source tells the runtime through
// Delivery.OrderingKey:
//
//   - [ByPartition] (default): one record at a time per partition, in
//     offset order. Lane "topic/partition".
//   - [ByKey]: records with the same key in a partition run in offset order,
//     different keys run concurrently. Lane "topic/partition/key"; records
//     without a key share the lane "topic/partition".
//   - [Unordered]: no lanes; any records may run at once.
//
// Concurrency inside a partition never weakens commits (next section). A
// retry waits in place with backoff, so its lane stalls and order holds: the
// adapter reports NackDelay=false and the runtime counts attempts itself
// (CountsDeliveries=false: the count restarts when another member takes the
// partition).
//
// By partition, the Source hands out at once no more records of a partition
// than its share of what the runtime holds (consumer.WithMaxInFlight over
// the partitions assigned; at least two), so that a record that runs long (a
// slow call, a retry waiting in place) holds up its own partition only, not
// the runtime's whole in-flight window. By key, a record that runs long
// holds up its own key only: a record waiting behind its key's running one
// costs the broker nothing (nothing is leased, so nothing is renewed), and
// the Source says so (adapters.Capabilities.FreeWhileQueued), so the
// runtime keeps the key's later records out of its in-flight window while
// they wait, and the other keys run on. The unacked bounds (section
// Backpressure) bound them instead: once its partition has
// [WithMaxUnackedPerPartition] records handed out and not acked (512 by
// default), the partition's fetching pauses and the slow key holds up its
// partition, and at [WithMaxUnacked] over all partitions (4096) the runtime
// takes no more records. A partition pauses earlier when the done offsets
// beyond the slow record no longer fit the commit metadata (section
// Commits).
//
// # Commits: durable prefixes only
//
// Each assignment of a partition gets its own completion tracker (an epoch).
// An ack marks a record done; the committed offset is always 1 + the highest
// offset up to which every polled record is done (handled, or written to the
// dead-letter topic). One slow record holds its partition's commit back while
// later records finish; when it finishes the commit jumps past all of them.
// Commits are coalesced, never one request per record: a commit goes a
// linger ([WithCommitLinger], 5ms by default) after a record is marked done,
// with every partition's records marked done meanwhile, one request in
// flight at a time; a failed commit is tried again on the commit interval
// ([WithCommitInterval], 1s by default); a revoked partition is committed
// synchronously, and all are on Close. A crash makes the next owner run
// again what was done since the last commit: about the records running at
// the crash plus a linger's worth (see WithCommitLinger for the trade-off).
// Each commit carries the leader epoch of the last record it covers, as
// franz-go's own commits do, so that the next owner can tell when the log
// was truncated under it (KIP-320).
//
// Ack only marks records done, in process, and returns at once: the Source
// declares no ack batching (zero Capabilities.Ack). The commit is Kafka's
// own acknowledgement, one offset per partition for every partition in one
// OffsetCommit request; its offset, timing and retry (the next commit
// carries the same prefix or a longer one) belong to that protocol, so they
// are the adapter's, as multiple=true acks are the RabbitMQ adapter's: the
// runtime's batching has no notion of a prefix per partition. Nothing is
// leased either, so nothing is renewed: records the Source holds before
// handing them out cost the broker nothing, and a revoke gives them up.
//
// Done offsets beyond the committed one travel in the commit metadata
// (runs of offsets, base64) with the leader epoch their records were
// written under, bounded by [WithMetadataLimit] (4096 bytes, Kafka's
// default offset.metadata.max.bytes); a partition whose metadata could
// outgrow the limit takes no new records until its prefix catches up. After
// a rebalance the next owner skips those records instead of running them
// again, unless fetching starts below the committed offset (the log was
// truncated or recreated, so the offsets name other records). An owner that
// loses the partition before reaching the offsets it inherited writes them
// into its own metadata (as many as fit beside its own), so they survive
// any number of rebalances. A record is skipped only when its offset and
// leader epoch both match: after an unclean leader election rewrote the log
// above the committed offset, the records now at those offsets are of a
// later epoch, and all are handed out. Metadata of the previous format,
// without epochs, is still read (its runs taken to be of the committed
// leader epoch), so a group under a rolling deploy skips no rewritten
// record either.
//
// A transaction's end marker takes an offset: never handed out, it counts as
// done, so the commit reaches the end of the partition (and the lag 0). Read
// committed (kgo.FetchIsolationLevel(kgo.ReadCommitted()) through
// [WithClientOptions]), aborted records are not handed out either, and lag
// counts to the last stable offset.
//
// # Rebalances
//
// On revoke the Source stops handing out the partition's records and
// recalls those handed out ([adapters.Signal.Recall], the latest first; the
// Source is an [adapters.Recaller]): the runtime gives back at once every
// one whose handler has not started (queued in its lane, waiting for a
// worker or for a retry), and a given-back record is not done, so the
// commit stops before it. The revoke then waits up to [WithRevokeDrain]
// (10s by default) for the running handlers only, acks what they finish,
// cancels the rest (cause [adapters.ErrRevoked]), fences the assignment and
// commits its done prefix synchronously. A backlog therefore costs a
// rebalance nothing: the new owner runs it. After the fence nothing of that
// assignment is marked or committed: a late completion is refused with
// ErrRevoked, and the new owner runs the record. Lost partitions (a fatal
// group error) are fenced without a commit. Rebalances are blocked only
// between a poll and the booking of its records under their epoch
// (franz-go's BlockRebalanceOnPoll, released at once; concurrent Receive
// calls poll one at a time, since releasing it releases every poll), so a
// record is never booked under the wrong assignment.
//
// # Data loss
//
// When the broker loses records this consumer already polled (an unclean
// leader election, a log truncated under it), franz-go reports a
// kgo.ErrDataLoss and rewinds the partition. Receive returns that error
// (with any records of other partitions; the runtime logs it), and the
// Source starts a new epoch for the partition: the old log's records in
// flight lose their contexts with cause [ErrRewound] (which wraps
// adapters.ErrRevoked) and their acks mark nothing; fetching resumes at the
// rewind point or the old epoch's commit point, whichever is lower, so that
// every record now in the log is handed out and nothing polled but
// unfinished is committed past. The new epoch commits its start at once,
// even below the old commit, so a restart does not skip the records that
// replaced the lost ones. Old records that finished had their effects;
// that cannot be undone. custody.kafka.rewinds counts these rewinds.
//
// # Backpressure
//
// [WithMaxUnackedPerPartition] (512, or WithMaxUnacked if lower) bounds the
// records of one partition handed out and not acked: while its records
// polled and not acked reach it, the partition's fetching is paused, below
// it resumed (and on revoke, since franz-go keeps pauses across rebalances).
// [WithMaxUnacked] (4096) bounds the records handed out over all
// partitions: at the bound the Source stops polling. A poll takes every
// record the client has fetched (already in memory), and Receive shares
// them out over the partitions; a poll of n records would take them
// partition by partition, and a deep backlog would feed the runtime the
// first partitions alone. A partition therefore holds at most one fetch
// (kgo.FetchMaxPartitionBytes) beyond its bound.
//
// # Operations: connection, pause, assignment, backlog
//
// The Source implements the runtime's optional interfaces, which
// consumer.Status, the readiness probe and the custody.backlog.* gauges
// read:
//
//   - [Source.Connection] (adapters.Connector): connecting until the client
//     first reaches a broker (New returns only then), connected while its
//     last attempt to at least one broker succeeded, reconnecting, with the
//     last attempt's error, once every broker's last attempt failed (a
//     cluster that is down: the group's heartbeats and the fetches notice
//     within a heartbeat interval, kgo.HeartbeatInterval, or a retry
//     backoff), disconnected after Close. A consumer is not ready while it
//     reconnects.
//   - [Source.Pause] and [Source.Resume] (adapters.Pauser): consumer.Pause
//     stops the client fetching the Source's topics
//     (kgo.Client.PauseFetchTopics) while the member stays in its group,
//     heartbeating and keeping its partitions; partitions assigned meanwhile
//     are paused too. The Source's own pause of a partition at its bound
//     (see Backpressure) is kept apart: a partition is fetched only when
//     neither holds.
//   - [Source.Assigned] (adapters.Assigner): the member's partitions, as
//     "topic/partition", in Status().Assigned.
//   - [Source.Backlog] (adapters.BacklogReporter): the group's lag over the
//     member's partitions (end offset, or read committed the last stable
//     offset, minus the committed offset, or the log start where nothing is
//     committed: as kadm and kafka-consumer-groups.sh count) as waiting, and
//     of it the records this member fetched and has not committed as in
//     flight; no age. One ListOffsets request per broker a poll.
//
// # Dead-letter topic
//
// [Source.NewDeadLetter] makes a sink that produces through the Source's
// client (its brokers, TLS, SASL and group); [NewDeadLetter] makes one with
// a client of its own. Both look the topic up within their context and fail,
// with the cause, when the cluster does not answer or the topic does not
// exist, rather than at the first poison record. [DeadLetter.Send] produces
// synchronously with acks from all in-sync replicas and the idempotent
// producer, and returns nil only once the brokers acknowledged the record:
// only then does the runtime ack (mark done) the original. The dead-letter record keeps the original key, value and headers
// and adds the diagnostic headers of [adapters.Diagnostics] (original topic,
// partition, offset, timestamp, key, attempts, error, failure times) plus
// [HeaderGroup]. A failed produce returns an error; the original stays
// unmarked and its partition's commit does not pass it.
//
// # Dead-letter replay
//
// [NewReplay] lists the dead letters of a dead-letter topic
// ([Replay.List], a dry run that joins no group and commits nothing; group
// them with adapters.GroupDeadLetters) and copies a selection back to their
// original topics ([Replay.Replay]) at a bounded rate, with their key (so a
// key's records stay in one partition), their headers without the
// diagnostics, and adapters.HeaderReplayOf. Kafka deletes no record: a
// consumer group of the replay's own on the dead-letter topic records what
// was looked at, replayed or left out by the selection, and each batch of
// copies is committed with that group's offsets in one Kafka transaction,
// so that a run cut short anywhere loses no dead letter and, for consumers
// that read committed records only, copies none twice.
//
// # Shutdown
//
// The runtime drains, acks what finished and nacks the rest; a nacked record
// is not marked done, so it stays uncommitted for the next owner (during a
// run, a nacked record is handed out again). Close commits the done prefixes,
// leaves the group and closes the client. A shutdown that begins during a
// revoke's drain keeps the runtime's shutdown timeout: franz-go holds the
// runtime's Receive until the revoke ends, but the runtime cuts its running
// handlers at its own deadline, which ends the revoke's wait for them.
//
// # Telemetry
//
// Through the MeterProvider of [WithMeterProvider] (the global one by
// default): custody.kafka.lag (high watermark minus committed offset, per
// partition; the end offsets of partitions not fetched lately are listed
// from the brokers, see [WithLagRefresh]), custody.kafka.commit.duration,
// custody.kafka.commit.failures, custody.kafka.skipped (records skipped
// thanks to the commit metadata), custody.kafka.rewinds (partitions rewound
// after data loss) and custody.kafka.expired (offsets deleted by retention
// before the group read them, counted as offsets: on a compacted topic some
// held no record; Receive reports them with [ErrExpired]). Record headers
// become Delivery.Headers, so the runtime picks up W3C trace context
// (traceparent, tracestate) from them once a propagator is set
// (OpenTelemetry's default global one is a no-op; see
// consumer.WithPropagator).
//
// # Native record
//
// Delivery.Native (and consumer.Message.As) holds the *kgo.Record.
package kafka
