package kafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// runBatchConsumer runs a custody batch consumer over s until the test ends.
func runBatchConsumer(t *testing.T, s *Source, h consumer.BatchHandlerFunc, opts ...consumer.Option) {
	t.Helper()
	c, err := consumer.NewBatch(s, h, append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("Run did not return")
		}
	})
}

// A batch still running when the revoke drain of one of its partitions ends
// has its context cancelled with adapters.ErrRevoked: the partition's new
// owner runs its records, and the batch must not run on beside it. Nothing
// is lost and no attempt is used up: every record is done once, on its
// first attempt (the records of the kept partition run again on the old
// owner, those of the revoked one on the new owner), and the group commits
// every partition to its end.
func TestBatchContextEndsWhenAPartitionIsRevoked(t *testing.T) {
	const perPart = 5
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, perPart, perPart)
	group := newGroup()

	var (
		mu       sync.Mutex
		attempts = map[string][]int{} // the attempts recorded done, per record
		cut      atomic.Bool
	)
	started := make(chan int, 1)
	causes := make(chan error, 1)
	handler := consumer.BatchHandlerFunc(func(ctx context.Context, b *consumer.Batch) error {
		if cut.CompareAndSwap(false, true) {
			started <- len(b.Messages)
			select {
			case <-ctx.Done():
				causes <- context.Cause(ctx)
				return context.Cause(ctx)
			case <-time.After(30 * time.Second):
				causes <- errors.New("the batch's context was not cancelled")
				return nil
			}
		}
		mu.Lock()
		for _, m := range b.Messages {
			key := fmt.Sprintf("%d/%d", m.Partition, m.Offset)
			attempts[key] = append(attempts[key], m.Attempt)
		}
		mu.Unlock()
		b.DoneAll()
		return nil
	})
	opts := []consumer.Option{consumer.WithBatchSize(2 * perPart), consumer.WithBatchLinger(200 * time.Millisecond)}

	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(20*time.Millisecond), WithRevokeDrain(300*time.Millisecond))
	runBatchConsumer(t, a, handler, opts...)
	select {
	case n := <-started:
		t.Logf("the old owner's batch holds %d records", n)
	case <-time.After(30 * time.Second):
		t.Fatal("no batch started")
	}
	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(20*time.Millisecond))
	runBatchConsumer(t, b, handler, opts...)
	select {
	case cause := <-causes:
		if !errors.Is(cause, adapters.ErrRevoked) {
			t.Fatalf("the batch's context ended with %v, want a cause wrapping adapters.ErrRevoked", cause)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the batch did not end")
	}
	eventually(t, "every record done and committed", func() bool {
		mu.Lock()
		n := len(attempts)
		mu.Unlock()
		offs, _ := c.committed(t, group, "orders")
		return n == 2*perPart && offs[0] == perPart && offs[1] == perPart
	})
	mu.Lock()
	defer mu.Unlock()
	for key, got := range attempts {
		if len(got) != 1 || got[0] != 1 {
			t.Errorf("record %s done as attempts %v, want [1]: the cut batch used up an attempt, or the record ran twice", key, got)
		}
	}
}
