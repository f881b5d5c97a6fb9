package kafka

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/consumer"
	"github.com/twmb/franz-go/pkg/kgo"
)

// custodyBatchRun is custodyRun with a batch handler that marks every
// message of its batch done.
func (bc *benchCluster) custodyBatchRun(b *testing.B, total int, src []Option, opts ...consumer.Option) side {
	s, err := New(context.Background(), append([]Option{WithBrokers(bc.addrs...), WithGroup(newGroup()), WithTopics("bench"),
		WithPollWait(100 * time.Millisecond), WithClientOptions(kgo.FetchMaxWait(50 * time.Millisecond))}, src...)...)
	if err != nil {
		b.Fatal(err)
	}
	var handled atomic.Int64
	all := make(chan struct{})
	var first func()
	h := consumer.BatchHandlerFunc(func(ctx context.Context, bt *consumer.Batch) error {
		if handled.Load() == 0 {
			first()
		}
		bt.DoneAll()
		if handled.Add(int64(len(bt.Messages))) == int64(total) {
			close(all)
		}
		return nil
	})
	quiet := slog.New(slog.NewTextHandler(discard{}, nil))
	c, err := consumer.NewBatch(s, h, append([]consumer.Option{consumer.WithLogger(quiet)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	res := bc.measure(total, func(f func()) {
		first = f
		go func() { done <- c.Run(ctx) }()
		<-all
	})
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
	return res
}

// No-op batch handler against the raw poll loop, the whole topic read by
// a fresh group each time (issue 20's goal: at least 0.5 of the raw loop
// end to end). By partition, batches hold runs of each partition's records
// in order.
func BenchmarkNoopBatchAgainstRawPollLoop(b *testing.B) {
	const perPartition = 12500
	total := benchPartitions * perPartition
	bc := newBenchCluster(b, perPartition)
	for _, size := range []int{100, 1000} {
		b.Run(map[int]string{100: "batch100", 1000: "batch1000"}[size], func(b *testing.B) {
			var raw, cus side
			for i := 0; i < b.N; i++ {
				raw.add(bc.measure(total, func(first func()) { bc.rawPollLoop(b, total, first, func(*kgo.Record) {}) }))
				cus.add(bc.custodyBatchRun(b, total, nil, consumer.WithBatchSize(size), consumer.WithConcurrency(benchPartitions)))
			}
			raw.report(b, "raw")
			cus.report(b, "custody")
			b.ReportMetric(cus.perSec()/raw.perSec(), "ratio")
			b.ReportMetric(cus.steadyPerSec()/raw.steadyPerSec(), "steady_ratio")
		})
	}
}
