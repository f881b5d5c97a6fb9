package consumer_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testlog"
)

// The runtime's overhead per message, against a raw receive-then-ack loop over
// the same memory broker doing the same work: receive, call a no-op handler,
// ack. Compare the two ns/op figures from one run; the README reports the
// ratio.

const benchBatch = 10

func benchBroker(b *testing.B, n int) *memory.Broker {
	b.Helper()
	br := memory.NewBroker()
	if err := br.CreateQueue("q", memory.QueueOptions{Lease: time.Minute}); err != nil {
		b.Fatal(err)
	}
	msgs := make([]memory.Message, n)
	for i := range msgs {
		msgs[i] = memory.Message{Body: []byte("payload")}
	}
	if err := br.Publish(context.Background(), "q", msgs...); err != nil {
		b.Fatal(err)
	}
	return br
}

func BenchmarkRawReceiveAckLoop(b *testing.B) { benchmarkRawLoop(b, false) }

// BenchmarkRawReceiveAckEachLoop acks every message on its own, as most
// hand-written consumers do: the ratio against it is the other bound.
func BenchmarkRawReceiveAckEachLoop(b *testing.B) { benchmarkRawLoop(b, true) }

// benchmarkRawLoop receives batches of ten, calls a no-op handler on each
// message and acks the batch at once, or each message after its handler.
func benchmarkRawLoop(b *testing.B, ackEach bool) {
	br := benchBroker(b, b.N)
	src, _ := br.Source("q", memory.WithPollWait(time.Millisecond))
	ctx := context.Background()
	handler := func(context.Context, *consumer.Message) error { return nil }
	b.ReportAllocs()
	b.ResetTimer()
	for done := 0; done < b.N; {
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
}

func benchmarkConsumer(b *testing.B, concurrency int) {
	br := benchBroker(b, b.N)
	src, _ := br.Source("q", memory.WithPollWait(time.Millisecond))
	var handled atomic.Int64
	finished := make(chan struct{})
	target := int64(b.N)
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if handled.Add(1) == target {
			close(finished)
		}
		return nil
	}), consumer.WithConcurrency(concurrency), consumer.WithLogger(testlog.New(b)))
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.ReportAllocs()
	b.ResetTimer()
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()
	<-finished
	for {
		if s, _ := br.Stats("q"); s.Acked == target {
			break
		}
		time.Sleep(50 * time.Microsecond)
	}
	b.StopTimer()
	cancel()
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

func BenchmarkConsumerConcurrency1(b *testing.B) { benchmarkConsumer(b, 1) }
func BenchmarkConsumerConcurrency8(b *testing.B) { benchmarkConsumer(b, 8) }
