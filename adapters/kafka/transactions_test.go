package kafka

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/custody-go/custody/consumer"
)

// transaction is a transactional producer writing to partition 0 of a
// topic. Each transaction ends with a control record (the commit or abort
// marker) that takes an offset of its own and that consumers never see.
type transaction struct {
	t  *testing.T
	cl *kgo.Client
}

func (c *cluster) beginTransaction(t *testing.T, topic string, values ...string) *transaction {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(fmt.Sprintf("txn-%s-%d", topic, time.Now().UnixNano())),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if err := cl.BeginTransaction(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, v := range values {
		if err := cl.ProduceSync(ctx, &kgo.Record{Topic: topic, Partition: 0, Value: []byte(v)}).FirstErr(); err != nil {
			t.Fatalf("producing in a transaction: %v", err)
		}
	}
	return &transaction{t: t, cl: cl}
}

func (x *transaction) end(commit bool) {
	x.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := x.cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
		x.t.Fatalf("ending the transaction: %v", err)
	}
}

// TestTransactionMarkersAreCommittedPast: a topic written by a transactional
// producer holds a marker after each transaction. The consumer never sees a
// marker, but its commit must pass it once everything before it is done;
// otherwise the committed offset stays one short of the end of the
// partition for good, the lag never falls to 0 and every lag alert fires.
// Read committed, the aborted transaction's records are not run, and the
// commit passes them and their marker too; the records of a transaction
// still open are not lag, since they cannot be read yet.
func TestTransactionMarkersAreCommittedPast(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "ledger", 1)
	c.beginTransaction(t, "ledger", "a", "b", "c").end(true) // offsets 0-2, marker 3
	c.beginTransaction(t, "ledger", "x", "y").end(false)     // offsets 4-5 aborted, marker 6
	c.beginTransaction(t, "ledger", "d").end(true)           // offset 7, marker 8
	open := c.beginTransaction(t, "ledger", "e")             // offset 9, open
	reader, mp := newMeter(t)
	group := newGroup()
	s := c.open(t, group, "ledger", WithMeterProvider(mp), WithCommitInterval(20*time.Millisecond),
		WithClientOptions(kgo.FetchIsolationLevel(kgo.ReadCommitted())))
	var mu sync.Mutex
	var ran []string
	stop := runConsumer(t, s, func(_ context.Context, m *consumer.Message) error {
		mu.Lock()
		ran = append(ran, string(m.Body))
		mu.Unlock()
		return nil
	})
	ranAll := func(n int) func() bool {
		return func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(ran) >= n
		}
	}
	committedAt := func(want int64) func() bool {
		return func() bool {
			offs, _ := c.committed(t, group, "ledger")
			return offs[0] == want
		}
	}
	lag := func() []metricdata.DataPoint[int64] {
		g, _ := collect(t, reader, "custody.kafka.lag").(metricdata.Gauge[int64])
		return g.DataPoints
	}
	eventually(t, "the committed transactions' records run", ranAll(4))
	eventually(t, "the commit past the last marker (9)", committedAt(9))
	// The Source learns the commit was accepted a moment after the group
	// holds it: the gauge follows then.
	eventually(t, "no lag with everything readable done and a transaction open",
		func() bool { l := lag(); return len(l) == 1 && l[0].Value == 0 })

	open.end(true) // offset 9 readable, marker 10
	eventually(t, "the transaction ended last to run", ranAll(5))
	eventually(t, "the commit at the end of the partition (11)", committedAt(11))
	eventually(t, "no lag", func() bool { l := lag(); return len(l) == 1 && l[0].Value == 0 })
	stop()
	mu.Lock()
	defer mu.Unlock()
	if want := []string{"a", "b", "c", "d", "e"}; !slices.Equal(ran, want) {
		t.Errorf("ran %v, want the committed transactions' records %v", ran, want)
	}
}
