package awssqs

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testlog"
)

// staggeredClient makes the first ReceiveMessage return at most three
// messages (SQS often returns fewer than asked) and slows the second and
// third, so polls come back one after another, after the Receive that
// started them returned.
type staggeredClient struct {
	*sqs.Client
	calls atomic.Int32
}

func (c *staggeredClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	switch c.calls.Add(1) {
	case 1:
		cp := *in
		cp.MaxNumberOfMessages = 3
		in = &cp
	case 2:
		time.Sleep(300 * time.Millisecond)
	case 3:
		time.Sleep(600 * time.Millisecond)
	}
	return c.Client.ReceiveMessage(ctx, in, o...)
}

// Messages a late poll brought while the runtime, holding most of its
// in-flight bound, waits for room for a whole batch, wait in the Source. They
// must not become visible to other consumers meanwhile: that would run them
// twice, at once.
func TestMessagesWaitingInTheSourceKeepTheirVisibility(t *testing.T) {
	e := newEnv(t)
	url, _ := e.queue(false, 2*time.Second, nil)
	for range 20 {
		e.send(url, "m", "", nil)
	}
	src, err := New(e.ctx(), &staggeredClient{Client: e.client}, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
		}
		return nil
	}), consumer.WithConcurrency(1), consumer.WithMaxInFlight(20), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	defer func() { cancel(); <-ran }()

	// Every message is in this consumer's custody (received, not deleted)
	// for the whole test. A competitor polls all the time from 1.2 s to
	// 3.2 s: a message left unrenewed since its receive becomes visible by
	// 2.6 s at the latest, and one renewed only once its timeout ran out is
	// visible for a moment; either way the competitor takes it.
	time.Sleep(1200 * time.Millisecond)
	stolen := 0
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(40 * time.Millisecond) {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10, VisibilityTimeout: 30})
		if err != nil {
			t.Fatal(err)
		}
		stolen += len(out.Messages)
	}
	if stolen > 0 {
		t.Fatalf("another consumer received %d messages this one still holds (Stats %+v)", stolen, src.Stats())
	}
	if src.Stats().BufferRenewed == 0 {
		t.Fatalf("no message waited in the Source (Stats %+v): the test did not set up the case", src.Stats())
	}
}

// A message renewed while it waited in the Source is handed over with
// LeasedAt set to that renewal, so the runtime's lease keeper counts its
// visibility from there rather than from the receive: counted from the
// receive, the lease could pass for expired, and one transient failure of
// the first renewal would lose a message with most of its visibility left.
func TestMessagesRenewedWhileWaitingCarryTheirRenewal(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 3*time.Second, nil)
	for range 20 {
		e.send(url, "m", "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions(WithPollers(2))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	// Two polls of ten start; the first to come back is handed out, the
	// other waits in the Source until it is renewed (after a third of the
	// timeout).
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	first, err := src.Receive(ctx, 20)
	cancel()
	if err != nil || len(first) == 0 || len(first) == 20 {
		t.Fatalf("first Receive: %d messages, %v; want those of one poll", len(first), err)
	}
	waitFor(t, "a renewal of the messages waiting in the Source", func() bool { return src.Stats().BufferRenewed > 0 })
	rest := receiveAtLeast(t, src, 20-len(first))
	renewed := 0
	for _, d := range rest {
		if !d.LeasedAt.IsZero() {
			renewed++
			if !d.LeasedAt.After(d.ReceivedAt) {
				t.Errorf("LeasedAt %v is not after ReceivedAt %v", d.LeasedAt, d.ReceivedAt)
			}
		}
	}
	if renewed == 0 {
		t.Fatalf("none of the %d messages renewed while they waited carries LeasedAt (Stats %+v)", len(rest), src.Stats())
	}
	for _, d := range first {
		if !d.LeasedAt.IsZero() {
			t.Errorf("a message handed out at once carries LeasedAt %v", d.LeasedAt)
		}
	}
}
