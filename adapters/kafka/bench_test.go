package kafka

import (
	"context"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// Benchmarks compare custody with franz-go doing the same work on the same
// topic contents in the same run, and report the ratio. Each iteration reads
// the whole topic with a fresh group. Run with a small -benchtime, e.g.
//
//	go test -run XXX -bench . -benchtime 2x ./adapters/kafka/
//
// Reported per side: records/s, allocs/record, commits/s (offset commit
// requests the cluster received, per second of the run), and for custody
// uncommitted_rec: the records handled but not yet committed, sampled every
// few milliseconds during the run and averaged, which is what a crash at a
// random moment would run again. Sides named *_interval commit once per
// commit interval only (WithCommitLinger set to the interval), as custody
// did before commits followed the acks by a linger.

const (
	benchPartitions = 8
	benchKeys       = 1000
)

// benchCluster holds a cluster with one topic of n records per partition and
// counts the offset commit requests it receives.
type benchCluster struct {
	*cluster
	commits atomic.Int64
}

func newBenchCluster(b *testing.B, perPartition int) *benchCluster {
	b.Helper()
	bc := &benchCluster{cluster: newCluster(b)}
	bc.createTopic(b, "bench", benchPartitions)
	for i := 0; i < perPartition; i += 1000 {
		bc.produceN(b, "bench", benchPartitions, min(1000, perPartition-i), benchKeys)
	}
	bc.fake.ControlKey(int16(kmsg.OffsetCommit), func(kmsg.Request) (kmsg.Response, error, bool) {
		bc.fake.KeepControl()
		bc.commits.Add(1)
		return nil, nil, false
	})
	return bc
}

// side is one measured run.
type side struct {
	records int
	elapsed time.Duration
	// steady is the time from the first record handed to the handler to
	// the last: the run without the group join and first fetch.
	steady  time.Duration
	mallocs uint64
	commits int64
	// uncommitted sums the samples of records handled and not committed;
	// samples counts them.
	uncommitted, samples int64
}

func (s *side) add(o side) {
	s.records += o.records
	s.elapsed += o.elapsed
	s.steady += o.steady
	s.mallocs += o.mallocs
	s.commits += o.commits
	s.uncommitted += o.uncommitted
	s.samples += o.samples
}

func (s side) perSec() float64 { return float64(s.records) / s.elapsed.Seconds() }

func (s side) steadyPerSec() float64 { return float64(s.records) / s.steady.Seconds() }

func (s side) report(b *testing.B, name string) {
	b.ReportMetric(s.perSec(), name+"_rec/s")
	if s.steady > 0 {
		b.ReportMetric(s.steadyPerSec(), name+"_steady_rec/s")
	}
	b.ReportMetric(float64(s.mallocs)/float64(s.records), name+"_allocs/rec")
	b.ReportMetric(float64(s.commits)/s.elapsed.Seconds(), name+"_commits/s")
	if s.samples > 0 {
		b.ReportMetric(float64(s.uncommitted)/float64(s.samples), name+"_uncommitted_rec")
	}
}

// measure runs fn and returns its elapsed time, allocations and commits. fn
// calls first when it hands the first record to its handler.
func (bc *benchCluster) measure(records int, fn func(first func())) side {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	c0 := bc.commits.Load()
	start := time.Now()
	var firstAt atomic.Int64
	fn(func() { firstAt.CompareAndSwap(0, int64(time.Since(start))) })
	elapsed := time.Since(start)
	runtime.ReadMemStats(&after)
	s := side{records: records, elapsed: elapsed, mallocs: after.Mallocs - before.Mallocs, commits: bc.commits.Load() - c0}
	if f := firstAt.Load(); f > 0 {
		s.steady = elapsed - time.Duration(f)
	}
	return s
}

// rawPollLoop is the franz-go baseline: poll, run the handler on each record
// in turn, commit what was polled, repeat.
func (bc *benchCluster) rawPollLoop(b *testing.B, total int, first func(), handle func(*kgo.Record)) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(bc.addrs...), kgo.ConsumerGroup(newGroup()), kgo.ConsumeTopics("bench"),
		kgo.DisableAutoCommit(), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	for n := 0; n < total; {
		fs := cl.PollFetches(ctx)
		if n == 0 && fs.NumRecords() > 0 {
			first()
		}
		fs.EachRecord(func(r *kgo.Record) {
			handle(r)
			n++
		})
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// custodyRun consumes the whole topic through the runtime and stops once
// every record was handled (the shutdown is not timed).
func (bc *benchCluster) custodyRun(b *testing.B, total int, h consumer.HandlerFunc, src []Option, opts ...consumer.Option) side {
	group := newGroup()
	s, err := New(context.Background(), append([]Option{WithBrokers(bc.addrs...), WithGroup(group), WithTopics("bench"),
		WithPollWait(100 * time.Millisecond), WithClientOptions(kgo.FetchMaxWait(50 * time.Millisecond))}, src...)...)
	if err != nil {
		b.Fatal(err)
	}
	var handled atomic.Int64
	all := make(chan struct{})
	var first func()
	count := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if handled.Load() == 0 {
			first()
		}
		err := h(ctx, m)
		if handled.Add(1) == int64(total) {
			close(all)
		}
		return err
	})
	quiet := slog.New(slog.NewTextHandler(discard{}, nil))
	c, err := consumer.New(s, count, append([]consumer.Option{consumer.WithLogger(quiet)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var uncommitted, samples atomic.Int64
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		bc.sampleUncommitted(group, &handled, all, &uncommitted, &samples)
	}()
	res := bc.measure(total, func(f func()) {
		first = f
		go func() { done <- c.Run(ctx) }()
		<-all
	})
	<-sampled
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	res.uncommitted, res.samples = uncommitted.Load(), samples.Load()
	return res
}

// sampleUncommitted adds, every few milliseconds until stop, the number of
// records handled but not committed by group to sum, counting the samples
// in n. The committed offsets are read first: every record they cover was
// handled before, so the difference never goes below zero.
func (bc *benchCluster) sampleUncommitted(group string, handled *atomic.Int64, stop <-chan struct{}, sum, n *atomic.Int64) {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := bc.admin.FetchOffsets(ctx, group)
		cancel()
		if err != nil {
			continue
		}
		var committed int64
		resp.Each(func(o kadm.OffsetResponse) {
			if o.Err == nil && o.At > 0 {
				committed += o.At
			}
		})
		if h := handled.Load(); h > 0 {
			sum.Add(max(0, h-committed))
			n.Add(1)
		}
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// sourceLoop drives the Source directly, without the runtime: receive a
// batch, ack it. It isolates the adapter's own cost.
func (bc *benchCluster) sourceLoop(b *testing.B, total int) side {
	s, err := New(context.Background(), WithBrokers(bc.addrs...), WithGroup(newGroup()), WithTopics("bench"),
		WithPollWait(100*time.Millisecond), WithClientOptions(kgo.FetchMaxWait(50*time.Millisecond)))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	return bc.measure(total, func(first func()) {
		for n := 0; n < total; {
			ds, err := s.Receive(ctx, 256)
			if err != nil {
				b.Fatal(err)
			}
			if n == 0 && len(ds) > 0 {
				first()
			}
			if err := s.Ack(ctx, ds); err != nil {
				b.Fatal(err)
			}
			n += len(ds)
		}
	})
}

// No-op handler: custody (default by-partition ordering, one worker per
// partition) against the raw poll loop. Goal: ratio at least 0.5.
func BenchmarkNoopAgainstRawPollLoop(b *testing.B) {
	const perPartition = 12500
	total := benchPartitions * perPartition
	bc := newBenchCluster(b, perPartition)
	noop := func(context.Context, *consumer.Message) error { return nil }
	b.Run("SourceOnly", func(b *testing.B) {
		var raw, src side
		for i := 0; i < b.N; i++ {
			raw.add(bc.measure(total, func(first func()) { bc.rawPollLoop(b, total, first, func(*kgo.Record) {}) }))
			src.add(bc.sourceLoop(b, total))
		}
		raw.report(b, "raw")
		src.report(b, "source")
		b.ReportMetric(src.perSec()/raw.perSec(), "ratio")
		b.ReportMetric(src.steadyPerSec()/raw.steadyPerSec(), "steady_ratio")
	})
	for _, mode := range []OrderingScope{ByPartition, Unordered} {
		b.Run(mode.String(), func(b *testing.B) {
			var raw, cus, interval side
			for i := 0; i < b.N; i++ {
				raw.add(bc.measure(total, func(first func()) { bc.rawPollLoop(b, total, first, func(*kgo.Record) {}) }))
				cus.add(bc.custodyRun(b, total, noop, []Option{WithOrderingScope(mode)}, consumer.WithConcurrency(64)))
				interval.add(bc.custodyRun(b, total, noop, []Option{WithOrderingScope(mode), WithCommitLinger(DefaultCommitInterval)}, consumer.WithConcurrency(64)))
			}
			raw.report(b, "raw")
			cus.report(b, "custody")
			interval.report(b, "custody_interval")
			b.ReportMetric(cus.perSec()/raw.perSec(), "ratio")
			b.ReportMetric(cus.steadyPerSec()/raw.steadyPerSec(), "steady_ratio")
			b.ReportMetric(interval.perSec()/raw.perSec(), "interval_ratio")
		})
	}
}

// A 1 ms handler over 8 partitions and 1,000 keys: by-key ordering at
// concurrency 256 against partition-serial processing (the raw poll loop, one
// record at a time, and custody's by-partition ordering). Goal: at least 30x.
func BenchmarkByKeyAgainstPartitionSerial(b *testing.B) {
	const perPartition = 1000
	total := benchPartitions * perPartition
	bc := newBenchCluster(b, perPartition)
	work := func() { time.Sleep(time.Millisecond) }
	h := func(context.Context, *consumer.Message) error { work(); return nil }
	var serialRaw, serial, byKey, serialInterval, byKeyInterval side
	interval := WithCommitLinger(DefaultCommitInterval)
	for i := 0; i < b.N; i++ {
		// One record at a time takes total ms; a quarter of the topic
		// measures its rate well enough.
		serialRaw.add(bc.measure(total/4, func(first func()) { bc.rawPollLoop(b, total/4, first, func(*kgo.Record) { work() }) }))
		serial.add(bc.custodyRun(b, total, h, []Option{WithOrderingScope(ByPartition)}, consumer.WithConcurrency(benchPartitions)))
		byKey.add(bc.custodyRun(b, total, h, []Option{WithOrderingScope(ByKey)}, consumer.WithConcurrency(256)))
		serialInterval.add(bc.custodyRun(b, total, h, []Option{WithOrderingScope(ByPartition), interval}, consumer.WithConcurrency(benchPartitions)))
		byKeyInterval.add(bc.custodyRun(b, total, h, []Option{WithOrderingScope(ByKey), interval}, consumer.WithConcurrency(256)))
	}
	serialRaw.report(b, "rawserial")
	serial.report(b, "bypartition")
	byKey.report(b, "bykey")
	serialInterval.report(b, "bypartition_interval")
	byKeyInterval.report(b, "bykey_interval")
	b.ReportMetric(byKey.perSec()/serialRaw.perSec(), "ratio_vs_raw")
	b.ReportMetric(byKey.perSec()/serial.perSec(), "ratio_vs_bypartition")
}

// rawPartitionLoop is the franz-go baseline for by-partition ordering: poll,
// run each partition's records in turn on a goroutine of its own, all
// partitions at once, wait for them, commit what was polled, repeat.
func (bc *benchCluster) rawPartitionLoop(b *testing.B, total int, first func(), handle func(*kgo.Record)) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(bc.addrs...), kgo.ConsumerGroup(newGroup()), kgo.ConsumeTopics("bench"),
		kgo.DisableAutoCommit(), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()
	for n := 0; n < total; {
		fs := cl.PollFetches(ctx)
		if n == 0 && fs.NumRecords() > 0 {
			first()
		}
		var wg sync.WaitGroup
		fs.EachPartition(func(p kgo.FetchTopicPartition) {
			n += len(p.Records)
			wg.Go(func() {
				for _, r := range p.Records {
					handle(r)
				}
			})
		})
		wg.Wait()
		if err := cl.CommitUncommittedOffsets(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// A 2 ms handler over a backlog of 2,500 records per partition, one record
// at a time per partition (the default ordering), at concurrency 8 (one
// worker per partition) and the runtime's default in-flight window: custody
// against franz-go running each partition on a goroutine of its own. A deep
// backlog must keep every partition busy, not a few.
func BenchmarkDeepBacklogByPartition(b *testing.B) {
	const perPartition = 2500
	total := benchPartitions * perPartition
	bc := newBenchCluster(b, perPartition)
	work := func() { time.Sleep(2 * time.Millisecond) }
	h := func(context.Context, *consumer.Message) error { work(); return nil }
	var raw, cus side
	for i := 0; i < b.N; i++ {
		raw.add(bc.measure(total, func(first func()) { bc.rawPartitionLoop(b, total, first, func(*kgo.Record) { work() }) }))
		cus.add(bc.custodyRun(b, total, h, nil, consumer.WithConcurrency(benchPartitions)))
	}
	raw.report(b, "raw")
	cus.report(b, "custody")
	b.ReportMetric(cus.perSec()/raw.perSec(), "ratio")
}
