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

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// transaction is a transaction of the cluster's transactional producer for
// a topic, writing to its partition 0. Each transaction ends with a control
// record (the commit or abort marker) that takes an offset of its own and
// that consumers never see.
type transaction struct {
	t      *testing.T
	c      *cluster
	cl     *kgo.Client
	topic  string
	values []string
}

// txnProducer returns the cluster's transactional producer for topic, one
// for all the transactions of a test, run one after the other. A client
// per transaction made the flake of TestTransactionMarkersAreCommittedPast:
// on a client's first produce to a topic, franz-go (v1.22.3) can lose track
// of the partition it added to the transaction, and EndTransaction(TryCommit)
// then aborts the transaction although its produce succeeded, logs "no
// produce succeeded in this transaction but produces were attempted; issuing
// an abort", and returns nil. Read committed, the Source then rightly never
// ran the "committed" record. A client past its first transaction has the
// topic's partitions loaded; end verifies the outcome all the same.
func (c *cluster) txnProducer(t *testing.T, topic string) *kgo.Client {
	t.Helper()
	c.txnMu.Lock()
	defer c.txnMu.Unlock()
	if cl := c.txnClients[topic]; cl != nil {
		return cl
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.TransactionalID(fmt.Sprintf("txn-%s-%d", topic, time.Now().UnixNano())),
		kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	if c.txnClients == nil {
		c.txnClients = map[string]*kgo.Client{}
	}
	c.txnClients[topic] = cl
	return cl
}

func (c *cluster) beginTransaction(t *testing.T, topic string, values ...string) *transaction {
	t.Helper()
	cl := c.txnProducer(t, topic)
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
	return &transaction{t: t, c: c, cl: cl, topic: topic, values: values}
}

func (x *transaction) end(commit bool) {
	x.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := x.cl.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
		x.t.Fatalf("ending the transaction: %v", err)
	}
	if commit {
		x.c.requireReadable(x.t, x.topic, x.values)
	}
}

// requireReadable fails the test unless a read-committed consumer reads
// values (the last records readable of partition 0 of topic): a transaction
// the producer was asked to commit was aborted, and the test's offsets and
// expectations no longer hold.
func (c *cluster) requireReadable(t *testing.T, topic string, values []string) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.addrs...), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: {0: kgo.NewOffset().AtStart()}}),
		kgo.FetchMaxWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var read []string
	for ctx.Err() == nil {
		fs := cl.PollFetches(ctx)
		fs.EachRecord(func(r *kgo.Record) { read = append(read, string(r.Value)) })
		if len(read) >= len(values) && slices.Equal(read[len(read)-len(values):], values) {
			return
		}
	}
	t.Fatalf("the transaction of %v was committed, but a read-committed consumer reads %v: the producer aborted it", values, read)
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
	// The lag comes from fetches alone here (the refresh, which lists the
	// ends itself, is TestLagRefreshReadCommittedCountsToTheLastStableOffset's).
	s := c.open(t, group, "ledger", WithMeterProvider(mp), WithCommitInterval(20*time.Millisecond), WithLagRefresh(0),
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
	seen := -1
	eventually(t, "the committed transactions' records run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		if len(ran) != seen {
			// Should the wait time out, the log says which record it
			// stopped at.
			seen = len(ran)
			t.Logf("ran so far: %v", ran)
		}
		return len(ran) >= 4
	})
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

// commitPastMarkers receives, expecting nothing to hand out (only
// transaction markers are left, done without running), and commits until
// the group's commit of partition 0 reaches want.
func (c *cluster) commitPastMarkers(t *testing.T, s *Source, topic string, want int64) {
	t.Helper()
	eventually(t, fmt.Sprintf("the commit past the markers (%d)", want), func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		if ds, _ := s.Receive(ctx, 10); len(ds) > 0 {
			t.Fatalf("received %v; only markers were left", offsets(ds))
		}
		commitNow(t, s)
		offs, _ := c.committed(t, s.cfg.group, topic)
		return offs[0] == want
	})
}

// TestAbortedTransactionAtTheCommittedOffsetIsNotReportedExpired: read
// committed, the client never hands over an aborted transaction's records,
// so a partition's first record after an assignment can lie well above its
// committed offset with nothing deleted: the offsets between hold records
// nobody should run. That gap is not retention's (the log still starts at
// 0), and Receive must not report it as records deleted before the group
// read them, nor count them in custody.kafka.expired.
func TestAbortedTransactionAtTheCommittedOffsetIsNotReportedExpired(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "ledger", 1)
	c.beginTransaction(t, "ledger", "a", "b", "c").end(true) // offsets 0-2, marker 3
	group := newGroup()
	readCommitted := WithClientOptions(kgo.FetchIsolationLevel(kgo.ReadCommitted()))
	first := c.open(t, group, "ledger", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), readCommitted)
	ack(t, first, receiveN(t, first, 3)...)
	c.commitPastMarkers(t, first, "ledger", 4)
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	c.beginTransaction(t, "ledger", "x", "y").end(false) // offsets 4-5 aborted, marker 6
	c.beginTransaction(t, "ledger", "d").end(true)       // offset 7, marker 8

	reader, mp := newMeter(t)
	s := c.open(t, group, "ledger", WithCommitInterval(time.Hour), WithCommitLinger(time.Hour), WithMeterProvider(mp), readCommitted)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got []*adapters.Delivery
	for len(got) == 0 {
		ds, err := s.Receive(ctx, 10)
		if err != nil {
			t.Fatalf("Receive after an aborted transaction at the committed offset: %v", err)
		}
		got = append(got, ds...)
	}
	if o := offsets(got); !slices.Equal(o, []int64{7}) {
		t.Fatalf("received offsets %v, want only the committed transaction's record at 7", o)
	}
	if expired, ok := collect(t, reader, "custody.kafka.expired").(metricdata.Sum[int64]); ok && len(expired.DataPoints) > 0 {
		t.Fatalf("custody.kafka.expired = %+v after an aborted transaction; nothing was deleted", expired)
	}
}

// TestLagRefreshReadCommittedCountsToTheLastStableOffset: read committed,
// the records of a transaction still open cannot be read yet, so they are no
// lag. That holds for the end offsets the Source lists itself for a
// partition no fetch reports on (here: nothing readable to fetch), not only
// for those fetches bring: listing the high watermark instead showed the
// open transaction as lag that no consumer could work off.
func TestLagRefreshReadCommittedCountsToTheLastStableOffset(t *testing.T) {
	c := newCluster(t)
	c.createTopic(t, "ledger", 1)
	c.beginTransaction(t, "ledger", "a", "b").end(true) // offsets 0-1, marker 2
	c.beginTransaction(t, "ledger", "e")                // offset 3, open
	reader, mp := newMeter(t)
	s := c.open(t, newGroup(), "ledger", WithMeterProvider(mp), WithCommitInterval(time.Hour), WithCommitLinger(time.Hour),
		WithLagRefresh(20*time.Millisecond), WithClientOptions(kgo.FetchIsolationLevel(kgo.ReadCommitted())))
	ack(t, s, receiveN(t, s, 2)...)
	c.commitPastMarkers(t, s, "ledger", 3)
	listed := time.Now()
	eventually(t, "the partition's end listed after the commit", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		p := s.parts[tpKey{"ledger", 0}]
		return p != nil && p.hwmAt.After(listed)
	})
	if lag := lagByPartition(t, reader); len(lag) != 1 || lag[0] != 0 {
		t.Fatalf("lag = %v with everything readable done and a transaction open; want 0", lag)
	}
}
