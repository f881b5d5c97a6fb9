package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/custody-go/custody/adapters"
)

// When a second member takes a partition, the old owner's held record is
// lost with ErrRevoked after the drain time, its done prefix is committed on
// revoke, and a late completion of the lost record is neither marked nor
// committed by the old owner.
func TestRevokedPartitionIsNeverCommittedByItsOldOwner(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 10, 10)
	group := newGroup()
	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithRevokeDrain(200*time.Millisecond))

	ds := receiveN(t, a, 20)
	late := map[int32]*adapters.Delivery{}
	for _, d := range ds {
		if d.Offset == 4 {
			late[d.Partition] = d
			continue
		}
		ack(t, a, d)
	}

	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	// b must poll to join; what it receives is the revoked partition's
	// unfinished record only (5..9 were recorded done in the metadata).
	var got []*adapters.Delivery
	eventually(t, "the second member to receive the revoked partition's unfinished record", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		more, _ := b.Receive(ctx, 100)
		got = append(got, more...)
		return len(got) > 0
	})
	moved := got[0].Partition
	if o := offsets(got); !slices.Equal(o, []int64{4}) {
		t.Fatalf("new owner received %v, want only [4]", o)
	}
	if cause := late[moved].Signal.LostCause(); !errors.Is(cause, adapters.ErrRevoked) {
		t.Fatalf("old owner's held record lost with %v, want ErrRevoked", cause)
	}
	if offs, _ := c.committed(t, group, "orders"); offs[moved] != 4 {
		t.Fatalf("revoke committed %d, want 4", offs[moved])
	}

	// The late completion arrives at the old owner.
	err := a.Ack(context.Background(), []*adapters.Delivery{late[moved]})
	if !errors.Is(adapters.EntryError(err, 0), adapters.ErrRevoked) {
		t.Fatalf("late ack returned %v, want ErrRevoked", err)
	}
	commitNow(t, a)
	if offs, _ := c.committed(t, group, "orders"); offs[moved] != 4 {
		t.Fatalf("old owner committed %d for a partition it lost", offs[moved])
	}

	// The partition it kept still commits.
	kept := 1 - moved
	ack(t, a, late[kept])
	commitNow(t, a)
	if offs, _ := c.committed(t, group, "orders"); offs[kept] != 10 {
		t.Fatalf("kept partition committed %d, want 10", offs[kept])
	}
}

