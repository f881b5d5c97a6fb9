package awssqs

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// silentDeleteClient never answers DeleteMessageBatch: the call returns only
// when its context ends, as with a connection SQS stopped answering on.
type silentDeleteClient struct{ *sqs.Client }

func (c *silentDeleteClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func withRequestTimeout(d time.Duration) Option {
	return func(o *options) error { o.requestTimeout = d; return nil }
}

// TestAckReturnsWhenSQSDoesNotAnswer: the runtime acks with a context that
// lives as long as the consumer and waits for Ack (adapters bound their own
// I/O, as the adapter contract asks). An Ack whose request is never answered
// must still return, with an error the runtime retries, or shutdown would
// hang behind it.
func TestAckReturnsWhenSQSDoesNotAnswer(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), &silentDeleteClient{Client: e.client}, url, testOptions(withRequestTimeout(500*time.Millisecond))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 1)
	acked := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // ends an Ack that waits for ever, once the test has failed
	go func() { acked <- src.Ack(ctx, ds) }()
	select {
	case err := <-acked:
		if err == nil {
			t.Fatal("Ack succeeded although SQS never answered")
		}
		var be *adapters.BatchError
		if errors.As(err, &be) {
			t.Errorf("Ack returned a BatchError (%v) for an unanswered request; the runtime would not retry it", err)
		}
	case <-time.After(patience):
		t.Fatal("Ack did not return while SQS did not answer: it has no timeout of its own")
	}
}

// hangingReceiveClient never answers its first ReceiveMessage: the call
// returns only when its context ends, as on a connection that hung.
type hangingReceiveClient struct {
	*sqs.Client
	hung atomic.Bool
}

func (c *hangingReceiveClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	if c.hung.CompareAndSwap(false, true) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return c.Client.ReceiveMessage(ctx, in, o...)
}

// TestHungReceiveGivesUpItsPoller: a long poll whose answer never comes
// gives up after the poll's wait and the request timeout, and the poller
// polls again. Unbounded, it would hold its receiver for ever; with one (a
// FIFO queue's default) nothing would be received again.
func TestHungReceiveGivesUpItsPoller(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), &hangingReceiveClient{Client: e.client}, url,
		testOptions(WithPollers(1), withRequestTimeout(500*time.Millisecond))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	for ctx.Err() == nil {
		ds, err := src.Receive(ctx, 1)
		if len(ds) == 1 {
			return
		}
		if err != nil && ctx.Err() == nil {
			t.Logf("Receive: %v", err) // the hung poll's timeout, reported once
		}
	}
	t.Fatal("nothing received: the hung poll still holds the only poller")
}
