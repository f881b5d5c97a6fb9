package awssqs

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
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

// NativeDeadLetter.Send gives a message back (visibility 0) for the queue's
// redrive policy to move, while the runtime's lease keeper still renews it.
// A renewal landing after the release would hide the message for a whole
// timeout again, and delay its move to the dead-letter queue as long: Send
// waits for renewals on the wire, and renewals after it are not sent.
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
	redrive, err := src.NativeDeadLetter(2)
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
	time.Sleep(100 * time.Millisecond) // time for a Send that did not wait to release first
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

// slowRelease sends a release (visibility 0) at once but holds SQS's answer
// until answer is closed (or the call's context ends), as a connection that
// stalls after the request went out would; it remembers the released
// receipt handle and counts the visibility changes sent with it afterwards.
type slowRelease struct {
	*sqs.Client
	released chan struct{}
	answer   chan struct{}
	mu       sync.Mutex
	handle   string
	reused   int
}

func (c *slowRelease) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	c.mu.Lock()
	release := c.handle == "" && len(in.Entries) == 1 && in.Entries[0].VisibilityTimeout == 0
	if release {
		c.handle = aws.ToString(in.Entries[0].ReceiptHandle)
	} else {
		for _, e := range in.Entries {
			if aws.ToString(e.ReceiptHandle) == c.handle {
				c.reused++
			}
		}
	}
	c.mu.Unlock()
	out, err := c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
	if release {
		close(c.released)
		select {
		case <-c.answer:
		case <-ctx.Done():
		}
	}
	return out, err
}

// signalHandler closes match when a record whose message begins with msg is
// logged.
type signalHandler struct {
	slog.Handler
	msg   string
	once  *sync.Once
	match chan struct{}
}

func (h signalHandler) Handle(ctx context.Context, r slog.Record) error {
	if strings.HasPrefix(r.Message, h.msg) {
		h.once.Do(func() { close(h.match) })
	}
	return h.Handler.Handle(ctx, r)
}

func (h signalHandler) WithAttrs(as []slog.Attr) slog.Handler {
	h.Handler = h.Handler.WithAttrs(as)
	return h
}

func (h signalHandler) WithGroup(name string) slog.Handler {
	h.Handler = h.Handler.WithGroup(name)
	return h
}

// TestRedriveSendCutAtShutdownNeverTouchesTheRedelivery: NativeDeadLetter.Send has
// given a message back (visibility 0) and another consumer has received it,
// but SQS's answer comes only after the shutdown deadline ended the
// handler's context, so Send reports an error. The runtime must then leave
// the message alone: its receipt handle is stale. A nack with it (the
// runtime's give-back at shutdown, with the retry's backoff) reaches the
// other consumer's copy on the emulator, which applies stale handles: that
// copy becomes visible again while the other consumer runs it.
func TestRedriveSendCutAtShutdownNeverTouchesTheRedelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, dlqARN := e.queue(false, 30*time.Second, nil)
	url, _ := e.queue(false, 30*time.Second, map[string]string{"RedrivePolicy": redrivePolicyJSON(dlqARN, 3)})
	e.send(url, "poison", "", nil)
	client := &slowRelease{Client: e.client, released: make(chan struct{}), answer: make(chan struct{})}
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	redrive, err := src.NativeDeadLetter(3)
	if err != nil {
		t.Fatal(err)
	}
	// The answer to the release comes once the runtime has logged that
	// the dead-letter write failed, the shutdown deadline having cut it.
	logger := slog.New(signalHandler{Handler: testlog.New(t).Handler(), msg: "custody: dead-letter write failed",
		once: new(sync.Once), match: client.answer})
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("cannot parse"))
	}), consumer.WithMaxInFlight(1), consumer.WithDeadLetter(redrive), consumer.WithLogger(logger),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(time.Second)}),
		consumer.WithShutdownTimeout(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	select {
	case <-client.released:
	case <-time.After(patience):
		t.Fatal("the message was never given back")
	}
	// Another consumer receives it, then shutdown begins.
	waitFor(t, "another consumer to receive the released message", func() bool {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 1, VisibilityTimeout: 60})
		if err != nil {
			t.Fatal(err)
		}
		return len(out.Messages) == 1
	})
	cancel()
	select {
	case err := <-ran:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(patience):
		t.Fatal("Run did not return")
	}
	client.mu.Lock()
	reused := client.reused
	client.mu.Unlock()
	if reused > 0 {
		t.Errorf("%d visibility changes were sent with the receipt handle given back to SQS, after another consumer received the message", reused)
	}
	// The other consumer holds the message for a minute.
	if got := e.drain(url, 2*time.Second); len(got) != 0 {
		t.Errorf("the message, held by another consumer, became visible again")
	}
}
