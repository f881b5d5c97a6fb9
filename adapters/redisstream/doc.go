// Package redisstream is the custody adapter for Redis Streams consumer
// groups, over github.com/redis/go-redis/v9. It needs Redis 7.0 or later.
//
// A [Source] reads one stream as one consumer of a consumer group; a
// [DeadLetter] appends messages that will not be processed to another
// stream:
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	src, err := redisstream.New(ctx, rdb, "orders", "billing",
//		redisstream.WithCreateGroup("$"))
//	dlq, err := redisstream.NewDeadLetter(ctx, rdb, "orders-dlq")
//	c, err := consumer.New(src, handler,
//		consumer.WithConcurrency(32),
//		consumer.WithDeadLetter(dlq))
//	err = c.Run(ctx)
//
// # Entries and messages
//
// An entry's id is the message ID; its body is the field named by
// WithBodyField ("body"), and every other field is a header (where the
// runtime finds a W3C traceparent). Attempt is the group's delivery count
// for the entry, which survives crashes and other consumers. The native
// message is the go-redis [redis.XMessage] (consumer.Message.As). Field
// order and repeated field names are not kept: go-redis reads the fields
// into a map.
//
// Every Source is a consumer of its own in the group: its name
// (WithConsumer) defaults to the host name, the process id and a random
// suffix.
//
// # Leases
//
// Redis holds no lease: a read entry stays in the group's pending list,
// assigned to its consumer, until it is acked, and any consumer may claim
// it. The lease is a convention all consumers of the group keep: an entry
// belongs to its consumer until it has been idle (not delivered, not
// claimed) for the lease (WithLease, 30 s); only then does another
// consumer's reclaim claim it. The runtime renews every held entry at a
// third of the lease with one script call per batch that, for each entry,
// checks that this consumer still owns it, with the delivery count this
// delivery was handed out with, and only then claims it again with IDLE
// and JUSTID (the delivery count stays). A plain XCLAIM would take back an
// entry another consumer had already claimed; here that entry fails the
// renewal with adapters.ErrLeaseLost, and the runtime cancels its handler.
//
// The delivery count fences one delivery from the next. A Source claims its
// own entries again (those it gave back, once due; those whose lease it
// lost), so the owner is the same consumer name for both deliveries: only
// the count, which every claim that hands an entry out counts up, tells
// them apart. A renewal or give-back of the earlier delivery that reaches
// Redis late, or that the runtime sends again because its answer was lost
// after Redis acted, fails with adapters.ErrLeaseLost rather than renew or
// give back the later delivery, whose handler may be running. (An XACK is
// not fenced: it follows a handler that succeeded, and the message is done
// whichever delivery it names.)
//
// # Reclaim
//
// Receive first claims entries idle past the lease (a dead consumer's, or
// retries that fell due; see Retries), then reads new ones for the room
// left, never more than it was asked for in all. Redis never hands a
// pending entry out again by itself, so reclaiming is part of receiving: a
// script scans the pending list with XAUTOCLAIM every WithReclaimInterval
// (1 s), or at once while scans come back full, as WithBlock bounds a wait
// for new entries. When an entry becomes deliverable is decided by the
// lease and by the delay given to Nack, not by the interval. The Source
// keeps no entry between calls; it claims the entries it gave back itself
// as soon as their delay has passed (it remembers when). A reclaimed
// entry's attempt is the group's delivery count, which the claim counted
// up.
//
// Entries deleted from the stream while pending (MAXLEN, XTRIM, XDEL) are
// dropped from the pending list by Redis during the claim: the Source
// counts them (Stats.Deleted, custody.redis.deleted), logs them, and never
// hands them out. An entry deleted while this consumer holds it is counted
// too (Stats.DeletedWhileHeld); its handler runs on (no one else can be
// handed it), and its ack finds nothing to do. That holds too when a
// reclaim scan, this Source's or another consumer's, dropped it from the
// pending list first (XAUTOCLAIM drops every deleted entry it meets, held
// or not): a renewal that finds an entry no longer pending looks for it in
// the stream, and only an entry still there was acked elsewhere (a lost
// lease).
//
// # Acks
//
// Ack is XACK with every id of the batch in one command (a pipeline of
// several XACKs beyond 1,024), and XDEL in the same round trip with
// WithDeleteOnAck.
//
// # What the Source declares
//
// The Source batches, lingers, renews and retries nothing by itself; its
// Capabilities tell the runtime how. Acks: up to 1,024 entries a call, sent
// by the runtime's goroutines (up to four calls under way) once a batch is
// full or its oldest ack has waited half a millisecond, so that a busy
// consumer sends one XACK per batch and its workers run on while one is
// under way. Give-backs and renewals: up to 512 entries a script call. One
// Receive at a time: a read hands out at once what the stream holds, so a
// second one would not add throughput. docs/redisstream.md gives the
// measurements.
//
// # Retries
//
// Redis has no delayed redelivery; the Source gives an entry back by
// setting its idle time so that it reaches the lease once the delay has
// passed (XCLAIM to itself with IDLE lease-delay and JUSTID, after checking
// it still owns the entry, with this delivery's count; see Leases). The
// entry waits in the pending list, not in the process: it costs no worker,
// and it survives the process, since any consumer's reclaim takes it once
// it is due. The delivery count is not touched when the entry is given
// back; the reclaim that hands it out again counts it, so attempt n+1
// follows attempt n. A delay longer than the lease cannot be an idle time
// (Redis refuses delivery times in the future): such an entry is parked,
// its due time kept in a sorted set beside the stream
// ("<stream>:custody-delays:<group>", in the stream's cluster slot,
// expiring two leases after its latest due time), and every reclaim that
// claims it before then sets it aside again with the delivery count it had.
//
// # Dead letters
//
// [DeadLetter] appends the original fields plus the diagnostics to the
// dead-letter stream and acknowledges the original in one atomic step on
// one server (see DeadLetter for what a cluster changes). It reports so
// (adapters.OriginalSettler), and the runtime does not ack the original; a
// wrapper that hides this makes the runtime ack it: that Ack, like a Nack,
// succeeds without a command.
//
// # Consumer names
//
// XGROUP DELCONSUMER drops the consumer's pending entries from the group
// for good. The Source therefore deletes a consumer only when it holds no
// pending entry, checked and deleted in one atomic script: its own name at
// Close, and, at New and Close, the names of other consumers that hold
// nothing and have been idle for WithConsumerCleanup (1 h). A live consumer
// deleted this way holds nothing, and its next read creates it again. A
// consumer that died holding entries keeps its name until others have
// reclaimed them all.
//
// # A missing group
//
// When the group vanishes (the stream was deleted, or the server restarted
// without persistence), everything it held is gone: entries not yet read,
// pending entries, and the group's position. The Receive that finds the
// group missing reports every entry this Source holds as lost, through its
// Delivery.Signal, with a cause wrapping adapters.ErrLeaseLost and
// [ErrGroupMissing], so the runtime cancels their handlers at once rather
// than at their next renewal. It counts the event (Stats.GroupMissing,
// custody.redis.group_missing), logs it, and with WithCreateGroup creates
// the group again from the first entry of the stream as it is then, so that
// nothing added since is skipped (on a stream that survived, XGROUP DESTROY
// say, this delivers its entries again). Without WithCreateGroup, Receive
// fails with an error wrapping ErrGroupMissing until the group exists. This
// is the only loss the Source reports through a Signal; every other one is
// an entry error of the Ack, Nack or Extend that found it.
//
// # Connection and readiness
//
// go-redis has no connection-state callback (it dials as commands need a
// connection), so the Source reports its connection (adapters.Connector)
// from the outcome of its own commands (see Source.Connection), which a
// running consumer sends all the time. The runtime's Status().Ready, and
// its readiness probe, are false while it is not connected.
//
// # Backlog and metrics
//
// [Source.Backlog] (adapters.BacklogReporter) reads in one script call the
// group's lag (waiting), its pending count (in flight), and the id of the
// first entry after the group's last delivered id, whose milliseconds
// against the server's clock give the oldest waiting entry's age. (The idle
// time of the oldest pending entry would not: pending entries are in
// flight, and their idle time restarts with every renewal.)
//
// Besides the runtime's, the Source records custody.redis.commands (by
// command and error), custody.redis.pending and custody.redis.lag (the
// group's backlog, read with XINFO GROUPS when metrics are collected),
// custody.redis.reclaimed, custody.redis.deleted and
// custody.redis.group_missing. [Source.Stats] counts commands and outcomes
// too, for tests and benchmarks; see docs/redisstream.md for commands per
// message.
package redisstream
