package awssqs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// failingDeleteClient fails every DeleteMessageBatch call as a network error
// would.
type failingDeleteClient struct{ *sqs.Client }

func (c *failingDeleteClient) DeleteMessageBatch(ctx context.Context, in *sqs.DeleteMessageBatchInput, o ...func(*sqs.Options)) (*sqs.DeleteMessageBatchOutput, error) {
	return nil, errors.New("connection reset by peer")
}

// TestWholeAckRequestFailureIsNotABatchError: when the whole delete request
// failed, Ack says so with a plain error, not a BatchError: the runtime
// retries a plain error, while a BatchError means "these entries were
// refused" and is not retried (the message would come back as a duplicate
// after a mere network blip).
func TestWholeAckRequestFailureIsNotABatchError(t *testing.T) {
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), &failingDeleteClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var ds []*adapters.Delivery
	for len(ds) == 0 {
		got, err := src.Receive(e.ctx(), 1)
		if err != nil {
			t.Fatal(err)
		}
		ds = append(ds, got...)
	}
	err = src.Ack(e.ctx(), ds)
	if err == nil {
		t.Fatal("Ack succeeded although DeleteMessageBatch failed")
	}
	var be *adapters.BatchError
	if errors.As(err, &be) {
		t.Fatalf("Ack returned a BatchError (%v) for a failed request; the runtime would not retry it", err)
	}
}
