package awssqs

import (
	"context"
	"errors"
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
	defer cancel() // lets the unfixed Ack return once the test has failed
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
