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
)

// startConsumer runs c in the background and returns Run's result channel.
func startConsumer(t *testing.T, c *consumer.Consumer) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	t.Cleanup(func() { _ = c.Shutdown(context.Background()) }) // waits for Run
	return done
}

// stopSignalSource closes stopped once Run's receive context is done and no
// Receive is running: the runtime has stopped receiving. Waiting only for a
// Receive to end with its context done is not enough: the cancellation can
// land between two calls, and then the runtime, which checks its context
// before each call, makes no further call to see it.
type stopSignalSource struct {
	*memory.Source
	stopped chan struct{}
	once    sync.Once

	mu        sync.Mutex
	receiving int
	watching  bool

	closed atomic.Bool // Run closes its source just before it returns
}

func (s *stopSignalSource) Close() error {
	s.closed.Store(true)
	return s.Source.Close()
}

func (s *stopSignalSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	s.mu.Lock()
	s.receiving++
	if !s.watching {
		// Every call gets Run's receive context.
		s.watching = true
		context.AfterFunc(ctx, s.check)
	}
	s.mu.Unlock()
	ds, err := s.Source.Receive(ctx, n)
	s.mu.Lock()
	s.receiving--
	s.mu.Unlock()
	if ctx.Err() != nil {
		s.check()
	}
	return ds, err
}

// check closes stopped if no Receive is running (it is called once the
// receive context is done).
func (s *stopSignalSource) check() {
	s.mu.Lock()
	idle := s.receiving == 0
	s.mu.Unlock()
	if idle {
		s.once.Do(func() { close(s.stopped) })
	}
}

// TestShutdownWaitsForTheDrainAndAcks: Shutdown stops receiving, lets the
// running handler finish, acks it, and returns only once Run has returned;
// a message published after it began is not taken.
func TestShutdownWaitsForTheDrainAndAcks(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("running")
	started, release := make(chan struct{}), make(chan struct{})
	src := &stopSignalSource{Source: e.source(), stopped: make(chan struct{})}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		close(started)
		select {
		case <-release:
		case <-ctx.Done(): // the shutdown timeout: only if the test failed
		}
		return ctx.Err()
	}), consumer.WithLogger(testlog.New(t)), consumer.WithShutdownTimeout(patience))
	if err != nil {
		t.Fatal(err)
	}
	ran := startConsumer(t, c)
	await(t, "the handler to start", started)
	shut := make(chan error, 1)
	go func() { shut <- c.Shutdown(context.Background()) }()
	await(t, "Run to stop receiving", src.stopped) // Shutdown began: Run drains
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned %v while a handler was still running", err)
	case <-ran:
		t.Fatal("Run returned while a handler was still running")
	default:
	}
	close(release)
	if err := await(t, "Shutdown to return", shut); err != nil {
		t.Fatalf("Shutdown = %v, want nil after a clean drain", err)
	}
	// Run's result reaches ran only after Run has returned, which may be
	// after Shutdown returned; the source's Close, Run's last step, may not.
	if !src.closed.Load() {
		t.Fatal("Shutdown returned before Run did: the source is not closed yet")
	}
	if err := await(t, "Run to return", ran); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	e.publish("after")
	if s := e.stats("q"); s.Acked != 1 || s.Received != 1 || s.Visible != 1 {
		t.Fatalf("stats %+v: want the running message acked and the later one left in the queue", s)
	}
}

// TestShutdownContextCutsTheDrainShort: when Shutdown's context ends first,
// the running handler's context is cancelled with ErrShutdownTimeout (the
// shutdown timeout being far away), Shutdown returns the context's error,
// and the unfinished message is given back.
func TestShutdownContextCutsTheDrainShort(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("stuck")
	started := make(chan struct{})
	cause := make(chan error, 1)
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}), consumer.WithLogger(testlog.New(t)), consumer.WithShutdownTimeout(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	ran := startConsumer(t, c)
	<-started
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.Shutdown(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Shutdown = %v, want context.Canceled", err)
	}
	if err := <-cause; !errors.Is(err, consumer.ErrShutdownTimeout) {
		t.Fatalf("handler's context cause = %v, want ErrShutdownTimeout", err)
	}
	if err := <-ran; err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if s := e.stats("q"); s.Visible != 1 || s.Acked != 0 {
		t.Fatalf("stats %+v: the unfinished message must be given back, not acked", s)
	}
}

