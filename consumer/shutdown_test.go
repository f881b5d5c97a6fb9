package consumer_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testlog"
)

// startConsumer runs c in the background and returns Run's result channel.
func startConsumer(t *testing.T, c *consumer.Consumer) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Run(context.Background()) }()
	t.Cleanup(func() { _ = c.Shutdown(context.Background()) }) // waits for Run
	return done
}

// stopSignalSource closes stopped when a Receive ends with its context done:
// the runtime has stopped receiving.
type stopSignalSource struct {
	*memory.Source
	stopped chan struct{}
	once    sync.Once
}

func (s *stopSignalSource) Receive(ctx context.Context, n int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, n)
	if ctx.Err() != nil {
		s.once.Do(func() { close(s.stopped) })
	}
	return ds, err
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
		<-release
		return ctx.Err()
	}), consumer.WithLogger(testlog.New(t)), consumer.WithShutdownTimeout(patience))
	if err != nil {
		t.Fatal(err)
	}
	ran := startConsumer(t, c)
	<-started
	shut := make(chan error, 1)
	go func() { shut <- c.Shutdown(context.Background()) }()
	<-src.stopped // Shutdown began: Run stopped receiving and drains
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned %v while a handler was still running", err)
	case <-ran:
		t.Fatal("Run returned while a handler was still running")
	default:
	}
	close(release)
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown = %v, want nil after a clean drain", err)
	}
	select {
	case err := <-ran:
		if err != nil {
			t.Fatalf("Run = %v, want nil", err)
		}
	default:
		t.Fatal("Shutdown returned before Run did")
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
