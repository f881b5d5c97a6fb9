package kafka

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kadm"
)

// Backlog's waiting count is the group's lag over the member's partitions,
// as kadm computes it: the end minus the committed offset, or minus the log
// start where nothing is committed; in flight, the records fetched past the
// committed offset.
func TestBacklogIsTheGroupLag(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 3)
	c.produceN(t, "orders", 3, 10, 10)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Partition 2 starts at offset 3: it is never committed below, so its
	// lag counts from the log start.
	del := kadm.Offsets{}
	del.Add(kadm.Offset{Topic: "orders", Partition: 2, At: 3})
	if _, err := c.admin.DeleteRecords(ctx, del); err != nil {
		t.Fatal(err)
	}
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(Unordered), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour))
	ds := receiveN(t, s, 27)
	var done []*adapters.Delivery
	for _, d := range ds {
		if d.Partition != 2 && d.Offset < 4 {
			done = append(done, d)
		}
	}
	ack(t, s, done...)
	commitNow(t, s)
	c.produceN(t, "orders", 3, 5, 5) // not polled: waiting, not in flight

	b, err := s.Backlog(ctx)
	if err != nil {
		t.Fatal(err)
	}
	lags, err := c.admin.Lag(ctx, group)
	if err != nil {
		t.Fatal(err)
	}
	l := lags[group]
	if err := l.Error(); err != nil {
		t.Fatal(err)
	}
	// 11 + 11 past the commits at 4, 12 past partition 2's start at 3.
	if want := l.Lag.Total(); b.Waiting != want || want != 34 {
		t.Errorf("Backlog waiting %d, kadm's lag %d; want both 34", b.Waiting, want)
	}
	// 6 + 6 polled past the commits, 7 past partition 2's start.
	if b.InFlight != 19 || b.OldestAge != 0 {
		t.Errorf("Backlog in flight %d, oldest age %v; want 19 and none", b.InFlight, b.OldestAge)
	}

	_ = s.Close()
	if _, err := s.Backlog(ctx); !errors.Is(err, adapters.ErrClosed) {
		t.Fatalf("Backlog of a closed Source = %v, want adapters.ErrClosed", err)
	}
}

// The runtime polls a Kafka Source's backlog into its Status, and it falls
// to zero as the consumer catches up.
func TestConsumerReportsTheKafkaBacklog(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 20, 20)
	block := make(chan struct{})
	s := c.open(t, newGroup(), "orders", WithCommitInterval(20*time.Millisecond))
	cons, _ := startConsumer(t, s, func(ctx context.Context, _ *consumer.Message) error {
		select {
		case <-block:
		case <-ctx.Done():
		}
		return nil
	}, consumer.WithBacklogInterval(time.Second))
	eventually(t, "a backlog in Status", func() bool {
		st := cons.Status()
		return !st.BacklogAt.IsZero() && st.Backlog.Waiting == 40
	})
	close(block)
	eventually(t, "the backlog to drain", func() bool {
		st := cons.Status()
		return st.Backlog.Waiting == 0 && st.Backlog.InFlight == 0
	})
}
