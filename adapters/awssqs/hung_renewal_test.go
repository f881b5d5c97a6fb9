package awssqs

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testlog"
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
// when the visibility ran out kept the lease alive in the runtime's eyes
// until the call's own timeout (a third of the visibility timeout after it
// was sent), a second past the visibility timeout here.
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

// lateRenewalClient holds every ChangeMessageVisibilityBatch until answer is
// closed, then sends it and returns SQS's answer, as a connection that
// stalls and then delivers would; a call whose context ends first returns
// the context's error. forwarded counts the calls sent after answer closed.
type lateRenewalClient struct {
	*sqs.Client
	answer    chan struct{}
	forwarded atomic.Int32
}

func (c *lateRenewalClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	select {
	case <-c.answer:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer c.forwarded.Add(1)
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
}

// TestBufferedRenewalAnsweredAfterTheVisibilityRanOutIsNotHandedOut: the
// renewals of messages waiting in the Source stall. The first is cut at its
// timeout with time left; the next goes out a tick later, with little of the
// visibility left, and is still waiting when the visibility runs out and
// another consumer receives the messages. Its answer then comes: the
// emulator (and SQS, at times) accepts the stale receipt handles. The
// messages are another consumer's by then: the Source must hand them to the
// runtime as lost, never as live deliveries to run beside the other
// consumer's copies. Bounded by a third of the timeout alone, the renewal
// outlived the visibility and its late success counted.
func TestBufferedRenewalAnsweredAfterTheVisibilityRanOutIsNotHandedOut(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 6*time.Second, nil)
	client := &lateRenewalClient{Client: e.client, answer: make(chan struct{})}
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	buffered := fillBuffer(t, e, src, url, 20)
	// Another consumer takes them once their visibility runs out; then the
	// stalled renewal gets its answer.
	taken := takeElsewhere(t, e, url, len(buffered))
	close(client.answer)
	waitFor(t, "the Source to give the messages up or have its renewal answered", func() bool {
		lost := 0
		for _, d := range buffered {
			if d.Signal.LostCause() != nil {
				lost++
			}
		}
		src.mu.Lock()
		defer src.mu.Unlock()
		return lost == len(buffered) || client.forwarded.Load() > 0 && src.bufRenewing == nil
	})

	got, err := src.Receive(e.ctx(), len(buffered))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(buffered) {
		t.Fatalf("Receive handed out %d of the %d waiting messages", len(got), len(buffered))
	}
	for _, d := range got {
		if !taken[d.ID] {
			t.Fatalf("waiting message %s was not taken by the other consumer", d.ID)
		}
		if cause := d.Signal.LostCause(); !errors.Is(cause, adapters.ErrLeaseLost) {
			t.Errorf("message %s, received by another consumer, handed out with lost cause %v: the runtime would run it beside the other consumer", d.ID, cause)
		}
	}
}
