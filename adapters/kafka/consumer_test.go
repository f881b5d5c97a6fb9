package kafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kgo"
)

// runConsumer runs a custody consumer over s until the returned stop is called.
func runConsumer(t *testing.T, s *Source, h consumer.HandlerFunc, opts ...consumer.Option) (stop func()) {
	t.Helper()
	_, stop = startConsumer(t, s, h, opts...)
	return stop
}

// A poison record at the head of a partition is retried in place, then
// dead-lettered with its headers; while the dead-letter topic refuses it the
// commit does not pass it, although every later record is done; once the
// produce succeeds the partition's commit moves to the end.
func TestPoisonRecordGoesToTheDeadLetterTopic(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	c.createTopic(t, "orders.dlq", 1)
	c.produce(t, &kgo.Record{Topic: "orders", Key: []byte("k0"), Value: []byte("poison"),
		Headers: []kgo.RecordHeader{{Key: "origin", Value: []byte("test")}}})
	c.produceN(t, "orders", 1, 20, 5) // offsets 1..20, keys other than k0
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(ByKey), WithCommitInterval(20*time.Millisecond))
	dl := sinkOf(t, s, "orders.dlq")
	refuse := failProduceTo(t, c, "orders.dlq")

	var mu sync.Mutex
	attempts, handled := 0, map[int64]int{}
	runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if string(m.Body) == "poison" {
			attempts++
			return errors.New("cannot parse")
		}
		handled[m.Offset]++
		return nil
	}, consumer.WithConcurrency(8),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(10 * time.Millisecond)}),
		consumer.WithDeadLetter(dl))

	eventually(t, "every later record to be handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(handled) == 20
	})
	for i := 0; i < 10; i++ {
		if offs, _ := c.committed(t, group, "orders"); offs[0] > 0 {
			t.Fatalf("committed %d while the poison record was not dead-lettered", offs[0])
		}
		time.Sleep(20 * time.Millisecond)
	}
	refuse.Store(false)
	eventually(t, "the commit to pass the dead-lettered record", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == 21
	})
	mu.Lock()
	if attempts != 3 {
		t.Errorf("poison record handled %d times, want MaxAttempts=3", attempts)
	}
	for o, n := range handled {
		if n != 1 {
			t.Errorf("offset %d handled %d times", o, n)
		}
	}
	mu.Unlock()
	dead := c.readTopic(t, "orders.dlq", 1)
	h := map[string]string{}
	for _, rh := range dead[0].Headers {
		h[rh.Key] = string(rh.Value)
	}
	if string(dead[0].Value) != "poison" || h["origin"] != "test" || h[adapters.HeaderAttempts] != "3" ||
		h[adapters.HeaderOriginalOffset] != "0" || h[HeaderGroup] != group {
		t.Fatalf("dead letter %q with headers %v", dead[0].Value, h)
	}
}

// With by-key ordering, records with the same key in a partition run one at
// a time in offset order while different keys overlap.
func TestByKeyRunsKeysConcurrentlyAndInOrder(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 2)
	c.produceN(t, "orders", 2, 200, 10)
	s := c.open(t, newGroup(), "orders", WithOrderingScope(ByKey))

	var mu sync.Mutex
	last := map[string]int64{}
	running := map[string]bool{}
	inFlight, peak, n := 0, 0, 0
	var bad []string
	stop := runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		lane := fmt.Sprintf("%d/%s", m.Partition, m.Key)
		mu.Lock()
		if running[lane] {
			bad = append(bad, "concurrent "+lane)
		}
		if prev, ok := last[lane]; ok && prev >= m.Offset {
			bad = append(bad, fmt.Sprintf("%s: %d after %d", lane, m.Offset, prev))
		}
		running[lane] = true
		inFlight++
		peak = max(peak, inFlight)
		mu.Unlock()
		time.Sleep(time.Millisecond)
		mu.Lock()
		running[lane] = false
		last[lane] = m.Offset
		inFlight--
		n++
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(32))
	eventually(t, "every record handled", func() bool { mu.Lock(); defer mu.Unlock(); return n == 400 })
	stop()
	if len(bad) > 0 {
		t.Fatalf("order violations: %v", bad[:min(len(bad), 5)])
	}
	if peak < 4 {
		t.Errorf("at most %d handlers ran at once over 20 lanes", peak)
	}
}

