package memory

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
)

// waitEmptyInBackground starts WaitEmpty on queue q and returns its result's
// channel.
func waitEmptyInBackground(t *testing.T, b *Broker, ctx context.Context) <-chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- b.WaitEmpty(ctx, "q") }()
	return done
}

// notYet fails the test if done has a result: WaitEmpty returned while the
// queue still held a message. A WaitEmpty that wrongly returns does so at
// once, so a short look suffices; one that is right never returns here.
func notYet(t *testing.T, done <-chan error, why string) {
	t.Helper()
	select {
	case err := <-done:
		t.Fatalf("WaitEmpty returned %v while %s", err, why)
	case <-time.After(20 * time.Millisecond):
	}
}

func awaitEmpty(t *testing.T, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("WaitEmpty: %v", err)
		}
	case <-time.After(patience):
		t.Fatal("WaitEmpty did not return once the queue was empty")
	}
}

// WaitEmpty returns once every message is acked, and not while one is
// visible, received or delayed.
func TestWaitEmptyWaitsForEveryMessageToBeAcked(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	ctx := context.Background()
	if err := b.WaitEmpty(ctx, "q"); err != nil {
		t.Fatalf("WaitEmpty on an empty queue: %v", err)
	}
	if err := b.Publish(ctx, "q", Message{ID: "a"}, Message{ID: "b"}); err != nil {
		t.Fatal(err)
	}
	done := waitEmptyInBackground(t, b, ctx)
	notYet(t, done, "both messages were visible")
	src := openSource(t, b, WithPollWait(10*time.Millisecond))
	ds := receive(t, src, 2)
	if len(ds) != 2 {
		t.Fatalf("received %v, want a and b", ids(ds))
	}
	notYet(t, done, "both messages were received")
	if err := src.Ack(ctx, ds[:1]); err != nil {
		t.Fatal(err)
	}
	if err := src.Nack(ctx, adapters.NackAll(ds[1:], time.Hour)); err != nil {
		t.Fatal(err)
	}
	notYet(t, done, "one message waited out a delay")
	// Published again while WaitEmpty waits: it waits for that one too.
	if err := b.Publish(ctx, "q", Message{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if err := src.Nack(ctx, adapters.NackAll(ds[1:], 0)); err != nil {
		t.Fatal(err)
	}
	ds = receive(t, src, 2)
	if len(ds) != 2 {
		t.Fatalf("received %v, want b and c", ids(ds))
	}
	if err := src.Ack(ctx, ds[:1]); err != nil {
		t.Fatal(err)
	}
	notYet(t, done, "one message was still received")
	if err := src.Ack(ctx, ds[1:]); err != nil {
		t.Fatal(err)
	}
	awaitEmpty(t, done)
}

// A message moved to the dead-letter queue by MaxReceiveCount has left its
// queue: WaitEmpty returns.
func TestWaitEmptyReturnsWhenTheLastMessageIsRedriven(t *testing.T) {
	b := NewBroker()
	if err := b.CreateQueue("dlq", QueueOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := b.CreateQueue("q", QueueOptions{Lease: time.Hour, MaxReceiveCount: 1, DeadLetterQueue: "dlq"}); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := b.Publish(ctx, "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	src := openSource(t, b, WithPollWait(10*time.Millisecond))
	ds := receive(t, src, 1)
	if err := src.Nack(ctx, adapters.NackAll(ds, 0)); err != nil {
		t.Fatal(err)
	}
	done := waitEmptyInBackground(t, b, ctx)
	notYet(t, done, "the message was visible")
	if ds := receive(t, src, 1); len(ds) != 0 {
		t.Fatalf("received %v, want the message redriven", ids(ds))
	}
	awaitEmpty(t, done)
}

func TestWaitEmptyEndsWithItsContext(t *testing.T) {
	b := newTestBroker(t, QueueOptions{Lease: time.Hour})
	if err := b.Publish(context.Background(), "q", Message{ID: "a"}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := waitEmptyInBackground(t, b, ctx)
	notYet(t, done, "the message was visible")
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("WaitEmpty = %v, want the context's error", err)
		}
	case <-time.After(patience):
		t.Fatal("WaitEmpty did not return when its context ended")
	}
	if err := b.WaitEmpty(context.Background(), "nope"); !errors.Is(err, ErrNoQueue) {
		t.Fatalf("WaitEmpty on a missing queue = %v, want ErrNoQueue", err)
	}
}
