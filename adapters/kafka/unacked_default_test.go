package kafka

import (
	"context"
	"strings"
	"testing"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// WithMaxUnacked below the per-partition default is a valid setting by
// itself: the per-partition bound the caller did not set follows it down
// instead of failing New under an option the caller never used.
func TestMaxUnackedBelowThePerPartitionDefault(t *testing.T) {
	c := newCluster(t)
	s, err := New(context.Background(), WithBrokers(c.addrs...), WithGroup("g"), WithTopics("t"), WithMaxUnacked(100))
	if err != nil {
		t.Fatalf("New with WithMaxUnacked(100) alone: %v", err)
	}
	defer s.Close()
	if s.cfg.maxPerPart != 100 || s.cfg.maxTotal != 100 {
		t.Fatalf("per partition %d, total %d; want 100 and 100", s.cfg.maxPerPart, s.cfg.maxTotal)
	}
	// Set explicitly, the per-partition bound still may not exceed the total.
	if _, err := New(context.Background(), WithBrokers(c.addrs...), WithGroup("g"), WithTopics("t"),
		WithMaxUnacked(100), WithMaxUnackedPerPartition(200)); err == nil {
		t.Fatal("WithMaxUnackedPerPartition(200) above WithMaxUnacked(100) was accepted")
	}
}

// The Source declares WithMaxUnacked as the most it hands out
// (Capabilities.MaxUnacked): the runtime refuses a concurrency above it,
// whose extra workers would never get a record, and holds no more than it.
func TestMaxUnackedBoundsTheRuntime(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	s := c.open(t, newGroup(), "orders", WithMaxUnacked(4))
	noop := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	quiet := consumer.WithLogger(testlog.New(t))
	if _, err := consumer.New(s, noop, quiet, consumer.WithConcurrency(8)); err == nil || !strings.Contains(err.Error(), "WithConcurrency(8)") {
		t.Fatalf("consumer.New with a concurrency of 8 over WithMaxUnacked(4) = %v; want an error naming WithConcurrency(8)", err)
	}
	if _, err := consumer.New(s, noop, quiet, consumer.WithConcurrency(4)); err != nil {
		t.Fatalf("consumer.New with a concurrency of 4 over WithMaxUnacked(4) = %v", err)
	}
}