// Two members process a stream while one joins and the other leaves midway:
// every record is finished, none is finished twice (the revoke commit and
// the metadata cover what the old owner did), and the group ends committed at
// the end of every partition.
func TestMembersJoiningAndLeavingLoseNothing(t *testing.T) {
	const parts, perPart = 4, 300
	c := newCluster(t)
	c.createTopic(t, "orders", parts)
	group := newGroup()
	// The stream keeps arriving while members join and leave.
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; i < perPart; i += 10 {
			rs := make([]*kgo.Record, 0, parts*10)
			for p := int32(0); p < parts; p++ {
				for j := i; j < i+10; j++ {
					rs = append(rs, &kgo.Record{Topic: "orders", Partition: p, Key: []byte(fmt.Sprintf("key-%d", j%50))})
				}
			}
			if err := c.prod.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
				t.Errorf("producing: %v", err)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()

	var mu sync.Mutex
	acked := map[string][]string{} // record id -> members whose ack succeeded
	work := func(ctx context.Context, name string, s *Source) {
		for ctx.Err() == nil {
			ds, err := s.Receive(ctx, 16)
			if err != nil && len(ds) == 0 {
				continue
			}
			time.Sleep(time.Millisecond) // the effect
			err = s.Ack(context.Background(), ds)
			mu.Lock()
			for i, d := range ds {
				if adapters.EntryError(err, i) == nil {
					acked[d.ID] = append(acked[d.ID], name)
				}
			}
			mu.Unlock()
		}
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(acked) }

	var wg sync.WaitGroup
	start := func(name string) (*Source, context.CancelFunc) {
		s := c.open(t, group, "orders", WithOrderingScope(ByKey), WithCommitInterval(20*time.Millisecond), WithMaxUnackedPerPartition(32))
		ctx, cancel := context.WithCancel(context.Background())
		wg.Add(1)
		go func() { defer wg.Done(); work(ctx, name, s) }()
		return s, cancel
	}
	a, stopA := start("a")
	eventually(t, "a to make progress", func() bool { return count() >= 100 })
	b, stopB := start("b")
	defer stopB()
	eventually(t, "b to make progress", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, who := range acked {
			if slices.Contains(who, "b") {
				return true
			}
		}
		return false
	})
	stopA()
	if err := a.Close(); err != nil {
		t.Logf("closing a: %v", err)
	}
	<-produced
	eventually(t, "every record to be finished", func() bool { return count() == parts*perPart })
	eventually(t, "the group to commit the end of every partition", func() bool {
		offs, _ := c.committed(t, group, "orders")
		for p := int32(0); p < parts; p++ {
			if offs[p] != perPart {
				return false
			}
		}
		return true
	})
	stopB()
	wg.Wait()
	_ = b.Close()

	mu.Lock()
	defer mu.Unlock()
	by := map[string]int{}
	for _, who := range acked {
		for _, w := range who {
			by[w]++
		}
	}
	t.Logf("records finished per member: %v", by)
	if by["a"] == 0 || by["b"] == 0 {
		t.Errorf("both members should have finished records: %v", by)
	}
	for p := 0; p < parts; p++ {
		for o := 0; o < perPart; o++ {
			id := fmt.Sprintf("orders/%d/%d", p, o)
			if who := acked[id]; len(who) != 1 {
				t.Errorf("%s finished by %v, want exactly one member", id, who)
			}
		}
	}
}

// Lost partitions (a fatal group error: the member was kicked out) are
// fenced at once and not committed: they may already be someone else's.
func TestLostPartitionIsFencedWithoutCommit(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 5, 5)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 5)
	ack(t, s, ds[:2]...)

	// What franz-go does on a fatal group error such as UNKNOWN_MEMBER_ID.
	s.onLost(context.Background(), s.Client(), map[string][]int32{"orders": {0}})

	for _, d := range ds[2:] {
		if !errors.Is(d.Signal.LostCause(), adapters.ErrRevoked) {
			t.Fatalf("held record not lost: %v", d.Signal.LostCause())
		}
	}
	if err := s.Ack(context.Background(), ds[2:]); !errors.Is(adapters.EntryError(err, 0), adapters.ErrRevoked) {
		t.Fatalf("ack after loss returned %v, want ErrRevoked", err)
	}
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); hasCommit(offs, 0) {
		t.Fatalf("lost partition committed at %d", offs[0])
	}
}

