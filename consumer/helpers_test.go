package consumer_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"go.uber.org/goleak"
)

// TestMain fails the package if any test leaves a goroutine behind: Run
// must end everything it starts.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const patience = 30 * time.Second

type env struct {
	t *testing.T
	b *memory.Broker
}

// newEnv creates a broker with queue "q" (the given lease) and "dlq".
func newEnv(t *testing.T, opts memory.QueueOptions) *env {
	t.Helper()
	b := memory.NewBroker()
	if err := b.CreateQueue("dlq", memory.QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if opts.MaxReceiveCount > 0 && opts.DeadLetterQueue == "" {
		opts.DeadLetterQueue = "dlq"
	}
	if err := b.CreateQueue("q", opts); err != nil {
		t.Fatal(err)
	}
	return &env{t: t, b: b}
}

func (e *env) publish(bodies ...string) {
	e.t.Helper()
	for _, body := range bodies {
		if err := e.b.Publish(context.Background(), "q", memory.Message{Body: []byte(body)}); err != nil {
			e.t.Fatal(err)
		}
	}
}

// publishKeyed publishes bodies with Message.Key key, in order.
func (e *env) publishKeyed(key string, bodies ...string) {
	e.t.Helper()
	for _, body := range bodies {
		if err := e.b.Publish(context.Background(), "q", memory.Message{Key: key, Body: []byte(body)}); err != nil {
			e.t.Fatal(err)
		}
	}
}

func (e *env) source(opts ...memory.SourceOption) *memory.Source {
	e.t.Helper()
	opts = append([]memory.SourceOption{memory.WithPollWait(10 * time.Millisecond)}, opts...)
	s, err := e.b.Source("q", opts...)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

// receiveCounter counts a source's Receive calls.
type receiveCounter struct {
	*memory.Source
	calls atomic.Int32
}

func (s *receiveCounter) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	s.calls.Add(1)
	return s.Source.Receive(ctx, max)
}

// sourceLosingFirstAck returns a source whose first ack fails, as one lost
// on the wire would.
func (e *env) sourceLosingFirstAck() *memory.Source {
	var failOnce atomic.Bool
	failOnce.Store(true)
	return e.source(memory.WithFaults(memory.Faults{Ack: func(*adapters.Delivery) error {
		if failOnce.CompareAndSwap(true, false) {
			return errors.New("ack lost on the wire")
		}
		return nil
	}}))
}

func (e *env) dlq() *memory.DeadLetterQueue {
	d, err := e.b.DeadLetterQueue("dlq")
	if err != nil {
		e.t.Fatal(err)
	}
	return d
}

func (e *env) stats(q string) memory.Stats {
	s, err := e.b.Stats(q)
	if err != nil {
		e.t.Fatal(err)
	}
	return s
}

type running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
	t      *testing.T
}

func run(t *testing.T, src *memory.Source, h consumer.HandlerFunc, opts ...consumer.Option) *running {
	t.Helper()
	return runOn(t, src, h, opts...)
}

// runOn is run for any source, such as a memory source wrapped by a test.
func runOn(t *testing.T, src adapters.Source, h consumer.HandlerFunc, opts ...consumer.Option) *running {
	t.Helper()
	return runIn(t, context.Background(), src, h, opts...)
}

// runIn is runOn with Run's context derived from parent.
func runIn(t *testing.T, parent context.Context, src adapters.Source, h consumer.HandlerFunc, opts ...consumer.Option) *running {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)
	c, err := consumer.New(src, h, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	ctx, cancel := context.WithCancel(parent)
	r := &running{cancel: cancel, done: make(chan error, 1), t: t}
	go func() { r.done <- c.Run(ctx) }()
	t.Cleanup(func() { r.stop() })
	return r
}

func (r *running) stop() error {
	r.once.Do(func() {
		r.cancel()
		select {
		case r.err = <-r.done:
		case <-time.After(patience):
			r.t.Errorf("Run did not return")
		}
	})
	return r.err
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(patience)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// await receives from ch, failing the test after patience rather than
// hanging the whole run when a regression means nothing is ever sent.
func await[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(patience):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}

func fastRetry(n int) consumer.Option {
	return consumer.WithRetry(consumer.Retry{MaxAttempts: n, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)})
}

// counter counts calls per body.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func newCounter() *counter { return &counter{n: map[string]int{}} }

func (c *counter) inc(b []byte) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[string(b)]++
	return c.n[string(b)]
}

func (c *counter) get(b string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[b]
}

func (c *counter) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.n)
}

// deliveriesOf returns the deliveries of a Nack call's entries.
func deliveriesOf(ns []adapters.Nack) []*adapters.Delivery {
	ds := make([]*adapters.Delivery, len(ns))
	for i, n := range ns {
		ds[i] = n.Delivery
	}
	return ds
}
