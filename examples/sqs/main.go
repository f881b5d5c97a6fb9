// Command sqs runs custody on an SQS queue: a few hundred orders handled at
// concurrency 16, a flaky dependency retried with backoff (the retry waits in
// SQS, as a visibility timeout, not in the process), and a malformed order
// dead-lettered with its diagnostics.
//
// It runs against any SQS endpoint the AWS SDK's default configuration
// finds: real SQS through the default credential chain and region, or an
// emulator through AWS_ENDPOINT_URL_SQS:
//
//	# real SQS (creates two queues, deletes them afterwards)
//	AWS_REGION=eu-west-1 go run ./examples/sqs -create
//
//	# the emulator the tests use (it exits when its standard input closes,
//	# so a plain "&" in a script stops it at once; keep a pipe open)
//	(cd internal/testkit/sqsemu && npm ci)
//	sleep infinity | node internal/testkit/sqsemu/server.js 4566 &
//	AWS_ENDPOINT_URL_SQS=http://127.0.0.1:4566 AWS_REGION=us-east-1 \
//	AWS_ACCESS_KEY_ID=fake AWS_SECRET_ACCESS_KEY=fake go run ./examples/sqs -create -wait 1s
//
// (The emulator holds a long poll open until it is full or its wait is
// over, so -wait 1s keeps the last, partial batches from waiting 20 s.)
//
// With -create it creates the queue and its dead-letter queue (and deletes
// them when done unless -keep); without it the queues must exist. With
// -redrive the queue gets a redrive policy and dead-lettering is left to SQS
// (Source.NativeDeadLetter) instead of the DeadLetter sink.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/awssqs"
	"github.com/custody-go/custody/consumer"
)

type order struct {
	ID     int `json:"id"`
	Amount int `json:"amount"`
}

type config struct {
	queue   string
	orders  int
	create  bool
	keep    bool
	redrive bool
	wait    time.Duration
}

const (
	maxAttempts = 4
	poisonID    = 13 // malformed: dead-lettered at once
	flakyMod    = 25 // orders whose id is a multiple of this fail twice first
)

func main() {
	var cfg config
	flag.StringVar(&cfg.queue, "queue", "custody-example-orders", "queue name (its dead-letter queue is NAME-dlq)")
	flag.IntVar(&cfg.orders, "orders", 300, "how many orders to publish")
	flag.BoolVar(&cfg.create, "create", false, "create the queues (and delete them afterwards unless -keep)")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the queues this run created")
	flag.BoolVar(&cfg.redrive, "redrive", false, "dead-letter through the queue's redrive policy instead of the sink")
	flag.DurationVar(&cfg.wait, "wait", awssqs.DefaultWaitTime, "long-poll wait (whole seconds, up to 20s); use 1s on the emulator, which holds a poll open until it is full")
	flag.Parse()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	awsCfg, err := awsconfig.LoadDefaultConfig(ctx)
	if err != nil {
		log.Fatal(err)
	}
	if err := run(ctx, sqs.NewFromConfig(awsCfg), cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, client *sqs.Client, cfg config, out io.Writer) error {
	url, dlqURL, err := queues(ctx, client, cfg)
	if err != nil {
		return err
	}
	if cfg.create && !cfg.keep {
		defer func() {
			for _, u := range []string{url, dlqURL} {
				client.DeleteQueue(context.Background(), &sqs.DeleteQueueInput{QueueUrl: aws.String(u)})
			}
		}()
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	wait := cfg.wait
	if wait == 0 {
		wait = awssqs.DefaultWaitTime
	}
	src, err := awssqs.New(ctx, client, url, awssqs.WithWaitTime(wait))
	if err != nil {
		return err
	}
	var dlq adapters.DeadLetter
	if cfg.redrive {
		dlq, err = src.NativeDeadLetter(maxAttempts)
	} else {
		dlq, err = awssqs.NewDeadLetter(ctx, client, dlqURL)
	}
	if err != nil {
		src.Close()
		return err
	}

	var (
		handled  atomic.Int64
		mu       sync.Mutex
		attempts = map[int]int{}
		done     = make(chan struct{})
		once     sync.Once
	)
	want := int64(cfg.orders - 1) // all but the poison order
	handler := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		var o order
		if err := json.Unmarshal(m.Body, &o); err != nil {
			return consumer.Permanent(fmt.Errorf("order is not valid JSON: %w", err))
		}
		mu.Lock()
		attempts[o.ID] = m.Attempt // SQS's ApproximateReceiveCount
		mu.Unlock()
		if o.ID%flakyMod == 0 && m.Attempt < 3 {
			// Nacked with a 1 s visibility timeout: the retry waits in SQS.
			return consumer.RetryAfter(errors.New("payment service unavailable"), time.Second)
		}
		if handled.Add(1) == want {
			once.Do(func() { close(done) })
		}
		return nil
	})
	c, err := consumer.New(src, handler,
		consumer.WithConcurrency(16),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts}),
		consumer.WithDeadLetter(dlq),
		consumer.WithLogger(logger))
	if err != nil {
		src.Close()
		return err
	}
	if err := publish(ctx, client, url, cfg.orders); err != nil {
		src.Close()
		return err
	}

	runCtx, stop := context.WithCancel(ctx)
	ran := make(chan error, 1)
	start := time.Now()
	go func() { ran <- c.Run(runCtx) }()
	select {
	case <-done:
	case err := <-ran:
		stop()
		return fmt.Errorf("consumer stopped early: %w", err)
	case <-ctx.Done():
		stop()
		<-ran
		return fmt.Errorf("handled %d of %d orders before giving up: %w", handled.Load(), want, ctx.Err())
	}
	took := time.Since(start)
	dead, err := waitDeadLettered(ctx, client, dlqURL)
	stop()
	if runErr := <-ran; runErr != nil {
		return runErr
	}
	if err != nil {
		return err
	}

	st := src.Stats()
	requests := st.ReceiveRequests + st.DeleteRequests + st.VisibilityRequests
	fmt.Fprintf(out, "handled %d orders in %v\n", handled.Load(), took.Round(time.Millisecond))
	mu.Lock()
	fmt.Fprintf(out, "order %d succeeded on receive %d, after two retries that waited in SQS\n", flakyMod, attempts[flakyMod])
	mu.Unlock()
	fmt.Fprintf(out, "requests: %d receives (%d empty), %d delete batches, %d visibility batches: %.2f per message\n",
		st.ReceiveRequests, st.EmptyReceives, st.DeleteRequests, st.VisibilityRequests, float64(requests)/float64(max(st.Received, 1)))
	for _, m := range dead {
		if cfg.redrive {
			fmt.Fprintf(out, "dead-lettered by the redrive policy: %q from %s\n", aws.ToString(m.Body), m.Attributes["DeadLetterQueueSourceArn"])
			continue
		}
		diag, err := awssqs.DecodeDiagnostics(m.MessageAttributes, awssqs.DefaultDiagnosticsAttribute)
		if err != nil {
			return err
		}
		fmt.Fprintf(out, "dead-lettered %q: %s=%q %s=%s %s=%s\n", aws.ToString(m.Body),
			adapters.HeaderError, diag[adapters.HeaderError],
			adapters.HeaderAttempts, diag[adapters.HeaderAttempts],
			adapters.HeaderOriginalQueue, diag[adapters.HeaderOriginalQueue])
	}
	if len(dead) != 1 {
		return fmt.Errorf("expected one dead-lettered order, found %d", len(dead))
	}
	return nil
}

