package kafka

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// fetchCount counts the records the client fetched.
type fetchCount struct{ n atomic.Int64 }

func (f *fetchCount) OnFetchBatchRead(_ kgo.BrokerMetadata, _ string, _ int32, m kgo.FetchBatchMetrics) {
	f.n.Add(int64(m.NumRecords))
}

// A paused consumer's Source stops fetching and stays in its group: across
// several session timeouts it fetches nothing of what is produced
// meanwhile, hands out nothing, keeps its partitions and the group its
// members; resumed, it handles what came meanwhile, each record once.
func TestPauseStopsFetchingAndKeepsThePartitions(t *testing.T) {
	c := newCluster(t, kfake.GroupMinSessionTimeout(100*time.Millisecond))
	c.createTopic(t, "orders", 3)
	c.produceN(t, "orders", 3, 10, 10)
	fetched := &fetchCount{}
	group := newGroup()
	const session = 500 * time.Millisecond
	s := c.open(t, group, "orders", WithCommitInterval(50*time.Millisecond),
		WithClientOptions(kgo.SessionTimeout(session), kgo.WithHooks(fetched)))
	var mu sync.Mutex
	handled := map[string]int{}
	cons, _ := startConsumer(t, s, func(_ context.Context, m *consumer.Message) error {
		mu.Lock()
		handled[m.ID]++
		mu.Unlock()
		return nil
	})
	count := func() (n, dups int) {
		mu.Lock()
		defer mu.Unlock()
		for _, k := range handled {
			if k > 1 {
				dups++
			}
		}
		return len(handled), dups
	}
	eventually(t, "the first records handled", func() bool { n, _ := count(); return n == 30 })
	assigned := cons.Status().Assigned
	members := c.members(t, group)

	cons.Pause(consumer.FinishHeld)
	// A fetch under way when the pause came may still bring what arrives
	// before it ends: let it end (the fetch wait is 100ms).
	time.Sleep(300 * time.Millisecond)
	before := fetched.n.Load()
	c.produceN(t, "orders", 3, 10, 10)
	time.Sleep(4 * session)

	if n, _ := count(); n != 30 {
		t.Errorf("handled %d records while paused, want the 30 from before", n)
	}
	if got := fetched.n.Load() - before; got != 0 {
		t.Errorf("the client fetched %d records while paused", got)
	}
	if n := s.Client().BufferedFetchRecords(); n != 0 {
		t.Errorf("the client buffered %d records while paused", n)
	}
	st := cons.Status()
	if st.State != consumer.StatePaused || !st.Ready || !slices.Equal(st.Assigned, assigned) {
		t.Errorf("paused: state %v, ready %t, assigned %v; want paused, ready, still %v", st.State, st.Ready, st.Assigned, assigned)
	}
	if now := c.members(t, group); !slices.Equal(now, members) {
		t.Errorf("the group's members went from %v to %v while paused: the member left or rejoined", members, now)
	}

	cons.Resume()
	eventually(t, "the records produced while paused handled", func() bool { n, _ := count(); return n == 60 })
	time.Sleep(200 * time.Millisecond)
	if n, dups := count(); n != 60 || dups != 0 {
		t.Fatalf("after the resume, handled %d records, %d more than once; want 60, each once", n, dups)
	}
}

// members returns the group's member IDs, sorted, as the coordinator
// tells them.
func (c *cluster) members(t *testing.T, group string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	gs, err := c.admin.DescribeGroups(ctx, group)
	if err != nil {
		t.Fatalf("describing the group: %v", err)
	}
	g := gs[group]
	if g.Err != nil {
		t.Fatalf("describing the group: %v", g.Err)
	}
	var ids []string
	for _, m := range g.Members {
		ids = append(ids, m.MemberID)
	}
	slices.Sort(ids)
	return ids
}

