package crashbench

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters/awssqs"
	"github.com/custody-go/custody/internal/testkit/sqsemu"
)

// sqsVisibility is the queues' visibility timeout: what a killed child held
// comes back after it.
const sqsVisibility = 2 * time.Second

var sqsBroker = broker{name: "sqs", open: openSQS}

// openSQS creates a queue on the emulator (started by the parent; children
// reach it by its endpoint).
func openSQS(tb testing.TB) *stream {
	tb.Helper()
	endpoint := sqsemu.Start(tb)
	client := sqsemu.NewClient(endpoint, nil)
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	out, err := client.CreateQueue(ctx, &sqs.CreateQueueInput{
		QueueName:  aws.String(sqsemu.QueueName(tb)),
		Attributes: map[string]string{"VisibilityTimeout": strconv.Itoa(int(sqsVisibility / time.Second))},
	})
	if err != nil {
		tb.Fatalf("CreateQueue: %v", err)
	}
	url := aws.ToString(out.QueueUrl)
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		client.DeleteQueue(ctx, &sqs.DeleteQueueInput{QueueUrl: aws.String(url)})
	})
	return &stream{
		env:      []string{envAddr + "=" + endpoint, envQueue + "=" + url},
		settle:   sqsVisibility + time.Second,
		publish:  func(bodies []string) error { return sendSQS(client, url, bodies) },
		leftover: func() int { return drainSQS(tb, client, url) },
	}
}

// sendSQS sends bodies to the queue in batches of ten, from a few senders at
// once.
func sendSQS(client *sqs.Client, url string, bodies []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	const senders = 8
	var (
		wg    sync.WaitGroup
		errMu sync.Mutex
		first error
	)
	for w := range senders {
		wg.Go(func() {
			for start := w * 10; start < len(bodies); start += senders * 10 {
				var entries []types.SendMessageBatchRequestEntry
				for i, b := range bodies[start:min(start+10, len(bodies))] {
					entries = append(entries, types.SendMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(i)), MessageBody: aws.String(b)})
				}
				out, err := client.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
				if err == nil && len(out.Failed) > 0 {
					err = fmt.Errorf("%d entries failed: %s", len(out.Failed), aws.ToString(out.Failed[0].Message))
				}
				if err != nil {
					errMu.Lock()
					first = err
					errMu.Unlock()
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return fmt.Errorf("SendMessageBatch: %w", first)
	}
	return nil
}

// drainSQS receives and deletes what is left in the queue, and counts it.
// It stops after three receives in a row found nothing (the emulator may
// hold back a message released a moment ago until its next turn).
func drainSQS(tb testing.TB, client *sqs.Client, url string) int {
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	n := 0
	for empty := 0; empty < 3; {
		out, err := client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10})
		if err != nil {
			tb.Fatalf("draining %s: %v", url, err)
		}
		if len(out.Messages) == 0 {
			empty++
			time.Sleep(200 * time.Millisecond)
			continue
		}
		empty = 0
		for _, m := range out.Messages {
			n++
			client.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle})
		}
	}
	return n
}

// sqsCustody is custody's consumer with the adapter's defaults, but for
// one-second long polls: the emulator holds a long poll open until it is
// full, which at the end of a stream would otherwise take 20 s.
func sqsCustody(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	client := sqsemu.NewClient(cfg.addr, nil)
	src, err := awssqs.New(ctx, client, cfg.queue, awssqs.WithWaitTime(time.Second))
	if err != nil {
		return err
	}
	return runCustody(ctx, src, cfg, effect)
}

// sqsRaw is the loop a user would write with the SDK alone: concurrency
// pollers, each receiving up to 10 messages and, for each in turn, doing
// the work and then deleting it (DeleteMessage, one request per message).
// On SIGTERM each poller finishes the batch it holds.
func sqsRaw(ctx context.Context, cfg childConfig, effect func(context.Context, []byte) error) error {
	client := sqsemu.NewClient(cfg.addr, nil)
	done := context.WithoutCancel(ctx) // the batch in hand finishes
	var wg sync.WaitGroup
	for range cfg.concurrency {
		wg.Go(func() {
			for ctx.Err() == nil {
				out, err := client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{QueueUrl: aws.String(cfg.queue), MaxNumberOfMessages: 10, WaitTimeSeconds: 1})
				if err != nil {
					if ctx.Err() == nil {
						cfg.logger.Warn("receive", "error", err)
						time.Sleep(100 * time.Millisecond)
					}
					continue
				}
				for _, m := range out.Messages {
					if err := effect(done, []byte(aws.ToString(m.Body))); err != nil {
						cfg.logger.Warn("effect", "error", err)
						continue
					}
					if _, err := client.DeleteMessage(done, &sqs.DeleteMessageInput{QueueUrl: aws.String(cfg.queue), ReceiptHandle: m.ReceiptHandle}); err != nil {
						cfg.logger.Warn("delete", "error", err)
					}
				}
			}
		})
	}
	wg.Wait()
	return nil
}
