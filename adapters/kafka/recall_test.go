package kafka

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// A revoke recalls every handed-out record of the revoked partition, and
// only of it; a nacked recalled record is not done, so the revoke's commit
// stops before it, and the drain ends as soon as the records still held are
// settled, not at the drain time (an hour here).
func TestRevokeRecallsTheRevokedPartitionsRecords(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 5, 5)
	group := newGroup()
	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithRevokeDrain(time.Hour))
	ds := receiveN(t, a, 10)
	for _, d := range ds {
		if d.Signal.Recalled() {
			t.Fatalf("%s recalled before any revoke", d.ID)
		}
	}

	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	var mu sync.Mutex
	var got []*adapters.Delivery
	ctx, cancel := context.WithCancel(context.Background())
	polled := make(chan struct{})
	go func() { // b must poll to take part in the rebalance
		defer close(polled)
		for ctx.Err() == nil {
			more, _ := b.Receive(ctx, 100)
			mu.Lock()
			got = append(got, more...)
			mu.Unlock()
		}
	}()
	defer func() { cancel(); <-polled }()

	var moved int32 = -1
	eventually(t, "a partition of a to start draining", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		for _, p := range a.order {
			if p.draining {
				moved = p.id
				return true
			}
		}
		return false
	})
	var first *adapters.Delivery
	var rest []*adapters.Delivery
	for _, d := range ds {
		switch {
		case d.Partition != moved:
			if d.Signal.Recalled() {
				t.Errorf("%s recalled although its partition was kept", d.ID)
			}
		case !d.Signal.Recalled():
			t.Errorf("%s of the revoked partition not recalled", d.ID)
		case d.Offset == 0:
			first = d
		default:
			rest = append(rest, d)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	// The runtime gives back the records that had not started; the one
	// that ran finishes.
	if err := a.Nack(context.Background(), adapters.NackAll(rest, 0)); err != nil {
		t.Fatal(err)
	}
	ack(t, a, first)
	eventually(t, "the new owner to receive the given-back records", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) == 4
	})
	mu.Lock()
	if o := offsets(got); !slices.Equal(o, []int64{1, 2, 3, 4}) || got[0].Partition != moved {
		t.Errorf("new owner received %v of partition %d, want 1..4 of %d", o, got[0].Partition, moved)
	}
	mu.Unlock()
	if offs, _ := c.committed(t, group, "orders"); offs[moved] != 1 {
		t.Errorf("revoke committed %d, want 1: only offset 0 was done", offs[moved])
	}
	if cause := first.Signal.LostCause(); cause != nil {
		t.Errorf("the record that finished in the drain was lost: %v", cause)
	}
}

// With per-partition ordering, a revoke gives back the partition's records
// waiting behind its running handler while that handler still runs: the
// drain (30 s here) then waits for that handler only. The new owner receives
// the waiting records, in order, and the old owner never runs them; the
// commit never passes a record that was not done.
func TestRevokeGivesBackWaitingRecordsWhileTheRunningOneFinishes(t *testing.T) {
	const perPart = 20
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, perPart, perPart)
	group := newGroup()

	var mu sync.Mutex
	handled := map[string]map[int32][]int64{"a": {}, "b": {}}
	started := map[int32]chan struct{}{0: make(chan struct{}), 1: make(chan struct{})}
	release := map[int32]chan struct{}{0: make(chan struct{}), 1: make(chan struct{})}
	handler := func(member string) consumer.HandlerFunc {
		return func(ctx context.Context, m *consumer.Message) error {
			mu.Lock()
			handled[member][m.Partition] = append(handled[member][m.Partition], m.Offset)
			mu.Unlock()
			if member == "a" && m.Offset == 0 {
				close(started[m.Partition])
				select { // the slow handler
				case <-release[m.Partition]:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			return nil
		}
	}
	handledBy := func(member string, p int32) []int64 {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(handled[member][p])
	}
	opts := []consumer.Option{consumer.WithConcurrency(4), consumer.WithMaxInFlight(64)}

	a := c.open(t, group, "orders", WithCommitInterval(20*time.Millisecond), WithRevokeDrain(30*time.Second))
	runConsumer(t, a, handler("a"), opts...)
	for p := range started {
		await(t, "partition's slow handler to start", started[p])
	}
	eventually(t, "a to hold every record", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.totalHeld == 2*perPart
	})

	b := c.open(t, group, "orders", WithCommitInterval(20*time.Millisecond))
	runConsumer(t, b, handler("b"), opts...)
	var moved *partition
	eventually(t, "a partition of a to start draining", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		for _, p := range a.order {
			if p.draining {
				moved = p
				return true
			}
		}
		return false
	})
	id := moved.id
	eventually(t, "the waiting records to be given back while the slow handler runs", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return moved.nheld == 1
	})
	if offs, _ := c.committed(t, group, "orders"); hasCommit(offs, id) && offs[id] > 0 {
		t.Fatalf("committed %d while offset 0 still runs", offs[id])
	}
	if got := handledBy("a", id); !slices.Equal(got, []int64{0}) {
		t.Fatalf("old owner ran %v of the revoked partition, want only the running 0", got)
	}

	close(release[id])
	want := make([]int64, 0, perPart-1)
	for o := int64(1); o < perPart; o++ {
		want = append(want, o)
	}
	eventually(t, "the new owner to run the given-back records", func() bool {
		return len(handledBy("b", id)) >= perPart-1
	})
	if got := handledBy("b", id); !slices.Equal(got, want) {
		t.Errorf("new owner ran %v, want 1..%d in order (0 was done and committed by the old owner)", got, perPart-1)
	}
	if got := handledBy("a", id); !slices.Equal(got, []int64{0}) {
		t.Errorf("old owner ran %v of the revoked partition, want only 0", got)
	}
	eventually(t, "the new owner to commit the partition's end", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[id] == perPart
	})
	close(release[1-id])
	eventually(t, "the kept partition to be run to its end", func() bool {
		return len(handledBy("a", 1-id)) == perPart
	})
}

// await receives from ch, failing the test after a generous deadline.
func await(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}