// The Source's own pause of a full partition and the consumer's pause of
// its topics are kept apart: a partition is fetched only when neither
// holds. Acks that make room do not resume a paused Source's partition,
// and Resume does not resume a partition at its bound.
func TestPauseAndThePartitionBoundKeepApart(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.produceN(t, "orders", 1, 2, 2)
	fetched := &fetchCount{}
	s := c.open(t, newGroup(), "orders", WithOrderingScope(Unordered), WithMaxUnackedPerPartition(2),
		WithClientOptions(kgo.WithHooks(fetched)))
	cl := s.Client()
	partPaused := func() bool { return slices.Contains(cl.PauseFetchPartitions(nil)["orders"], 0) }
	topicPaused := func() bool { return slices.Contains(cl.PauseFetchTopics(), "orders") }

	ds := receiveN(t, s, 2)
	if !partPaused() || topicPaused() {
		t.Fatalf("at the bound: partition paused %t, topic paused %t; want the partition alone", partPaused(), topicPaused())
	}
	s.Pause()
	ack(t, s, ds...)
	if partPaused() || !topicPaused() {
		t.Fatalf("paused, below the bound: partition paused %t, topic paused %t; want the topic alone", partPaused(), topicPaused())
	}
	time.Sleep(300 * time.Millisecond) // a fetch under way ends (fetch wait 100ms)
	before := fetched.n.Load()
	c.produceN(t, "orders", 1, 2, 2)
	if got := receiveFor(t, s, 500*time.Millisecond); len(got) != 0 || fetched.n.Load() != before {
		t.Fatalf("paused: handed out %v, fetched %d records; want nothing of either", offsets(got), fetched.n.Load()-before)
	}

	s.Resume()
	if topicPaused() {
		t.Fatal("Resume left the topic paused")
	}
	ds = receiveN(t, s, 2)
	if got := offsets(ds); !slices.Equal(got, []int64{2, 3}) {
		t.Fatalf("after Resume, handed out %v, want [2 3]", got)
	}
	if !partPaused() {
		t.Fatal("at the bound again, the partition is not paused")
	}
	s.Pause()
	s.Resume()
	if !partPaused() {
		t.Fatal("Resume resumed a partition at its bound")
	}
	ack(t, s, ds...)
	if partPaused() || topicPaused() {
		t.Fatalf("resumed, below the bound: partition paused %t, topic paused %t; want neither", partPaused(), topicPaused())
	}
}

// A partition assigned while the Source is paused is not fetched until
// Resume.
func TestPartitionsAssignedWhilePausedStayPaused(t *testing.T) {
	c := newCluster(t, kfake.GroupMinSessionTimeout(100*time.Millisecond))
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 3, 3)
	group := newGroup()
	fetched := &fetchCount{}
	a := c.open(t, group, "orders", WithClientOptions(kgo.SessionTimeout(500*time.Millisecond), kgo.WithHooks(fetched)))
	b := c.open(t, group, "orders", WithClientOptions(kgo.SessionTimeout(500*time.Millisecond)))
	var (
		bmu  sync.Mutex
		bgot int
	)
	stopB := make(chan struct{})
	bDone := make(chan struct{})
	go func() { // b consumes its share, acking all, until stopped
		defer close(bDone)
		for {
			select {
			case <-stopB:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			ds, _ := b.Receive(ctx, 100)
			cancel()
			if len(ds) > 0 {
				_ = b.Ack(context.Background(), ds)
				bmu.Lock()
				bgot += len(ds)
				bmu.Unlock()
			}
		}
	}()
	eventually(t, "one partition each", func() bool {
		_ = receiveFor(t, a, 50*time.Millisecond) // drive a's group membership; what it gets is acked below
		return len(a.Assigned()) == 1 && len(b.Assigned()) == 1
	})
	a.Pause()
	close(stopB)
	<-bDone
	_ = b.Close() // b's partition moves to a, paused
	eventually(t, "a to own both partitions", func() bool { return len(a.Assigned()) == 2 })
	time.Sleep(300 * time.Millisecond)
	before := fetched.n.Load()
	c.produceN(t, "orders", 2, 3, 3)
	time.Sleep(500 * time.Millisecond)
	if got := fetched.n.Load() - before; got != 0 {
		t.Fatalf("a fetched %d records after it was assigned a partition while paused", got)
	}
	a.Resume()
	_ = receiveFor(t, a, 500*time.Millisecond)
	if fetched.n.Load() == before {
		t.Fatal("a fetched nothing after Resume")
	}
}
