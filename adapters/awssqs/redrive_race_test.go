package awssqs

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// heldRenewals holds every visibility change that hides messages (a
// renewal) until gate is closed; releases (visibility 0) go through.
type heldRenewals struct {
	*sqs.Client
	entered chan struct{}
	gate    chan struct{}
}

func (c *heldRenewals) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if len(in.Entries) > 0 && in.Entries[0].VisibilityTimeout > 0 {
		select {
		case c.entered <- struct{}{}:
		default:
		}
		<-c.gate
	}
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
}

// Redrive.Send gives a message back (visibility 0) for the queue's redrive
// policy to move, while the runtime's lease keeper still renews it. A
// renewal on the wire that landed after the release hid the message for a
// whole timeout again, and one sent after Send returned (before the runtime
// stopped the lease) did the same: the move to the dead-letter queue waited
// that long. Send now waits for renewals on the wire, and renewals after it
// are not sent.
func TestRedriveSendIsNotUndoneByARenewal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	dlqURL, dlqARN := e.queue(false, 30*time.Second, nil)
	_ = dlqURL
	url, _ := e.queue(false, 30*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 2)})
	e.send(url, "poison", "", nil)
	client := &heldRenewals{Client: e.client, entered: make(chan struct{}, 1), gate: make(chan struct{})}
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	redrive, err := src.Redrive(2)
	if err != nil {
		t.Fatal(err)
	}
	d := receiveAtLeast(t, src, 1)[0]

	const hide = 120 * time.Second // longer than the test waits
	renewed := make(chan error, 1)
	go func() { renewed <- src.Extend(e.ctx(), []*adapters.Delivery{d}, hide) }()
	<-client.entered // a renewal is on the wire
	sent := make(chan error, 1)
	go func() { sent <- redrive.Send(e.ctx(), d, adapters.Failure{Err: errors.New("poison"), Attempts: 2}) }()
	time.Sleep(100 * time.Millisecond) // give an unfixed Send the time to release first
	close(client.gate)
	if err := <-renewed; err != nil {
		t.Fatalf("renewal: %v", err)
	}
	if err := <-sent; err != nil {
		t.Fatalf("Send: %v", err)
	}
	// The runtime renews until it stops the lease, after Send returned.
	if err := src.Extend(e.ctx(), []*adapters.Delivery{d}, hide); err != nil {
		t.Fatalf("renewal after Send: %v", err)
	}
	waitFor(t, "the message visible again, for the redrive policy to move", func() bool {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 1})
		return err == nil && len(out.Messages) == 1
	})
}