// The same through the group protocol: the cluster answers a heartbeat with
// UNKNOWN_MEMBER_ID (the member was kicked out), franz-go declares the
// partitions lost, and the Source fences them without committing, refuses
// late acks, rejoins and delivers the uncommitted records again. The
// partition is lost paused at its unacked bound: franz-go keeps a
// partition paused across rebalances, and unless the loss resumed it, it
// was never fetched again once assigned back.
func TestFatalGroupErrorLosesPartitionsWithoutCommit(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 5, 5)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMaxUnackedPerPartition(3))
	ds := receiveN(t, s, 3)
	ack(t, s, ds[:2]...)
	ds = append(ds, receiveN(t, s, 2)...) // three running: the bound
	if paused := s.Client().PauseFetchPartitions(nil); len(paused) == 0 {
		t.Fatal("the partition at its bound is not paused: the test cannot show the loss resuming it")
	}

	var kicked atomic.Bool
	kick := func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.fake.KeepControl()
		if kicked.Load() {
			return nil, nil, false
		}
		switch r := req.(type) {
		case *kmsg.HeartbeatRequest:
			if r.Group != group {
				return nil, nil, false
			}
			kicked.Store(true)
			resp := r.ResponseKind().(*kmsg.HeartbeatResponse)
			resp.ErrorCode = kerr.UnknownMemberID.Code
			return resp, nil, true
		case *kmsg.ConsumerGroupHeartbeatRequest:
			if r.Group != group {
				return nil, nil, false
			}
			kicked.Store(true)
			resp := r.ResponseKind().(*kmsg.ConsumerGroupHeartbeatResponse)
			resp.ErrorCode = kerr.UnknownMemberID.Code
			return resp, nil, true
		}
		return nil, nil, false
	}
	c.fake.ControlKey(int16(kmsg.Heartbeat), kick)
	c.fake.ControlKey(int16(kmsg.ConsumerGroupHeartbeat), kick)

	eventually(t, "the held records lost", func() bool { return ds[2].Signal.LostCause() != nil })
	for _, d := range ds[2:] {
		if !errors.Is(d.Signal.LostCause(), adapters.ErrRevoked) {
			t.Fatalf("held record lost with %v, want ErrRevoked", d.Signal.LostCause())
		}
	}
	if err := s.Ack(context.Background(), ds[2:]); !errors.Is(adapters.EntryError(err, 0), adapters.ErrRevoked) {
		t.Fatalf("ack after loss returned %v, want ErrRevoked", err)
	}
	commitNow(t, s)
	if offs, _ := c.committed(t, group, "orders"); hasCommit(offs, 0) {
		t.Fatalf("lost partition committed at %d", offs[0])
	}
	// The member rejoins and gets the partition back: nothing was
	// committed, so every record comes again. Until it has, Receive
	// reports the lost session (the runtime logs it and retries).
	var again []*adapters.Delivery
	eventually(t, "the records delivered again", func() bool {
		ds, err := s.Receive(context.Background(), 3-len(again))
		var session *kgo.ErrGroupSession
		if err != nil && !errors.As(err, &session) {
			t.Fatalf("receive after rejoining: %v", err)
		}
		again = append(again, ds...)
		return len(again) == 3
	})
	if got := offsets(again); !slices.Equal(got, []int64{0, 1, 2}) {
		t.Fatalf("after rejoining, offsets %v, want 0..2", got)
	}
}

// A handler that finishes within the revoke drain has its record marked and
// committed by the revoke: the partition's next owner starts after it.
func TestRevokeDrainLetsInFlightRecordsFinish(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 10, 10)
	group := newGroup()
	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithRevokeDrain(30*time.Second))
	ds := receiveN(t, a, 20)
	late := map[int32]*adapters.Delivery{}
	for _, d := range ds {
		if d.Offset == 4 {
			late[d.Partition] = d
			continue
		}
		ack(t, a, d)
	}

	b := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	polled := make(chan struct{})
	go func() { // b must poll to take part in the rebalance
		defer close(polled)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		for ctx.Err() == nil {
			if ds, _ := b.Receive(ctx, 100); len(ds) > 0 {
				t.Errorf("new owner received %v although everything was finished", offsets(ds))
			}
		}
	}()
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
	ack(t, a, late[moved]) // finishes within the drain
	eventually(t, "the revoke to commit the drained partition to its end", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[moved] == 10
	})
	if cause := late[moved].Signal.LostCause(); cause != nil {
		t.Fatalf("record that finished in the drain was lost: %v", cause)
	}
	<-polled
}

