package kafka

import (
	"context"
	"fmt"
	"runtime/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// cluster is an in-process kfake cluster with a producer and an admin client.
type cluster struct {
	fake  *kfake.Cluster
	addrs []string
	prod  *kgo.Client
	admin *kadm.Client

	txnMu      sync.Mutex
	txnClients map[string]*kgo.Client // see txnProducer
}

var groupSeq atomic.Int64

func newCluster(t testing.TB, opts ...kfake.Opt) *cluster {
	t.Helper()
	fake, err := kfake.NewCluster(append([]kfake.Opt{kfake.NumBrokers(1)}, opts...)...)
	if err != nil {
		t.Fatalf("starting kfake: %v", err)
	}
	c := &cluster{fake: fake, addrs: fake.ListenAddrs()}
	c.prod, err = kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.ProducerLinger(0), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	c.admin = kadm.NewClient(c.prod)
	t.Cleanup(func() {
		c.prod.Close()
		fake.Close()
	})
	return c
}

func (c *cluster) createTopic(t testing.TB, topic string, partitions int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.admin.CreateTopic(ctx, partitions, 1, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		t.Fatalf("creating topic %s: %v", topic, err)
	}
}

// produce writes records to partition part of topic, in order.
func (c *cluster) produce(t testing.TB, rs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.prod.ProduceSync(ctx, rs...).FirstErr(); err != nil {
		t.Fatalf("producing: %v", err)
	}
}

// produceN writes n records to each partition, keyed key-<i%keys>.
func (c *cluster) produceN(t testing.TB, topic string, partitions int32, n, keys int) {
	t.Helper()
	rs := make([]*kgo.Record, 0, int(partitions)*n)
	for p := int32(0); p < partitions; p++ {
		for i := 0; i < n; i++ {
			rs = append(rs, &kgo.Record{
				Topic: topic, Partition: p,
				Key:   []byte(fmt.Sprintf("key-%d", i%keys)),
				Value: []byte(fmt.Sprintf("%d/%d", p, i)),
			})
		}
	}
	c.produce(t, rs...)
}

// committed returns the group's committed offset of each partition of topic
// (-1 where nothing is committed) and the commit metadata.
func (c *cluster) committed(t testing.TB, group, topic string) (map[int32]int64, map[int32]string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.admin.FetchOffsets(ctx, group)
	if err != nil {
		t.Fatalf("fetching offsets: %v", err)
	}
	offs, metas := map[int32]int64{}, map[int32]string{}
	for _, r := range resp[topic] {
		if r.Err != nil {
			t.Fatalf("fetching offsets: %v", r.Err)
		}
		offs[r.Partition] = r.At
		metas[r.Partition] = r.Metadata
	}
	return offs, metas
}

func newGroup() string { return fmt.Sprintf("group-%d", groupSeq.Add(1)) }

// open opens a Source on topic for group and closes it at the end of the test.
func (c *cluster) open(t testing.TB, group, topic string, opts ...Option) *Source {
	t.Helper()
	base := []Option{
		WithBrokers(c.addrs...), WithGroup(group), WithTopics(topic),
		WithPollWait(200 * time.Millisecond), WithRevokeDrain(time.Second),
		WithClientOptions(kgo.FetchMaxWait(100*time.Millisecond), kgo.HeartbeatInterval(100*time.Millisecond)),
		WithLogger(testlog.New(t)),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := New(ctx, append(base, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// receiveN receives until it holds n deliveries (or fails the test after a
// generous deadline).
func receiveN(t testing.TB, s *Source, n int) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out []*adapters.Delivery
	for len(out) < n {
		ds, err := s.Receive(ctx, n-len(out))
		if err != nil {
			t.Fatalf("receive after %d of %d: %v", len(out), n, err)
		}
		out = append(out, ds...)
	}
	return out
}

// receiveFor receives for d and returns everything that arrived.
func receiveFor(t testing.TB, s *Source, d time.Duration) []*adapters.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var out []*adapters.Delivery
	for ctx.Err() == nil {
		ds, err := s.Receive(ctx, 1000)
		if err != nil && ctx.Err() == nil {
			t.Fatalf("receive: %v", err)
		}
		out = append(out, ds...)
	}
	return out
}

// eventually polls cond until it holds, failing after a generous deadline.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			// What every goroutine was doing: the lead when a wait that
			// passes thousands of times fails once on a loaded machine.
			var stacks strings.Builder
			_ = pprof.Lookup("goroutine").WriteTo(&stacks, 1)
			t.Logf("goroutines at the timeout:\n%s", stacks.String())
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func ack(t testing.TB, s *Source, ds ...*adapters.Delivery) {
	t.Helper()
	if err := s.Ack(context.Background(), ds); err != nil {
		t.Fatalf("ack: %v", err)
	}
}

func commitNow(t testing.TB, s *Source) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
}

func offsets(ds []*adapters.Delivery) []int64 {
	out := make([]int64, len(ds))
	for i, d := range ds {
		out[i] = d.Offset
	}
	return out
}

// hasCommit reports whether offs holds a committed offset for partition p.
func hasCommit(offs map[int32]int64, p int32) bool {
	o, ok := offs[p]
	return ok && o >= 0
}

// sinkOf returns a dead-letter sink on topic producing through s's client,
// closed at the end of the test.
func sinkOf(t testing.TB, s *Source, topic string) *DeadLetter {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dl, err := s.NewDeadLetter(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = dl.Close() })
	return dl
}

// encodeDone encodes the done offsets given in ascending order by each (all
// at or beyond base), with the leader epochs of their records. It returns ""
// when there is nothing to record.
func encodeDone(base int64, each func(fn func(pos int64, epoch int32))) string {
	e := newDoneEncoder(base)
	each(func(pos int64, epoch int32) { e.add(pos, pos, epoch) })
	return e.String()
}