// TestShutdownBeforeRun: Run then returns at once without taking anything.
func TestShutdownBeforeRun(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("m")
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		t.Error("handler ran after Shutdown")
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown before Run = %v, want nil", err)
	}
	if err := c.Run(context.Background()); err != nil {
		t.Fatalf("Run after Shutdown = %v, want nil", err)
	}
	if s := e.stats("q"); s.Visible != 1 {
		t.Fatalf("stats %+v: nothing may be taken after Shutdown", s)
	}
}

// TestShutdownAfterRunReturnedIsNil: once Run has returned there is nothing
// left to wait for, so Shutdown returns nil even with a context that has
// already ended (a SIGTERM handler's deadline), not that context's error.
func TestShutdownAfterRunReturnedIsNil(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run = %v", err)
	}
	ended, end := context.WithCancel(context.Background())
	end()
	for i := 0; i < 50; i++ {
		if err := c.Shutdown(ended); err != nil {
			t.Fatalf("Shutdown after Run returned = %v, want nil", err)
		}
	}
}

// backlogSource hands out what it already holds even once ctx is done, as
// the Kafka adapter does with records it fetched ahead; it ends the Run at
// its first receive, publishing one more message just then.
type backlogSource struct {
	*memory.Source
	b    *memory.Broker
	stop context.CancelFunc
	once sync.Once
}

func (s *backlogSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	if ctx.Err() != nil {
		ds, err := s.Source.Receive(context.Background(), n)
		if len(ds) > 0 {
			return ds, err
		}
		return nil, ctx.Err()
	}
	ds, err := s.Source.Receive(ctx, n)
	if len(ds) > 0 {
		s.once.Do(func() {
			_ = s.b.Publish(context.Background(), "q", memory.Message{Body: []byte("late")})
			s.stop() // shutdown begins as this batch comes back
		})
	}
	return ds, err
}

// TestNoReceiveAfterShutdownBegan: once Run's context is done the runtime
// calls Receive no more. It stopped only when Receive said so, so a source
// that still hands out what it holds (Kafka's fetched records) had them run
// by new handlers after shutdown began.
func TestNoReceiveAfterShutdownBegan(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("first")
	ctx, cancel := context.WithCancel(context.Background())
	src := &backlogSource{Source: e.source(), b: e.b, stop: cancel}
	seen := newCounter()
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		seen.inc(m.Body)
		return nil
	}), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		t.Fatalf("Run = %v", err)
	}
	if n := seen.get("late"); n != 0 {
		t.Fatal("a message received after shutdown began was handled")
	}
	if s := e.stats("q"); s.Received != 1 {
		t.Fatalf("stats %+v: the late message must not be received", s)
	}
}

// uncountedRecorder is a nackRecorder whose broker, as far as the runtime
// can tell, delays redelivery but counts no deliveries: its retries wait in
// place, not at the broker.
type uncountedRecorder struct{ *nackRecorder }

func (s uncountedRecorder) Capabilities() adapters.Capabilities {
	c := s.nackRecorder.Capabilities()
	c.CountsDeliveries = false
	return c
}

