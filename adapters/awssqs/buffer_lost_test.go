package awssqs

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// renewOutageClient fails every ChangeMessageVisibilityBatch while down is
// set, as a network outage or throttling would, and counts those failures.
type renewOutageClient struct {
	*sqs.Client
	down   atomic.Bool
	failed atomic.Int32
}

func (c *renewOutageClient) ChangeMessageVisibilityBatch(ctx context.Context, in *sqs.ChangeMessageVisibilityBatchInput, o ...func(*sqs.Options)) (*sqs.ChangeMessageVisibilityBatchOutput, error) {
	if c.down.Load() {
		c.failed.Add(1)
		return nil, errors.New("connection reset by peer")
	}
	return c.Client.ChangeMessageVisibilityBatch(ctx, in, o...)
}

// TestBufferedMessageWhoseVisibilityRanOutIsLost: renewals of messages
// waiting in the Source fail until their visibility timeout runs out, and
// another consumer receives them. They are no longer this consumer's: the
// Source must mark them lost (as the runtime's lease keeper does for a
// running message), so the runtime does not run them at the same time as the
// other consumer, and it must never use their stale receipt handles again.
// (The emulator, like SQS at times, accepts a stale handle for a message in
// flight under a newer one: a renewal would then hide the other consumer's
// message, and a release at Close would hand it to a third.)
func TestBufferedMessageWhoseVisibilityRanOutIsLost(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 3*time.Second, nil)
	client := &renewOutageClient{Client: e.client}
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	buffered := fillBuffer(t, e, src, url, 30)

	client.down.Store(true)
	// Another consumer gets them once their visibility runs out.
	taken := takeElsewhere(t, e, url, len(buffered))
	// The Source has seen their visibility run out once it gave them up, or
	// once a renewal it tried after they were taken has come back (the
	// buffer renewal is over when bufRenewing is nil). Then SQS answers
	// again.
	failed := client.failed.Load()
	waitFor(t, "the Source to give the messages up or try renewing them again", func() bool {
		lost := 0
		for _, d := range buffered {
			if d.Signal.LostCause() != nil {
				lost++
			}
		}
		tried := client.failed.Load() > failed
		src.mu.Lock()
		defer src.mu.Unlock()
		return lost == len(buffered) || tried && src.bufRenewing == nil
	})
	client.down.Store(false)

	for i, d := range buffered {
		if !taken[d.ID] {
			t.Fatalf("waiting message %s was not taken by the other consumer", d.ID)
		}
		if cause := d.Signal.LostCause(); !errors.Is(cause, adapters.ErrLeaseLost) {
			t.Errorf("waiting message %d, now with another consumer: lost cause %v, want one wrapping ErrLeaseLost", i, cause)
		}
	}
	before := e.counter.Op("ChangeMessageVisibilityBatch")
	err = src.Extend(e.ctx(), buffered, 30*time.Second)
	for i := range buffered {
		if e := adapters.EntryError(err, i); !errors.Is(e, adapters.ErrLeaseLost) {
			t.Errorf("renewing lost message %d: %v, want an error wrapping ErrLeaseLost", i, e)
		}
	}
	if err := src.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n != 0 {
		t.Errorf("%d visibility requests carried the stale receipt handles of lost messages", n)
	}
	// The other consumer holds them for a minute: none may come back.
	if got := e.drain(url, time.Second); len(got) != 0 {
		t.Errorf("%d messages held by the other consumer became visible again", len(got))
	}
}

// fillBuffer publishes n messages to url and leaves some waiting in src's
// buffer: room for n starts a poll per ten; the first poll's messages are
// taken (and acked), the later ones' wait in the Source. It returns those.
// When every poll was back before Receive took its share (a loaded
// machine), nothing waits: it acks them all and tries again with n new
// messages, so that the queue never holds a visible message the test did not
// mean to leave there.
func fillBuffer(t *testing.T, e *env, src *Source, url string, n int) []*adapters.Delivery {
	t.Helper()
	for try := 1; ; try++ {
		for i := range n {
			e.send(url, fmt.Sprint("m", try, "-", i), "", nil)
		}
		first, err := src.Receive(e.ctx(), n)
		if err != nil || len(first) == 0 {
			t.Fatalf("Receive: %d, %v", len(first), err)
		}
		if err := src.Ack(e.ctx(), first); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "all polls back", func() bool {
			src.mu.Lock()
			defer src.mu.Unlock()
			return src.inflight == 0
		})
		src.mu.Lock()
		buffered := append([]*adapters.Delivery(nil), src.buf...)
		src.mu.Unlock()
		if len(buffered) > 0 {
			return buffered
		}
		if len(first) < n {
			t.Fatalf("Receive took %d of %d messages and none waits in the Source", len(first), n)
		}
		if try == 5 {
			t.Fatal("no message waits in the Source after five tries: the test did not set up the case")
		}
	}
}

// takeElsewhere receives, as another consumer holding them for a minute, n
// messages of url as they become visible, and returns their ids.
func takeElsewhere(t *testing.T, e *env, url string, n int) map[string]bool {
	t.Helper()
	taken := map[string]bool{}
	waitFor(t, "another consumer to receive the waiting messages", func() bool {
		out, err := e.client.ReceiveMessage(e.ctx(), &sqs.ReceiveMessageInput{QueueUrl: aws.String(url), MaxNumberOfMessages: 10, VisibilityTimeout: 60})
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range out.Messages {
			taken[aws.ToString(m.MessageId)] = true
		}
		return len(taken) >= n
	})
	return taken
}
