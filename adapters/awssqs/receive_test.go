package awssqs

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/sqs"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// TestReceiveHidesOnlyWhatItReturns: a Receive asking for more than one
// ReceiveMessage call brings makes one call and returns its messages; the
// rest of the queue stays visible, so another consumer receives it at once
// (the queue's visibility timeout here is five minutes).
func TestReceiveHidesOnlyWhatItReturns(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Minute, nil)
	const n = 20
	for i := range n {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	src, err := New(e.ctx(), e.client, url, testOptions(WithPollers(2))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	var held []*adapters.Delivery
	for len(held) == 0 {
		ds, err := src.Receive(e.ctx(), n)
		if err != nil {
			t.Fatal(err)
		}
		held = ds
	}
	if len(held) > 10 {
		t.Fatalf("Receive returned %d messages; one ReceiveMessage brings ten at most", len(held))
	}
	if got := distinctBodies(e.drain(url, time.Second)); got != n-len(held) {
		t.Errorf("another consumer received %d messages right after a Receive took %d of %d; want the %d it did not return", got, len(held), n, n-len(held))
	}
	if err := src.Ack(e.ctx(), held); err != nil {
		t.Fatal(err)
	}
}

// answerInTransitClient takes messages from the queue at once, but holds the
// answer of its first ReceiveMessage until deliver is closed, as a network
// would that is slow to carry it. A call whose context ends first loses its
// answer, as a cut connection does: SQS picked the messages, and no one
// hears of them.
type answerInTransitClient struct {
	*sqs.Client
	entered chan struct{}
	deliver chan struct{}
	calls   atomic.Int32
}

func (c *answerInTransitClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	out, err := c.Client.ReceiveMessage(ctx, in, o...)
	if c.calls.Add(1) != 1 {
		return out, err
	}
	close(c.entered)
	select {
	case <-c.deliver:
		return out, err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// TestReceiveGivenUpHandsOutNothingAndHidesNothing: the runtime's context
// ends (shutdown) while a ReceiveMessage call is in flight and SQS has
// picked messages for it. Receive returns at once with the context's error
// and no delivery; the call's answer, when it arrives, is not dropped: its
// messages are made visible again at once, for any consumer, rather than
// left invisible for the visibility timeout (five minutes here).
func TestReceiveGivenUpHandsOutNothingAndHidesNothing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 5*time.Minute, nil)
	const n = 5
	for i := range n {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	client := &answerInTransitClient{Client: e.client, entered: make(chan struct{}), deliver: make(chan struct{})}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { mp.Shutdown(context.Background()) })
	src, err := New(e.ctx(), client, url, testOptions(WithMeterProvider(mp))...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	ctx, cancel := context.WithCancel(context.Background())
	received := make(chan int, 1)
	go func() {
		ds, err := src.Receive(ctx, n)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Receive whose context ended: %v, want context.Canceled", err)
		}
		received <- len(ds)
	}()
	<-client.entered // SQS has picked the messages
	cancel()
	select {
	case got := <-received:
		if got != 0 {
			t.Errorf("Receive handed out %d deliveries after its context ended", got)
		}
	case <-time.After(patience):
		t.Fatal("Receive did not return when its context ended")
	}
	close(client.deliver)
	waitFor(t, "the messages made visible again", func() bool { return src.Stats().Released == n })
	if got := distinctBodies(e.drain(url, time.Second)); got != n {
		t.Errorf("another consumer received %d of the %d messages the given-up receive took; want all, at once", got, n)
	}
	if got := sums(t, reader, "custody.sqs.released"); got[src.name] != n {
		t.Errorf("custody.sqs.released = %v, want %d for %s", got, n, src.name)
	}
}

// silentReceiveClient never answers a ReceiveMessage: the call returns only
// when its context ends, as a long poll on an empty queue does.
type silentReceiveClient struct {
	*sqs.Client
	entered chan struct{}
	once    sync.Once
}

func (c *silentReceiveClient) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	c.once.Do(func() { close(c.entered) })
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestCloseCutsTheCallsInFlight: a ReceiveMessage call goes on when the
// Receive that made it gives up (see above), but Close ends it: the Source
// owns the call, and Close returns only once no call of it runs.
func TestCloseCutsTheCallsInFlight(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	client := &silentReceiveClient{Client: e.client, entered: make(chan struct{})}
	// Without Close the call would run for an hour.
	src, err := New(e.ctx(), client, url, WithWaitTime(20*time.Second), withRequestTimeout(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go src.Receive(ctx, 10)
	<-client.entered
	cancel() // the Receive gives up; its call goes on
	closed := make(chan error, 1)
	go func() { closed <- src.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(patience):
		t.Fatal("Close did not return with a ReceiveMessage call in flight")
	}
	if _, err := src.Receive(context.Background(), 1); !errors.Is(err, adapters.ErrClosed) {
		t.Errorf("Receive after Close: %v, want ErrClosed", err)
	}
}

// concurrentReceives counts the ReceiveMessage calls in flight at once. Each
// call waits, before it goes to SQS, until another is in flight beside it
// or wide is closed, so that two receivers show up as two calls at once
// however they are scheduled.
type concurrentReceives struct {
	*sqs.Client
	mu       sync.Mutex
	inFlight int
	most     int
	wide     chan struct{}
	widened  sync.Once
}

func (c *concurrentReceives) ReceiveMessage(ctx context.Context, in *sqs.ReceiveMessageInput, o ...func(*sqs.Options)) (*sqs.ReceiveMessageOutput, error) {
	c.mu.Lock()
	c.inFlight++
	c.most = max(c.most, c.inFlight)
	if c.inFlight >= 2 {
		c.widened.Do(func() { close(c.wide) })
	}
	c.mu.Unlock()
	defer func() {
		c.mu.Lock()
		c.inFlight--
		c.mu.Unlock()
	}()
	select {
	case <-c.wide:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return c.Client.ReceiveMessage(ctx, in, o...)
}

func (c *concurrentReceives) mostAtOnce() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.most
}

// TestRuntimeRunsThePollers: the Source declares its pollers as receivers,
// so the runtime runs several ReceiveMessage calls at once on a standard
// queue, each asking for what it has room for; on a FIFO queue it runs
// one at a time.
func TestRuntimeRunsThePollers(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(false, 30*time.Second, nil)
	const n = 40
	for i := range n {
		e.send(url, fmt.Sprint(i), "", nil)
	}
	client := &concurrentReceives{Client: e.client, wide: make(chan struct{})}
	src, err := New(e.ctx(), client, url, testOptions(WithPollers(4))...)
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int32
	runUntil(t, src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		handled.Add(1)
		return nil
	}), "two ReceiveMessage calls at once and every message handled", func() bool {
		return client.mostAtOnce() >= 2 && handled.Load() >= n
	}, consumer.WithConcurrency(8))
	if most := client.mostAtOnce(); most > 4 {
		t.Errorf("%d ReceiveMessage calls at once with WithPollers(4)", most)
	}
}

func TestFIFOPollsOneAtATime(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(true, 30*time.Second, nil)
	const n = 30
	for i := range n {
		e.send(url, fmt.Sprint(i), fmt.Sprint("g", i%6), nil)
	}
	// Calls are let through one by one: two at once would close wide.
	client := &concurrentReceives{Client: e.client, wide: make(chan struct{})}
	close(client.wide)
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	if r := src.Capabilities().Receivers; r != 1 {
		t.Fatalf("a FIFO queue reports %d receivers, want 1", r)
	}
	var handled atomic.Int32
	runUntil(t, src, consumer.HandlerFunc(func(context.Context, *consumer.Message) error {
		handled.Add(1)
		return nil
	}), "every message handled", func() bool { return handled.Load() >= n },
		consumer.WithConcurrency(8))
	if most := client.mostAtOnce(); most != 1 {
		t.Errorf("%d ReceiveMessage calls at once on a FIFO queue, want 1", most)
	}
}