// Commit metadata lists done offsets beyond the committed one. When fetching
// cannot start at that offset (the log was truncated or the topic recreated,
// and the client reset to the log start), those offsets name other records:
// they must be handed out, not skipped and committed past.
func TestCommitMetadataIsIgnoredAfterAnOffsetReset(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3) // offsets 0..2
	group := newGroup()

	// A previous owner committed 10, with 12 and 13 recorded done.
	meta := encodeDone(10, func(fn func(int64, int32)) { fn(12, 0); fn(13, 0) })
	var os kadm.Offsets
	os.Add(kadm.Offset{Topic: "orders", Partition: 0, At: 10, LeaderEpoch: -1, Metadata: meta})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if resp, err := c.admin.CommitOffsets(ctx, group, os); err != nil || resp.Error() != nil {
		t.Fatalf("commit: %v %v", err, resp.Error())
	}

	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	got := receiveN(t, s, 3) // offset 10 is out of range: reset to the log start
	ack(t, s, got...)
	c.produceN(t, "orders", 1, 15, 15) // offsets 3..17, new records
	got = append(got, receiveN(t, s, 13)...)
	got = append(got, receiveFor(t, s, 500*time.Millisecond)...)
	ack(t, s, got[3:]...)
	if o := offsets(got); !slices.Contains(o, 12) || !slices.Contains(o, 13) || len(o) != 18 {
		t.Fatalf("received offsets %v (%d records of 18): 12 and 13 were skipped on stale metadata", o, len(o))
	}
}

// franz-go keeps a partition paused across rebalances. A partition paused
// when its revoke begins (here at its unacked bound), or while the revoke
// drains (a nack refills its backlog past the metadata bound), would never
// be fetched again once assigned back.
func TestPartitionPausedDuringARevokeIsFetchedWhenAssignedBack(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	a := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithMetadataLimit(32), WithMaxUnackedPerPartition(3),
		WithRevokeDrain(500*time.Millisecond), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer()))) // eager: a rejoin revokes everything
	ds := receiveN(t, a, 3)
	if paused := a.Client().PauseFetchPartitions(nil); len(paused) == 0 {
		t.Fatal("the partition at its bound is not paused: the test cannot show the revoke resuming it")
	}

	a.mu.Lock()
	old := a.parts[tpKey{"orders", 0}]
	a.mu.Unlock()
	a.Client().ForceRebalance() // the only member rejoins: revoke, then assign back
	eventually(t, "the revoke drain to begin", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return old.draining
	})
	// One record is given back during the drain; the other two are still
	// running when it ends.
	if err := a.Nack(context.Background(), adapters.NackAll(ds[2:], 0)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the partition to be assigned back", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		p := a.parts[tpKey{"orders", 0}]
		return p != nil && p != old
	})
	if paused := a.Client().PauseFetchPartitions(nil); len(paused) > 0 {
		t.Errorf("franz-go still pauses %v for the new assignment", paused)
	}
	c.produceN(t, "orders", 1, 3, 3)
	if got := receiveFor(t, a, 3*time.Second); len(got) == 0 {
		t.Fatal("the partition assigned back is never fetched")
	}
}

// Close during a revoke's drain gives the held records up, so the revoke
// need not wait out its drain time (here an hour) before Close can leave the
// group.
func TestCloseEndsARevokeDrainUnderWay(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 3, 3)
	a := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithRevokeDrain(time.Hour),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer())))
	receiveN(t, a, 3)
	a.mu.Lock()
	p := a.parts[tpKey{"orders", 0}]
	a.mu.Unlock()
	a.Client().ForceRebalance()
	eventually(t, "the revoke drain to begin", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return p.draining
	})
	closed := make(chan error, 1)
	go func() { closed <- a.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Close still waits for the revoke's hour-long drain")
	}
}

// holdPoll blocks, once armed, the poll that takes the next record, after
// franz-go handed the records over and before the poll returns them.
type holdPoll struct {
	armed   atomic.Bool
	holding chan struct{}
	release chan struct{}
}

func (h *holdPoll) OnFetchRecordUnbuffered(_ *kgo.Record, polled bool) {
	if polled && h.armed.CompareAndSwap(true, false) {
		close(h.holding)
		<-h.release
	}
}