// By partition, one record that runs long (a slow call, a retry waiting in
// place, a deferral behind a claimed key) holds up its partition only. The
// runtime holds few records (its in-flight window, 20 here) and runs one
// record of a partition at a time, queueing the others: the Source hands
// out no more of a partition than its share of the window, or the stuck
// partition's records would fill it, one Receive after another, and every
// other partition would stop.
func TestLongRecordHoldsUpItsPartitionOnly(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "orders", 8)
	c.produceN(t, "orders", 8, 50, 50)
	s := c.open(t, newGroup(), "orders")
	release := make(chan struct{})
	var mu sync.Mutex
	others := 0
	stop := runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		if m.Partition == 0 && m.Offset == 0 {
			select {
			case <-release:
			case <-ctx.Done():
			}
			return ctx.Err()
		}
		if m.Partition != 0 {
			mu.Lock()
			others++
			mu.Unlock()
		}
		return nil
	}, consumer.WithConcurrency(8))
	defer stop()
	defer close(release)
	eventually(t, "every record of the other partitions to be handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return others == 7*50
	})
}

// By key, one record that runs long holds up its key only. Its key's later
// records wait behind it, outside the runtime's in-flight window (4 here):
// a record queued behind its key costs the broker nothing, and the
// partition's unacked bound (WithMaxUnackedPerPartition) bounds them
// instead. Every other key's record is handled meanwhile, while the commit
// waits at the running record; once it returns, every record has been
// handled once, each key's in offset order, and the commit reaches the end.
func TestLongRecordHoldsUpItsKeyOnly(t *testing.T) {
	const slowLater, others, otherKeys = 30, 30, 5
	c := newCluster(t)
	c.createTopic(t, "orders", 1)
	rs := []*kgo.Record{{Topic: "orders", Key: []byte("slow"), Value: []byte("first")}}
	for i := 0; i < max(slowLater, others); i++ {
		if i < slowLater {
			rs = append(rs, &kgo.Record{Topic: "orders", Key: []byte("slow")})
		}
		if i < others {
			rs = append(rs, &kgo.Record{Topic: "orders", Key: fmt.Appendf(nil, "key-%d", i%otherKeys)})
		}
	}
	c.produce(t, rs...)
	total := len(rs)
	group := newGroup()
	s := c.open(t, group, "orders", WithOrderingScope(ByKey), WithCommitInterval(20*time.Millisecond))
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	var mu sync.Mutex
	runs := map[int64]int{}
	perKey := map[string][]int64{}
	handledOthers := 0
	stop := runConsumer(t, s, func(ctx context.Context, m *consumer.Message) error {
		if m.Offset == 0 {
			<-release
		}
		mu.Lock()
		defer mu.Unlock()
		runs[m.Offset]++
		perKey[m.Key] = append(perKey[m.Key], m.Offset)
		if m.Key != "slow" {
			handledOthers++
		}
		return nil
	}, consumer.WithConcurrency(2), consumer.WithMaxInFlight(4))
	t.Cleanup(unblock) // before the consumer stops, should the test fail first
	eventually(t, "every other key's record handled while the slow one runs", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return handledOthers == others
	})
	if offs, _ := c.committed(t, group, "orders"); offs[0] > 0 {
		t.Fatalf("committed %d while offset 0 runs", offs[0])
	}
	unblock()
	eventually(t, "the commit to reach the end", func() bool {
		offs, _ := c.committed(t, group, "orders")
		return offs[0] == int64(total)
	})
	stop()
	mu.Lock()
	defer mu.Unlock()
	for o := int64(0); o < int64(total); o++ {
		if runs[o] != 1 {
			t.Errorf("offset %d handled %d times, want once", o, runs[o])
		}
	}
	for k, offs := range perKey {
		if !slices.IsSorted(offs) {
			t.Errorf("key %s handled out of offset order: %v", k, offs)
		}
	}
}
