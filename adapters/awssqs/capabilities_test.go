package awssqs

import (
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters"
)

func TestCapabilities(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 7*time.Second, nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	want := adapters.Capabilities{
		Name:             "sqs:" + src.name,
		System:           "aws_sqs",
		Lease:            7 * time.Second,              // read from the queue
		MaxLeaseAge:      12*time.Hour - 5*time.Second, // less the long poll's wait (0 here) and a margin
		NackDelay:        true,
		CountsDeliveries: true,
		MaxReceive:       10,
		Receivers:        DefaultPollers,
		Ack:              adapters.Batching{MaxEntries: 10, Linger: DefaultAckLinger, MaxCalls: 4},
		Nack:             adapters.Batching{MaxEntries: 10, Linger: DefaultNackLinger, MaxCalls: 4},
		Extend:           adapters.Batching{MaxEntries: 10, MaxCalls: 4},
	}
	if got := src.Capabilities(); got != want {
		t.Errorf("Capabilities() = %+v\nwant %+v", got, want)
	}
}

// TestRuntimeCapComesBeforeSQSs: SQS's 12 hours start when it picks a
// message, up to a whole long poll before the answer sets ReceivedAt, from
// which the runtime counts its cap (MaxLeaseAge). Announced as 12 hours, it
// would let the handler run for up to a poll's wait after SQS had made the
// message visible to others.
func TestRuntimeCapComesBeforeSQSs(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	src, err := New(e.ctx(), e.client, url, WithWaitTime(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	picked := time.Now()
	receivedAt := picked.Add(20 * time.Second) // the answer of a full long poll
	if end := receivedAt.Add(src.Capabilities().MaxLeaseAge); end.After(picked.Add(MaxLeaseAge)) {
		t.Fatalf("the runtime may hold a message until %v after SQS's 12 hours ran out", end.Sub(picked.Add(MaxLeaseAge)))
	}
}

// TestVisibilityTimeoutOption: the option overrides the queue's timeout for
// every receive, and the lease reported matches what SQS applies.
func TestVisibilityTimeoutOption(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Minute, nil)
	e.send(url, "m", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions(WithVisibilityTimeout(2*time.Second))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if l := src.Capabilities().Lease; l != 2*time.Second {
		t.Fatalf("Lease = %v, want the 2s asked for", l)
	}
	ds := receiveAtLeast(t, src, 1)
	// Not renewed: the message must come back after about 2 s, not 5 min.
	var back bool
	waitFor(t, "the message back after its 2 s timeout", func() bool {
		back = back || len(e.drain(url, 0)) == 1
		return back
	})
	if since := time.Since(ds[0].ReceivedAt); since < 1500*time.Millisecond {
		t.Errorf("message back %v after the receive, before its timeout", since)
	}
}

// TestZeroVisibilityQueueNeedsTheOption: a queue whose VisibilityTimeout is
// 0 makes every message it hands out visible again at once, to any other
// consumer, while the handler runs: nothing could be held. New refuses it,
// naming the option that gives the receives a timeout of their own, and
// accepts it with that option.
func TestZeroVisibilityQueueNeedsTheOption(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	// Set afterwards: the emulator creates a queue asked for 0 with its
	// default of 30 s.
	if _, err := e.client.SetQueueAttributes(e.ctx(), &sqs.SetQueueAttributesInput{QueueUrl: aws.String(url), Attributes: map[string]string{"VisibilityTimeout": "0"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := New(e.ctx(), e.client, url, testOptions()...); err == nil || !strings.Contains(err.Error(), "WithVisibilityTimeout") {
		t.Fatalf("New on a queue with VisibilityTimeout 0: %v, want an error naming WithVisibilityTimeout", err)
	}
	src, err := New(e.ctx(), e.client, url, testOptions(WithVisibilityTimeout(30*time.Second))...)
	if err != nil {
		t.Fatalf("New with WithVisibilityTimeout: %v", err)
	}
	defer src.Close()
	if l := src.Capabilities().Lease; l != 30*time.Second {
		t.Fatalf("Lease = %v, want the 30s asked for", l)
	}
}
