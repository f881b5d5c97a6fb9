package consumer_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The runtime's overhead per message, against a raw receive-then-ack loop over
// the same memory broker doing the same work: receive, call a no-op handler,
// ack. Compare the figures of one run; docs/benchmarks.md reports the ratio.
//
// Both sides work in rounds over a backlog of benchRound messages published
// while the timer is stopped, so the broker's own cost per message (which
// grows with the backlog) is the same for both whatever b.N is.

const (
	benchBatch = 10
	benchRound = 10000
)

// benchRounds calls round with a broker holding a fresh backlog of n
// messages, for rounds covering b.N messages. Each round is timed until it
// calls stop (which it must call once) or returns.
func benchRounds(b *testing.B, round func(br *memory.Broker, n int, stop func())) {
	b.ReportAllocs()
	b.StopTimer()
	msgs := make([]memory.Message, benchRound)
	for i := range msgs {
		msgs[i] = memory.Message{Body: []byte("payload")}
	}
	var cpu time.Duration
	for left := b.N; left > 0; left -= benchRound {
		n := min(left, benchRound)
		br := memory.NewBroker()
		for _, q := range []string{"q", "dlq"} {
			if err := br.CreateQueue(q, memory.QueueOptions{Lease: time.Minute}); err != nil {
				b.Fatal(err)
			}
		}
		if err := br.Publish(context.Background(), "q", msgs[:n]...); err != nil {
			b.Fatal(err)
		}
		start := processCPU()
		stopped := false
		stop := func() {
			if !stopped {
				b.StopTimer()
				cpu += processCPU() - start
				stopped = true
			}
		}
		b.StartTimer()
		round(br, n, stop)
		stop()
	}
	if cpu > 0 {
		// CPU time moves less than wall time on a shared machine, and it
		// counts work done in parallel on other cores.
		b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/msg")
	}
}

func BenchmarkRawReceiveAckLoop(b *testing.B) { benchmarkRawLoop(b, false, 0) }

// BenchmarkRawReceiveAckEachLoop acks every message on its own, as most
// hand-written consumers do: the ratio against it is the other bound.
func BenchmarkRawReceiveAckEachLoop(b *testing.B) { benchmarkRawLoop(b, true, 0) }

// The same loops and consumers with a handler that computes for about 2 µs
// (benchWork rounds of arithmetic, no allocation, no clock): the runtime's
// cost where a handler does work of its own, and what a deeper receive
// window (WithMaxInFlight) buys at concurrency 1.
func BenchmarkRawReceiveAckLoopWork(b *testing.B)    { benchmarkRawLoop(b, false, benchWork) }
func BenchmarkConsumerConcurrency1Work(b *testing.B) { benchmarkConsumer(b, 1, benchWork) }
func BenchmarkConsumerConcurrency1WorkInFlight100(b *testing.B) {
	benchmarkConsumer(b, 1, benchWork, consumer.WithMaxInFlight(100))
}

// benchWork is the rounds of work the *Work benchmarks' handlers do.
const benchWork = 2000

// work computes for a while, as a handler that does something.
func work(rounds int) {
	x := uint64(rounds)
	for range rounds {
		x = x*6364136223846793005 + 1442695040888963407
	}
	workSink.Add(x)
}

var workSink atomic.Uint64

// benchmarkRawLoop receives batches of ten, calls a handler doing rounds of
// work (none: a no-op) on each message and acks the batch at once, or each
// message after its handler.
func benchmarkRawLoop(b *testing.B, ackEach bool, rounds int) {
	ctx := context.Background()
	handler := func(context.Context, *consumer.Message) error {
		if rounds > 0 {
			work(rounds)
		}
		return nil
	}
	benchRounds(b, func(br *memory.Broker, n int, _ func()) {
		src, _ := br.Source("q", memory.WithPollWait(time.Millisecond))
		for done := 0; done < n; {
			ds, err := src.Receive(ctx, benchBatch)
			if err != nil {
				b.Fatal(err)
			}
			for i, d := range ds {
				_ = handler(ctx, &consumer.Message{ID: d.ID, Body: d.Body})
				if ackEach {
					if err := src.Ack(ctx, ds[i:i+1]); err != nil {
						b.Fatal(err)
					}
				}
			}
			if !ackEach {
				if err := src.Ack(ctx, ds); err != nil {
					b.Fatal(err)
				}
			}
			done += len(ds)
		}
	})
}

// benchmarkConsumer runs a consumer per round and stops the timer once every
// message is handled and acked; the shutdown is not timed. Its handler does
// rounds of work (none: a no-op).
func benchmarkConsumer(b *testing.B, concurrency, rounds int, opts ...consumer.Option) {
	logger := testlog.New(b)
	benchRounds(b, func(br *memory.Broker, n int, stop func()) {
		src, _ := br.Source("q", memory.WithPollWait(time.Millisecond))
		dlq, err := br.DeadLetterQueue("dlq")
		if err != nil {
			b.Fatal(err)
		}
		var handled atomic.Int64
		finished := make(chan struct{})
		target := int64(n)
		c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
			if rounds > 0 {
				work(rounds)
			}
			if handled.Add(1) == target {
				close(finished)
			}
			return nil
		}), append([]consumer.Option{consumer.WithConcurrency(concurrency), consumer.WithLogger(logger),
			consumer.WithDeadLetter(dlq)}, opts...)...)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() { done <- c.Run(ctx) }()
		<-finished
		for {
			if s, _ := br.Stats("q"); s.Acked == target {
				break
			}
			time.Sleep(20 * time.Microsecond)
		}
		stop()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	})
}

func BenchmarkConsumerConcurrency1(b *testing.B) { benchmarkConsumer(b, 1, 0) }
func BenchmarkConsumerConcurrency8(b *testing.B) { benchmarkConsumer(b, 8, 0) }

// benchmarkBatchConsumer is benchmarkConsumer with a batch handler marking
// every message of its batch done.
func benchmarkBatchConsumer(b *testing.B, concurrency, size int, opts ...consumer.Option) {
	logger := testlog.New(b)
	benchRounds(b, func(br *memory.Broker, n int, stop func()) {
		src, _ := br.Source("q", memory.WithPollWait(time.Millisecond))
		var handled atomic.Int64
		finished := make(chan struct{})
		target := int64(n)
		c, err := consumer.NewBatch(src, consumer.BatchHandlerFunc(func(ctx context.Context, bt *consumer.Batch) error {
			bt.DoneAll()
			if handled.Add(int64(len(bt.Messages))) == target {
				close(finished)
			}
			return nil
		}), append([]consumer.Option{consumer.WithConcurrency(concurrency), consumer.WithLogger(logger),
			consumer.WithBatchSize(size)}, opts...)...)
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error)
		go func() { done <- c.Run(ctx) }()
		<-finished
		for {
			if s, _ := br.Stats("q"); s.Acked == target {
				break
			}
			time.Sleep(20 * time.Microsecond)
		}
		stop()
		cancel()
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	})
}

func BenchmarkBatchConsumer100(b *testing.B) { benchmarkBatchConsumer(b, 1, 100) }
