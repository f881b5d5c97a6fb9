package awssqs

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs"
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
	if secs := nackTimeout(ds[0], time.Minute, now); secs > 10 {
		t.Errorf("nack 10 s before the cap asks %d s; SQS would refuse it", secs)
	}
}
