package awssqs_test

import (
	"context"
	"log"

	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters/awssqs"
	"github.com/custody-go/custody/consumer"
)

// A consumer of one SQS queue with a dead-letter queue beside it. The AWS
// SDK's default configuration picks the region and credentials (and
// AWS_ENDPOINT_URL_SQS, for an emulator).
func Example() {
	ctx := context.Background()
	awsCfg, err := awsconfig.LoadDefaultConfig(ctx)
	if err != nil {
		log.Fatal(err)
	}
	client := sqs.NewFromConfig(awsCfg)

	src, err := awssqs.New(ctx, client, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
	if err != nil {
		log.Fatal(err)
	}
	dlq, err := awssqs.NewDeadLetter(ctx, client, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq")
	if err != nil {
		log.Fatal(err)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		// m.Attempt is SQS's receive count; m.Key the FIFO group id.
		return nil
	}),
		consumer.WithConcurrency(32),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5}),
		consumer.WithDeadLetter(dlq))
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
}

// Leaving dead-lettering to the queue's redrive policy: the queue's
// maxReceiveCount must equal MaxAttempts, which NativeDeadLetter checks.
func ExampleSource_NativeDeadLetter() {
	ctx := context.Background()
	awsCfg, err := awsconfig.LoadDefaultConfig(ctx)
	if err != nil {
		log.Fatal(err)
	}
	client := sqs.NewFromConfig(awsCfg)
	src, err := awssqs.New(ctx, client, "https://sqs.eu-west-1.amazonaws.com/123456789012/orders")
	if err != nil {
		log.Fatal(err)
	}
	const maxAttempts = 5
	redrive, err := src.NativeDeadLetter(maxAttempts)
	if err != nil {
		log.Fatal(err) // no policy, or maxReceiveCount != 5
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return nil
	}),
		consumer.WithRetry(consumer.Retry{MaxAttempts: maxAttempts}),
		consumer.WithDeadLetter(redrive))
	if err != nil {
		log.Fatal(err)
	}
	_ = c.Run(ctx)
}