// Receive may be called concurrently, but franz-go's AllowRebalance releases
// every poll at once: one Receive allowing a rebalance while another is
// between its poll and the booking of its records let the partition be
// revoked and assigned anew in between, and the old poll's records were
// booked under the new assignment. Here they were 5..9 while 0..4, lost
// in the revoke, were not done: the new assignment then dropped 0..4 as
// already polled and committed past them once 5..9 were done.
func TestConcurrentReceivesNeverBookRecordsUnderANewAssignment(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 5, 5) // 0..4
	group := newGroup()
	h := &holdPoll{holding: make(chan struct{}), release: make(chan struct{})}
	a := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithRevokeDrain(100*time.Millisecond),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer()), kgo.WithHooks(h))) // eager: a rejoin revokes everything
	first := receiveN(t, a, 5) // 0..4 running, never finished
	a.mu.Lock()
	old := a.parts[tpKey{"orders", 0}]
	a.mu.Unlock()

	h.armed.Store(true)
	c.produceN(t, "orders", 1, 5, 5) // 5..9
	held := make(chan []*adapters.Delivery, 1)
	go func() { // this poll takes 5..9 and is held before booking them
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var got []*adapters.Delivery
		for len(got) == 0 && ctx.Err() == nil {
			ds, _ := a.Receive(ctx, 5)
			got = append(got, ds...)
		}
		held <- got
	}()
	<-h.holding
	// Another Receive meanwhile: its poll ends (nothing to fetch).
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_, _ = a.Receive(ctx, 5)
	cancel()
	a.Client().ForceRebalance() // the only member rejoins: revoke, then assign back
	// Give the rebalance a chance to run while the first poll is held; it
	// must not (the held poll still blocks it), but nothing waits on that.
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		a.mu.Lock()
		p := a.parts[tpKey{"orders", 0}]
		a.mu.Unlock()
		if p != nil && p != old {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(h.release)
	got := <-held
	got = append(got, receiveFor(t, a, 2*time.Second)...)
	var done []int64
	for _, d := range append(first, got...) {
		if a.Ack(context.Background(), []*adapters.Delivery{d}) == nil && d.Signal.LostCause() == nil {
			done = append(done, d.Offset) // refused when lost in the revoke
		}
	}
	slices.Sort(done)
	commitNow(t, a)
	offs, _ := c.committed(t, group, "orders")
	if hasCommit(offs, 0) {
		for o := int64(0); o < offs[0]; o++ {
			if !slices.Contains(done, o) {
				t.Fatalf("committed %d but offset %d was never done (done: %v)", offs[0], o, done)
			}
		}
	}
}

// The revoke drain bounds the wait for all the revoked partitions together:
// with the records of two partitions running on past it, the revoke gives
// them up once the drain time is over and the partitions are assigned
// back. (Waiting out the drain for the first partition and then without
// limit for the second held the rebalance until the group gave up on the
// member.)
func TestRevokeDrainBoundsTheWaitForEveryPartition(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 2, 2)
	a := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithRevokeDrain(100*time.Millisecond),
		WithClientOptions(kgo.Balancers(kgo.RangeBalancer()))) // eager: a rejoin revokes everything
	first := receiveN(t, a, 4) // running, never finished
	a.mu.Lock()
	old := map[int32]*partition{0: a.parts[tpKey{"orders", 0}], 1: a.parts[tpKey{"orders", 1}]}
	a.mu.Unlock()
	a.Client().ForceRebalance() // the only member rejoins: revoke, then assign back
	eventually(t, "both partitions assigned back", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		for id, p := range old {
			if np := a.parts[tpKey{"orders", id}]; np == nil || np == p {
				return false
			}
		}
		return true
	})
	for _, d := range first {
		if !errors.Is(d.Signal.LostCause(), adapters.ErrRevoked) {
			t.Fatalf("%s lost with %v after the drain, want ErrRevoked", d.ID, d.Signal.LostCause())
		}
	}
	if again := receiveN(t, a, 4); len(again) != 4 {
		t.Fatalf("received %v after the partitions were assigned back, want the 4 unfinished records", offsets(again))
	}
}
