//go:debug panicnil=1

// Package panicniltest runs the consumer under GODEBUG panicnil=1, where
// recover returns nil for panic(nil): a test binary of its own, since the
// setting holds for a whole program.
package panicniltest

import (
	"context"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A handler's panic(nil) under panicnil=1 looks, from its recover, like
// runtime.Goexit: neither a return nor a panic value. It is a panic like any
// other, retried: it used to be settled as a Goexit and then again as a
// failed attempt, which crashed the process (a negative WaitGroup counter).
func TestPanicNilIsAFailedAttempt(t *testing.T) {
	b := memory.NewBroker()
	must(t, b.CreateQueue("q", memory.QueueOptions{Lease: time.Minute}))
	must(t, b.Publish(context.Background(), "q", memory.Message{Body: []byte("x")}))
	src, err := b.Source("q", memory.WithPollWait(10*time.Millisecond))
	must(t, err)
	attempts := make(chan int, 10)
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		attempts <- m.Attempt
		if m.Attempt == 1 {
			panic(nil)
		}
		return nil
	}), consumer.WithLogger(testlog.New(t)),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(time.Millisecond)}))
	must(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	for want := 1; want <= 2; want++ {
		if got := within(t, "the next attempt", attempts); got != want {
			t.Fatalf("attempt %d, want %d", got, want)
		}
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		s, err := b.Stats("q")
		must(t, err)
		if s.Acked == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second attempt's ack was not sent: %+v", s)
		}
	}
	cancel()
	must(t, within(t, "Run to return", done))
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// within receives from ch, failing the test rather than hanging it.
func within[T any](t *testing.T, what string, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
		panic("unreachable")
	}
}
