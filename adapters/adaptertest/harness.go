package adaptertest

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// Harness tells the suite how to reach one adapter's broker. An adapter's test
// file fills it in and calls [Run]:
//
//	func TestConformance(t *testing.T) {
//		adaptertest.Run(t, adaptertest.Harness{NewQueue: newTestQueue})
//	}
type Harness struct {
	// NewQueue creates a fresh, empty queue (or topic, or subscription) for
	// one test, with a dead-letter destination beside it, and registers its
	// clean-up with t.Cleanup. It calls t.Skip when the broker cannot offer
	// what cfg asks for. The checks run in parallel with one another
	// (t.Parallel): NewQueue, and the functions of the Queues it returns,
	// must be safe to call from several tests at once.
	NewQueue func(t *testing.T, cfg QueueConfig) *Queue

	// Dispatch says how the broker shares a queue among its consumers,
	// which decides what a Source may fetch before Receive asks for it.
	// The zero value, OnReceive, is the strictest.
	Dispatch Dispatch

	// Pending names checks the adapter does not pass yet, each with the
	// reason (a port under way); Run skips them and says why. A name that
	// is not a check of the suite fails the run.
	Pending map[string]string

	// wait, when set, replaces patience in the checks that can only fail
	// by waiting for something that never comes: the suite's own tests
	// shorten it to see those checks fail.
	wait time.Duration
}

// Dispatch is how a broker shares a queue among its consumers.
type Dispatch int

const (
	// OnReceive: the broker hands each message to whichever consumer asks
	// for it first (SQS, the memory broker, JetStream pull consumers, Redis
	// Streams consumer groups). A Source fetches no more than Receive asks
	// for: a message it fetched ahead waits in it while another consumer
	// could have run it.
	OnReceive Dispatch = iota
	// Prefetch: the broker pushes messages to each consumer, up to its
	// prefetch window, before the consumer asks (RabbitMQ).
	Prefetch
	// Partitions: each consumer of a group owns whole partitions, whose
	// records no other consumer could take (Kafka); an ack is an offset,
	// committed with others later (the runtime's prefix commits).
	Partitions
)

func (d Dispatch) String() string {
	switch d {
	case OnReceive:
		return "OnReceive"
	case Prefetch:
		return "Prefetch"
	case Partitions:
		return "Partitions"
	}
	return "Dispatch(" + strconv.Itoa(int(d)) + ")"
}

// QueueConfig is what a test asks of the queue it creates.
type QueueConfig struct {
	// Lease is the lease the test would like deliveries to be held on; the
	// harness may round it (SQS counts whole seconds) and reports the lease
	// in force in Queue.Lease. Ignored by brokers without leases.
	Lease time.Duration
	// Ordered asks for a queue that promises order per Message.Key (SQS FIFO,
	// Kafka partitions, memory FIFO). A harness whose broker cannot promise
	// order calls t.Skip.
	Ordered bool
}

// Queue is one test's queue and the ways the suite touches it.
type Queue struct {
	// Publish puts messages on the queue in the order given.
	Publish func(ctx context.Context, msgs ...Message) error
	// Open opens a new Source on the queue, as a new consumer process would.
	// The suite closes what it opens (through the consumer or directly).
	Open func(t *testing.T) adapters.Source
	// DeadLetter sends into this queue's dead-letter destination.
	DeadLetter adapters.DeadLetter
	// DeadLettered returns every message that has arrived at the dead-letter
	// destination so far, with the headers the DeadLetter added. It may
	// consume them; the suite calls it until it sees what it waits for.
	DeadLettered func(ctx context.Context) ([]Message, error)
	// Lease is the lease in force on this queue; zero for brokers that do
	// not lease deliveries.
	Lease time.Duration

	// Crash cuts a Source that Open returned off from the broker, as the
	// death of its process would: what the Source sent before stays sent,
	// nothing it still holds back reaches the broker, and the broker takes
	// back what it had handed to the Source (at once where a connection
	// carried it, when the lease runs out where there is one). The suite
	// still calls Close afterwards and ignores its result. The checks that
	// Ack, Nack and Extend do not linger skip when Crash is nil.
	Crash func(src adapters.Source)
	// Refuse makes the broker refuse the first entry of the next Ack of a
	// Source that Open returned, with a transient fault (a failure on the
	// broker's side, worth trying again); the other entries of that call,
	// and later calls, go through. Brokers that never refuse an ack entry
	// (RabbitMQ, whose acks have no reply; Kafka, whose acks are marks;
	// Redis Streams, whose XACK answers only how many it acked) leave it
	// nil, and the check that an adapter does not retry by itself skips.
	Refuse func(src adapters.Source)
}

// Message is a message as the suite publishes it and reads it back.
type Message struct {
	// Key is the ordering key: the FIFO group id or the record key.
	Key     string
	Body    []byte
	Headers map[string]string
}

// patience returns how long the checks that fail by waiting in vain wait.
func (h Harness) patience() time.Duration {
	if h.wait > 0 {
		return h.wait
	}
	return patience
}
