package adaptertest

import (
	"context"
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
	// what cfg asks for.
	NewQueue func(t *testing.T, cfg QueueConfig) *Queue
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
}

// Message is a message as the suite publishes it and reads it back.
type Message struct {
	// Key is the ordering key: the FIFO group id or the record key.
	Key     string
	Body    []byte
	Headers map[string]string
}
