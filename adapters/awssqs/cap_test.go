package awssqs

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

// slowAnswerClient stands for a ReceiveMessage answer that takes a while to
// arrive (network, decoding ten large messages, a GC pause): it notes when
// each call was made, and returns the answer late.
type slowAnswerClient struct {
	*sqs.Client
	late time.Duration
	mu   sync.Mutex
	sent []time.Time
}

func (c *slowAnswerClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	c.mu.Lock()
	c.sent = append(c.sent, time.Now())
	c.mu.Unlock()
	out, err := c.Client.ReceiveMessage(ctx, in, o...)
	time.Sleep(c.late)
	return out, err
}

// TestTwelveHoursCountFromTheReceiveAtSQS: SQS counts a message's 12 hours of
// invisibility from when it received the message, which can be well before
// its answer reaches the Source, and refuses a visibility change reaching
// past them. A renewal near the cap must ask no more than SQS has left,
// whatever the delay of the answer.
func TestTwelveHoursCountFromTheReceiveAtSQS(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "m", "", nil)
	c := &slowAnswerClient{Client: e.client, late: 1500 * time.Millisecond}
	src, err := New(e.ctx(), c, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ds := receiveAtLeast(t, src, 1)
	defer src.Ack(e.ctx(), ds)
	c.mu.Lock()
	// SQS took the message during the last call, at or after it was made.
	asked := c.sent[len(c.sent)-1]
	c.mu.Unlock()

	// Ten seconds before the 12 hours run out by SQS's clock at the latest.
	now := asked.Add(MaxLeaseAge - 10*time.Second)
	secs, err := capTimeout(ds[0], time.Minute, now)
	if err != nil {
		t.Fatalf("renewal 10 s before the cap: %v", err)
	}
	if secs > 10 {
		t.Errorf("renewal 10 s before the cap asks %d s; SQS would refuse anything past its 12 hours", secs)
	}
	if secs, _ := capTimeout(ds[0], time.Minute, now); secs > 10 {
		t.Errorf("nack 10 s before the cap asks %d s; SQS would refuse it", secs)
	}
}

// TestRenewalPastTwelveHoursLosesTheDelivery: a delivery SQS has kept
// invisible for its 12 hours cannot be renewed; Extend marks it lost with
// ErrMaxVisibility, so the runtime cancels its handler, and sends no
// request SQS would refuse. (The receive's time is moved back here: the
// emulator keeps no 12-hour clock.)
func TestRenewalPastTwelveHoursLosesTheDelivery(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	e.send(url, "old", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	d := receiveAtLeast(t, src, 1)[0]
	d.Handle.(*handle).asked = time.Now().Add(-MaxLeaseAge - time.Minute)

	before := e.counter.Op("ChangeMessageVisibilityBatch")
	err = src.Extend(e.ctx(), []*adapters.Delivery{d}, 30*time.Second)
	var be *adapters.BatchError
	if !errors.As(err, &be) || !errors.Is(be.Failed[0], ErrMaxVisibility) {
		t.Fatalf("Extend past the 12 hours: %v, want a BatchError of ErrMaxVisibility", err)
	}
	if n := e.counter.Op("ChangeMessageVisibilityBatch") - before; n != 0 {
		t.Errorf("Extend sent %d requests for a delivery past the cap, want none", n)
	}
}
