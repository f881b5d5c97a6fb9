package awssqs

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// The benchmarks compare, on the same emulator in the same run, a naive
// receive-1/delete-1 loop, a single-poller receive-10/delete-batch-10 loop,
// and custody with a no-op handler; each reports msg/s, requests per message
// (counted at the HTTP transport) and, for custody, its throughput as a
// multiple of the two raw loops ("x-batched", "x-naive").
//
// All of them short-poll (WaitTimeSeconds 0): the emulator answers a long
// poll only once it is full or its wait is over, which would add a whole
// wait to whichever reader asks for more than is left at the end of a run.
// On a queue with a backlog, short and long polls return full batches alike.
//
//	go test -run '^$' -bench SQS -benchtime 2000x -count 1 ./adapters/awssqs/
//
// One op is one message.

var benchRates sync.Map // sub-benchmark name -> msg/s, for the ratios

func BenchmarkSQS(b *testing.B) {
	b.Run("raw-naive", func(b *testing.B) { benchRaw(b, 1) })
	b.Run("raw-batched", func(b *testing.B) { benchRaw(b, 10) })
	b.Run("custody", func(b *testing.B) { benchCustody(b, 0, 32) })
	// A handler that outlives a third of the visibility timeout, so every
	// message is renewed once: the heartbeat's cost per message.
	b.Run("custody-heartbeat", func(b *testing.B) { benchCustody(b, 1500*time.Millisecond, 256) })
}

// benchQueue puts n messages on a fresh queue with SendMessageBatch, concurrently.
func benchQueue(b *testing.B, e *env, n int, visibility time.Duration) string {
	b.Helper()
	url, _ := e.queue(false, visibility, nil)
	payload := fmt.Sprintf("%0256d", 0) // 256-byte bodies
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for start := 0; start < n; start += 10 {
		entries := make([]types.SendMessageBatchRequestEntry, 0, 10)
		for i := start; i < min(n, start+10); i++ {
			entries = append(entries, types.SendMessageBatchRequestEntry{Id: aws.String(fmt.Sprint(i - start)), MessageBody: aws.String(payload)})
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if _, err := e.client.SendMessageBatch(context.Background(), &sqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries}); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	return url
}

// messages rounds b.N up to whole batches of ten.
func messages(b *testing.B) int { return max(10, (b.N+9)/10*10) }

func report(b *testing.B, e *env, n int, elapsed time.Duration) float64 {
	rate := float64(n) / elapsed.Seconds()
	b.ReportMetric(rate, "msg/s")
	b.ReportMetric(float64(e.counter.Total())/float64(n), "req/msg")
	benchRates.Store(b.Name(), rate)
	return rate
}

func benchRaw(b *testing.B, batch int32) {
	e := newEnv(b)
	n := messages(b)
	url := benchQueue(b, e, n, 30*time.Second)
	ctx := context.Background()
	e.counter.Reset()
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for done := 0; done < n; {
		out, err := e.client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: batch})
		if err != nil {
			b.Fatal(err)
		}
		switch len(out.Messages) {
		case 0:
			continue
		case 1:
			if batch == 1 {
				if _, err := e.client.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: out.Messages[0].ReceiptHandle}); err != nil {
					b.Fatal(err)
				}
				done++
				continue
			}
		}
		entries := make([]types.DeleteMessageBatchRequestEntry, len(out.Messages))
		for i, m := range out.Messages {
			entries[i] = types.DeleteMessageBatchRequestEntry{Id: aws.String(fmt.Sprint(i)), ReceiptHandle: m.ReceiptHandle}
		}
		if _, err := e.client.DeleteMessageBatch(ctx, &sqs.DeleteMessageBatchInput{QueueUrl: aws.String(url), Entries: entries}); err != nil {
			b.Fatal(err)
		}
		done += len(out.Messages)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	report(b, e, n, elapsed)
}

func benchCustody(b *testing.B, work time.Duration, concurrency int) {
	e := newEnv(b)
	n := messages(b)
	visibility := 30 * time.Second
	opts := []Option{WithWaitTime(0), withEmptyPollPause(20 * time.Millisecond)}
	if work > 0 {
		// Three waves of long handlers; long polls, so the queue running
		// dry during the last wave costs few empty receives.
		visibility = 3 * time.Second
		n = 3 * concurrency
		opts = []Option{WithWaitTime(time.Second)}
	}
	url := benchQueue(b, e, n, visibility)
	src, err := New(context.Background(), e.client, url, opts...)
	if err != nil {
		b.Fatal(err)
	}
	var handled atomic.Int64
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if work > 0 {
			time.Sleep(work)
		}
		handled.Add(1)
		return nil
	}), consumer.WithConcurrency(concurrency), consumer.WithLogger(testlog.New(b)))
	if err != nil {
		b.Fatal(err)
	}
	e.counter.Reset()
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	go func() { ran <- c.Run(ctx) }()
	for src.Stats().Deleted < int64(n) {
		time.Sleep(2 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	rate := report(b, e, n, elapsed)
	cancel()
	if err := <-ran; err != nil {
		b.Fatal(err)
	}
	if work == 0 {
		if raw, ok := benchRates.Load("BenchmarkSQS/raw-batched"); ok {
			b.ReportMetric(rate/raw.(float64), "x-batched")
		}
		if raw, ok := benchRates.Load("BenchmarkSQS/raw-naive"); ok {
			b.ReportMetric(rate/raw.(float64), "x-naive")
		}
	} else {
		for op, unit := range map[string]string{"ReceiveMessage": "recv-req/msg", "DeleteMessageBatch": "del-req/msg", "ChangeMessageVisibilityBatch": "renew-req/msg"} {
			b.ReportMetric(float64(e.counter.Op(op))/float64(n), unit)
		}
	}
}
