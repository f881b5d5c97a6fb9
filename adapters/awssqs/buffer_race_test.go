package awssqs

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/custody-go/custody/adapters"
)

// gatedClient holds the second ReceiveMessage until pollGate is closed, so
// its messages land in the Source's buffer after the Receive that started it
// returned; and it holds the first ChangeMessageVisibilityBatch (the
// Source's renewal of that buffer) until renewGate is closed, or until
// fallback has passed, closing renewing when it arrives and renewDone when
// SQS has answered it.
type gatedClient struct {
	*sqs.Client
	polls, changes atomic.Int32
	pollGate       chan struct{}
	renewing       chan struct{}
	renewGate      chan struct{}
	renewDone      chan struct{}
	fallback       time.Duration
}

func (c *gatedClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	if c.polls.Add(1) == 2 {
		<-c.pollGate
	}
	return c.Client.ReceiveMessage(ctx, in, o...)
}

func (c *gatedClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if c.changes.Add(1) == 1 {
		close(c.renewing)
		t := time.NewTimer(c.fallback)
		select {
		case <-c.renewGate:
		case <-t.C:
		}
		t.Stop()
		defer close(c.renewDone)
	}
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
}

// TestBufferRenewalNeverLandsAfterANack: a renewal of messages waiting in the
// Source is on the wire when the runtime takes them and gives them back at
// once (a nack with no delay, as at shutdown). The renewal must not reach
// SQS after the nack: it would hide the messages for a whole visibility
// timeout again, overriding the nack (and after an ack, it would mark the
// deleted message's delivery lost). Receive waits for the renewal instead.
func TestBufferRenewalNeverLandsAfterANack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	// The renewal overriding the nack hides the messages for 6 s; the
	// check below looks for them within 1 s.
	url, _ := e.queue(false, 6*time.Second, nil)
	for i := range 20 {
		e.send(url, fmt.Sprintf("m%d", i), "", nil)
	}
	c := &gatedClient{
		Client:    e.client,
		pollGate:  make(chan struct{}),
		renewing:  make(chan struct{}),
		renewGate: make(chan struct{}),
		renewDone: make(chan struct{}),
		// Receive waits for the renewal, so the test cannot open
		// renewGate before Receive returns: the renewal goes on by itself,
		// within the third of the timeout (2 s) the Source gives it. It
		// lands, so the messages' visibility does not run out, which
		// would make the Source give them up as lost.
		fallback: time.Second,
	}
	var openRenewal sync.Once
	defer openRenewal.Do(func() { close(c.renewGate) })
	src, err := New(e.ctx(), c, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()

	// Room for 20 starts two polls; the first comes back, the second is
	// held until Receive has returned, so its messages wait in the Source.
	bufferSecondPoll(t, e, src, c.pollGate, c.renewing)

	got, err := src.Receive(e.ctx(), 20)
	if err != nil || len(got) == 0 {
		t.Fatalf("Receive of the buffered messages: %d deliveries, %v", len(got), err)
	}
	if err := src.Nack(e.ctx(), adapters.NackAll(got, 0)); err != nil {
		t.Fatalf("Nack: %v", err)
	}
	openRenewal.Do(func() { close(c.renewGate) })
	select {
	case <-c.renewDone:
	case <-time.After(patience):
		t.Fatal("the renewal never returned")
	}

	want := map[string]bool{}
	for _, d := range got {
		want[string(d.Body)] = true
	}
	back := 0
	for _, m := range e.drain(url, time.Second) {
		if want[aws.ToString(m.Body)] {
			delete(want, aws.ToString(m.Body))
			back++
		}
	}
	if back != len(got) {
		t.Errorf("%d of %d messages nacked with no delay are visible; the buffer's renewal hid the others again after the nack", back, len(got))
	}
}

// unansweredRenewalClient holds the second ReceiveMessage until pollGate is
// closed (so its messages wait in the Source's buffer), and never answers a
// ChangeMessageVisibilityBatch: the call returns only when its context ends.
type unansweredRenewalClient struct {
	*sqs.Client
	polls    atomic.Int32
	pollGate chan struct{}
	renewing chan struct{}
	once     sync.Once
	renewals atomic.Int32
}

func (c *unansweredRenewalClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	if c.polls.Add(1) == 2 {
		<-c.pollGate
	}
	return c.Client.ReceiveMessage(ctx, in, o...)
}

func (c *unansweredRenewalClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	c.once.Do(func() { close(c.renewing) })
	c.renewals.Add(1)
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestBufferRenewalSQSNeverAnswersDoesNotHoldReceive: Receive waits for a
// renewal of the buffer on the wire, so that renewal is bounded by itself (a
// third of the timeout, the time it had left to matter), whatever the
// request timeout: a renewal SQS never answers must not keep the buffered
// messages from the runtime. Nor may the renewals that follow it: Receive
// hands the messages out once the one it waited for has ended.
func TestBufferRenewalSQSNeverAnswersDoesNotHoldReceive(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 3*time.Second, nil)
	for i := range 20 {
		e.send(url, fmt.Sprintf("m%d", i), "", nil)
	}
	c := &unansweredRenewalClient{Client: e.client, pollGate: make(chan struct{}), renewing: make(chan struct{})}
	src, err := New(e.ctx(), c, url, testOptions(withRequestTimeout(time.Hour))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	bufferSecondPoll(t, e, src, c.pollGate, c.renewing)
	type result struct {
		n   int
		err error
	}
	got := make(chan result, 1)
	go func() {
		ds, err := src.Receive(context.Background(), 20)
		got <- result{len(ds), err}
	}()
	select {
	case r := <-got:
		if r.err != nil || r.n == 0 {
			t.Fatalf("Receive of the buffered messages: %d deliveries, %v", r.n, r.err)
		}
		if n := c.renewals.Load(); n > 2 {
			t.Errorf("Receive waited for %d unanswered renewals of the buffer; want it to take the messages after the one on the wire", n)
		}
	case <-time.After(patience):
		t.Fatal("Receive held the buffered messages while SQS did not answer their renewal")
	}
}

// bufferSecondPoll takes and acks the first poll's messages, lets the second
// poll (held by pollGate) land in src's buffer, and waits until a renewal of
// the buffered messages begins (renewing closes).
func bufferSecondPoll(t *testing.T, e *env, src *Source, pollGate, renewing chan struct{}) {
	t.Helper()
	first, err := src.Receive(e.ctx(), 20)
	if err != nil || len(first) == 0 {
		t.Fatalf("Receive: %d deliveries, %v", len(first), err)
	}
	close(pollGate)
	if err := src.Ack(e.ctx(), first); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the second poll in the buffer", func() bool {
		src.mu.Lock()
		defer src.mu.Unlock()
		return src.inflight == 0 && len(src.buf) > 0
	})
	select {
	case <-renewing:
	case <-time.After(patience):
		t.Fatal("the Source never renewed its buffered messages")
	}
}
