package awssqs

import (
	"context"

	"github.com/aws/aws-sdk-go-v2/service/sqs"
)

// Client is the part of *sqs.Client a [Source] uses. Pass an *sqs.Client, or
// wrap one (to add metrics, logging or a rate limiter) in any type with these
// methods. The caller owns the client: the Source never closes it.
type Client interface {
	ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, optFns ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error)
	DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, optFns ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error)
	ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, optFns ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error)
	GetQueueAttributes(ctx context.Context, in *sqs.GetQueueAttributesInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueAttributesOutput, error)
}

// Sender is the part of *sqs.Client a [DeadLetter] uses:
// GetQueueAttributes once, when it is created, and SendMessage for each
// dead letter.
type Sender interface {
	SendMessage(ctx context.Context, in *sqs.SendMessageInput, optFns ...func(*sqs.Options)) (*sqs.SendMessageOutput, error)
	GetQueueAttributes(ctx context.Context, in *sqs.GetQueueAttributesInput, optFns ...func(*sqs.Options)) (*sqs.GetQueueAttributesOutput, error)
}

var (
	_ Client = (*sqs.Client)(nil)
	_ Sender = (*sqs.Client)(nil)
)
