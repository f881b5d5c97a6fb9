package awssqs

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// hungRenewalClient never answers a ChangeMessageVisibilityBatch while hung
// is set: the call returns only when its context ends, as over a connection
// SQS stopped answering.
type hungRenewalClient struct {
	*sqs.Client
	hung atomic.Bool
}

func (c *hungRenewalClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if c.hung.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
}

// TestHungRenewalsCancelTheHandlerBeforeAnotherConsumerGetsTheMessage: every
// renewal of a running message hangs, so its visibility runs out and another
// consumer (or this one's next poll) receives it. By then the handler's
// context must be cancelled: an effect still running here runs at the same
// time as the redelivery's. A retried renewal still waiting for its answer
// must not keep the lease alive in the runtime's eyes past the visibility
// timeout.
func TestHungRenewalsCancelTheHandlerBeforeAnotherConsumerGetsTheMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 6*time.Second, nil)
	e.send(url, "slow", "", nil)
	client := &hungRenewalClient{Client: e.client}
	client.hung.Store(true)
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	var (
		handlerCtx atomic.Pointer[context.Context]
		overlap    atomic.Bool // received again while the first handler's context lived
		again      atomic.Bool
		started    = make(chan struct{})
		returned   = make(chan struct{})
	)
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if !handlerCtx.CompareAndSwap(nil, &ctx) {
			// Received again, by this consumer's own polls.
			if (*handlerCtx.Load()).Err() == nil {
				overlap.Store(true)
			}
			again.Store(true)
			return nil
		}
		close(started)
		defer close(returned)
		<-ctx.Done()
		return context.Cause(ctx)
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	defer func() {
		client.hung.Store(false)
		cancel()
		if err := <-ran; err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	select {
	case <-started:
	case <-time.After(patience):
		t.Fatal("the handler did not start")
	}

	// Another consumer polls until it (or this consumer's own polls) gets
	// the message, then looks at the handler's context at once.
	deadline := time.Now().Add(patience)
	for !again.Load() {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 1, VisibilityTimeout: 60})
		if err != nil {
			t.Fatal(err)
		}
		if len(out.Messages) > 0 {
			if (*handlerCtx.Load()).Err() == nil {
				overlap.Store(true)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the message never came back to another consumer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if overlap.Load() {
		t.Errorf("the message was received again while its handler still ran with a live context: the effect runs twice at once")
	}
	select {
	case <-returned:
	case <-time.After(patience):
		t.Fatal("the handler's context was never cancelled")
	}
}
