package kafka

import (
	"context"
	"testing"
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