// queues returns the URLs of the queue and its dead-letter queue, creating
// them when cfg.create is set.
func queues(ctx context.Context, client *sqs.Client, cfg config) (url, dlqURL string, err error) {
	dlqName := cfg.queue + "-dlq"
	if !cfg.create {
		for _, p := range []struct {
			name string
			url  *string
		}{{cfg.queue, &url}, {dlqName, &dlqURL}} {
			out, err := client.GetQueueUrl(ctx, &sqs.GetQueueUrlInput{QueueName: aws.String(p.name)})
			if err != nil {
				return "", "", fmt.Errorf("queue %s (run with -create to create it): %w", p.name, err)
			}
			*p.url = aws.ToString(out.QueueUrl)
		}
		return url, dlqURL, nil
	}
	d, err := client.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(dlqName)})
	if err != nil {
		return "", "", fmt.Errorf("creating %s: %w", dlqName, err)
	}
	attrs := map[string]string{"VisibilityTimeout": "30"}
	if cfg.redrive {
		a, err := client.GetQueueAttributes(ctx, &sqs.GetQueueAttributesInput{QueueUrl: d.QueueUrl, AttributeNames: []types.QueueAttributeName{types.QueueAttributeNameQueueArn}})
		if err != nil {
			return "", "", err
		}
		policy, _ := json.Marshal(map[string]string{
			"deadLetterTargetArn": a.Attributes[string(types.QueueAttributeNameQueueArn)],
			"maxReceiveCount":     strconv.Itoa(maxAttempts),
		})
		attrs["RedrivePolicy"] = string(policy)
	}
	q, err := client.CreateQueue(ctx, &sqs.CreateQueueInput{QueueName: aws.String(cfg.queue), Attributes: attrs})
	if err != nil {
		return "", "", fmt.Errorf("creating %s: %w", cfg.queue, err)
	}
	return aws.ToString(q.QueueUrl), aws.ToString(d.QueueUrl), nil
}

// publish sends the orders, ten per request; order 13 is malformed.
func publish(ctx context.Context, client *sqs.Client, url string, n int) error {
	for start := 1; start <= n; start += 10 {
		var entries []types.SendMessageBatchRequestEntry
		for id := start; id < start+10 && id <= n; id++ {
			body, _ := json.Marshal(order{ID: id, Amount: id * 100})
			if id == poisonID {
				body = []byte("{not json")
			}
			entries = append(entries, types.SendMessageBatchRequestEntry{Id: aws.String(strconv.Itoa(id)), MessageBody: aws.String(string(body))})
		}
		out, err := client.SendMessageBatch(ctx, &sqs.SendMessageBatchInput{QueueUrl: aws.String(url), Entries: entries})
		if err != nil {
			return err
		}
		if len(out.Failed) > 0 {
			return fmt.Errorf("publishing: %s", aws.ToString(out.Failed[0].Message))
		}
	}
	return nil
}

// waitDeadLettered receives from the dead-letter queue until a message
// arrives (and a second more, for strays), deleting what it reads.
func waitDeadLettered(ctx context.Context, client *sqs.Client, url string) ([]types.Message, error) {
	var got []types.Message
	var quietSince time.Time
	for {
		out, err := client.ReceiveMessage(ctx, &sqs.ReceiveMessageInput{
			QueueUrl: aws.String(url), MaxNumberOfMessages: 10, WaitTimeSeconds: 1,
			MessageAttributeNames: []string{"All"},
			AttributeNames:        []types.QueueAttributeName{"All"},
		})
		if err != nil {
			return nil, err
		}
		for _, m := range out.Messages {
			got = append(got, m)
			client.DeleteMessage(ctx, &sqs.DeleteMessageInput{QueueUrl: aws.String(url), ReceiptHandle: m.ReceiptHandle})
		}
		switch {
		case len(out.Messages) > 0:
			quietSince = time.Now()
		case len(got) > 0 && time.Since(quietSince) > time.Second:
			return got, nil
		}
	}
}