// A message that fails while the drain runs, by its handler or by its
// dead-letter write, is given back with its backoff where the broker can
// delay a redelivery, even one whose retries otherwise wait in place: given
// back at once, it came straight back to the next consumer, at no pace. The
// first message's failure waits until the drain has given back the second,
// which never started.
func TestFailureDuringTheDrainIsGivenBackWithItsBackoff(t *testing.T) {
	for _, failing := range []string{"handler", "dead-letter write"} {
		t.Run(failing, func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.publish("first", "second")
			src := uncountedRecorder{&nackRecorder{Source: e.source()}}
			started, release := make(chan string, 1), make(chan struct{})
			block := func(body string) {
				started <- body
				<-release
			}
			dlq := e.dlq()
			dlq.SetFault(func(d *adapters.Delivery) error {
				block(string(d.Body))
				return errors.New("dead-letter queue down")
			})
			var calls atomic.Int32
			r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
				if calls.Add(1) > 1 {
					t.Errorf("%s handled after the drain began", m.Body)
					return nil
				}
				if failing == "handler" {
					block(string(m.Body))
					return errors.New("downstream unavailable")
				}
				return consumer.Permanent(errors.New("cannot parse"))
			}, consumer.WithConcurrency(1), consumer.WithMaxInFlight(2), consumer.WithDeadLetter(dlq),
				consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(time.Hour)}))
			waitFor(t, "both messages received", func() bool { return e.stats("q").InFlight == 2 })
			failed := await(t, "the "+failing+" to start", started)
			stopped := make(chan error, 1)
			go func() { stopped <- r.stop() }()
			waitFor(t, "the waiting message given back by the drain", func() bool {
				bodies, _ := src.nacked()
				return len(bodies) == 1
			})
			close(release)
			if err := await(t, "Run to return", stopped); err != nil {
				t.Fatal(err)
			}
			bodies, delays := src.nacked()
			if len(bodies) != 2 || bodies[1] != failed || delays[1] != time.Hour {
				t.Fatalf("nacked %v with delays %v, want %s given back last with its hour of backoff", bodies, delays, failed)
			}
		})
	}
}

// A retry waiting in place for its backoff (an ordered lane) when shutdown
// begins is given back at once, without another attempt: the drain lets
// running handlers finish, it starts none.
func TestRetryWaitingInPlaceIsGivenBackAtShutdown(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("k", "x")
	var calls atomic.Int32
	failed := make(chan struct{})
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) == 1 {
			close(failed)
		}
		return errors.New("downstream unavailable")
	}, consumer.WithOrdering(consumer.OrderByKey),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 5, Backoff: consumer.ConstantBackoff(time.Hour)}))
	await(t, "the first attempt to fail", failed)
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler ran %d times, want once: a retry ran during the drain", n)
	}
	if s := e.stats("q"); s.Visible != 1 || s.Acked != 0 {
		t.Errorf("stats %+v, want the message given back for redelivery at once", s)
	}
}

// stuckReceiveSource is a memory source whose Receive, once stuck is set,
// blocks until unblock is closed, whatever its context says: franz-go's poll
// while a rebalance is under way, whose revoke waits for the running
// handlers.
type stuckReceiveSource struct {
	*memory.Source
	stuck   atomic.Bool
	entered chan struct{}
	once    sync.Once
	unblock chan struct{}
}

func (s *stuckReceiveSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	if s.stuck.Load() {
		s.once.Do(func() { close(s.entered) })
		<-s.unblock
		return nil, ctx.Err()
	}
	return s.Source.Receive(ctx, n)
}

// The shutdown timeout runs from when the shutdown begins, even while the
// runtime's Receive cannot end yet: the running handler is cut at the
// timeout (its context's cause ErrShutdownTimeout), not left running until
// the source lets the Receive go, which for a Kafka revoke can wait for that
// very handler.
func TestShutdownTimeoutDoesNotWaitForAStuckReceive(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("running")
	src := &stuckReceiveSource{Source: e.source(), entered: make(chan struct{}), unblock: make(chan struct{})}
	started := make(chan struct{})
	cause := make(chan error, 1)
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		src.stuck.Store(true)
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}), consumer.WithLogger(testlog.New(t)), consumer.WithShutdownTimeout(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ran := startConsumer(t, c)
	var unblockOnce sync.Once
	unblock := func() { unblockOnce.Do(func() { close(src.unblock) }) }
	t.Cleanup(unblock) // before startConsumer's Shutdown: a failed wait must not hang the run
	await(t, "the handler to start", started)
	await(t, "a Receive to get stuck", src.entered)
	go func() { _ = c.Shutdown(context.Background()) }()
	err = await(t, "the handler's context to be cancelled while Receive is stuck", cause)
	unblock()
	if !errors.Is(err, consumer.ErrShutdownTimeout) {
		t.Errorf("handler's context cause = %v, want ErrShutdownTimeout", err)
	}
	if err := await(t, "Run to return", ran); err != nil {
		t.Fatalf("Run = %v, want nil", err)
	}
	if s := e.stats("q"); s.Visible != 1 || s.Acked != 0 {
		t.Fatalf("stats %+v: the unfinished message must be given back, not acked", s)
	}
}
