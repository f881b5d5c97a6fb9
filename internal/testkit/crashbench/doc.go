// Package crashbench measures what a crash costs a consumer: it kills
// consumer processes with SIGKILL in the middle of a stream and counts the
// messages lost (there must be none) and the effects repeated per kill, for
// custody's consumer and for a raw client loop that acks each message after
// its effect, on SQS (the emulator), RabbitMQ and Kafka (kfake). The package
// holds tests only:
//
//	go test -run '^$' -bench Crash ./internal/testkit/crashbench/                  # 5 kills per run
//	go test -run '^$' -bench Crash ./internal/testkit/crashbench/ -crash.kills 15  # the figures of docs/benchmarks.md
//
// # How it counts
//
// The test binary starts itself again as a consumer (a child, chosen by an
// environment variable), which handles each message by sleeping for the
// work time (2 ms) and then writing the message's body, one line, to a pipe
// the parent reads. That write is the effect: the handler returns, and the
// message may be acknowledged, only after it. A line written to a pipe
// stays there when its writer dies, so a SIGKILL never loses a recorded
// effect, and an effect is never recorded without having happened.
//
// Each run publishes -crash.messages messages to a fresh queue or topic,
// starts a child and kills it at a moment drawn uniformly from the first
// -crash.life (2 s) after its first effect, starts another, and so on for
// -crash.kills kills, topping the stream up so that no kill finds it empty.
// The last child runs until every message has had an effect, what the
// killed children held has come back (on SQS, after their visibility
// timeout) and no effect came for a while; it is then stopped with SIGTERM,
// which lets custody drain. What the broker would still deliver after that
// (the group's lag on Kafka, the messages left in the queue elsewhere) is
// counted as repeats still to come. Then:
//
//   - lost: published messages with no effect;
//   - repeats/kill: effects beyond one per message, divided by the kills;
//   - msg/s: a separate run of the same child over -crash.messages messages
//     without kills, from its first effect to its last.
//
// A kill at a moment uniform over two seconds falls at a uniform phase of
// Kafka's default one-second commit interval, so the Kafka figure is what a
// crash at a random moment of a long-running consumer costs.
//
// The memory broker is left out: it runs inside the consumer's process, so
// a SIGKILL takes the broker too (examples/crash shows its crash in
// process).
package crashbench
