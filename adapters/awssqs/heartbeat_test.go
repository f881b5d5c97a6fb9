package awssqs

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// noHeartbeat hides a Source's lease renewals: Extend succeeds without
// telling SQS, as if the heartbeat were switched off.
type noHeartbeat struct{ *Source }

func (noHeartbeat) Extend(context.Context, []*adapters.Delivery, time.Duration) error { return nil }

// runLongHandler puts one message on a queue with a 2 s visibility timeout
// and handles it with a 7 s handler; it returns how many times the handler
// was called and how many ChangeMessageVisibilityBatch requests were made.
func runLongHandler(t *testing.T, heartbeat bool) (calls int, visibilityRequests int64) {
	e := newEnv(t)
	url, _ := e.queue(false, 2*time.Second, nil)
	e.send(url, "slow", "", nil)
	src, err := New(e.ctx(), e.client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	var s adapters.Source = src
	if !heartbeat {
		s = noHeartbeat{src}
	}
	var (
		mu   sync.Mutex
		done = make(chan struct{})
	)
	c, err := consumer.New(s, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		calls++
		first := calls == 1
		mu.Unlock()
		if !first {
			return nil // a redelivery: the lease lapsed
		}
		select {
		case <-time.After(7 * time.Second):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		close(done)
		return nil
	}), consumer.WithConcurrency(4), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- c.Run(ctx) }()
	select {
	case <-done:
	case <-time.After(patience):
		t.Fatal("the 7 s handler did not finish")
	}
	// Watch past two more visibility timeouts for a late redelivery.
	time.Sleep(4500 * time.Millisecond)
	cancel()
	if err := <-ran; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if heartbeat {
		if v, f := e.counts(url); v+f != 0 {
			t.Errorf("queue still holds %d visible and %d in-flight messages; the ack was lost", v, f)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	return calls, e.counter.Op("ChangeMessageVisibilityBatch")
}

func TestHeartbeatKeepsLongHandlerExclusive(t *testing.T) {
	t.Parallel()
	calls, renewals := runLongHandler(t, true)
	if calls != 1 {
		t.Errorf("message received %d times, want exactly once: the heartbeat did not keep it invisible", calls)
	}
	// 7 s at one renewal per 2/3 s is about ten; ask for clearly more than
	// one so a single stray call does not pass.
	if renewals < 5 {
		t.Errorf("%d ChangeMessageVisibilityBatch requests during a 7 s handler on a 2 s timeout, want about 10", renewals)
	}
	t.Logf("received once; %d heartbeat requests", renewals)
}

// TestWithoutHeartbeatMessageComesBack shows the test above can fail: with
// renewals switched off the message is redelivered while the handler runs.
func TestWithoutHeartbeatMessageComesBack(t *testing.T) {
	t.Parallel()
	calls, renewals := runLongHandler(t, false)
	if calls < 2 {
		t.Errorf("message received %d times without a heartbeat, want at least twice", calls)
	}
	if renewals != 0 {
		t.Errorf("%d visibility requests with the heartbeat off, want 0", renewals)
	}
}
