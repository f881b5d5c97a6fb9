package consumer_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// WithHandlerTimeout's godoc: a handler that returns nil after its timeout
// cancelled its context has its message acked, not retried.
func TestHandlerReturningNilAfterItsTimeoutIsAcked(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("late but done")
	var calls atomic.Int32
	cause := make(chan error, 1)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) == 1 {
			<-ctx.Done()
			cause <- context.Cause(ctx)
		}
		return nil // the effect completed anyway
	}, consumer.WithHandlerTimeout(5*time.Millisecond), fastRetry(3), consumer.WithDeadLetter(e.dlq()))
	if err := await(t, "the timeout", cause); !errors.Is(err, consumer.ErrHandlerTimeout) {
		t.Fatalf("cause = %v, want ErrHandlerTimeout", err)
	}
	waitFor(t, "the ack", func() bool { return e.stats("q").Acked == 1 })
	if err := r.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("handler called %d times, want 1", n)
	}
	if s := e.stats("dlq"); s.Visible != 0 {
		t.Errorf("%d dead letters, want none", s.Visible)
	}
}

// The README's bounds: concurrency up to 65,536 and in-flight up to
// 1,048,576 are accepted by New, one more is refused naming the option.
func TestConcurrencyAndInFlightBoundsAreTheDocumentedOnes(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	for _, c := range []struct {
		opts []consumer.Option
		want string // "" when New must accept
	}{
		{[]consumer.Option{consumer.WithConcurrency(65536)}, ""},
		{[]consumer.Option{consumer.WithConcurrency(65537)}, "WithConcurrency"},
		{[]consumer.Option{consumer.WithMaxInFlight(1 << 20)}, ""},
		{[]consumer.Option{consumer.WithMaxInFlight(1<<20 + 1)}, "WithMaxInFlight"},
	} {
		_, err := consumer.New(e.source(), h, append(c.opts, consumer.WithLogger(testlog.New(t)))...)
		switch {
		case c.want == "" && err != nil:
			t.Errorf("New = %v, want it accepted", err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("New = %v, want an error naming %s", err, c.want)
		}
	}
}
