package redisstream

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// started is a consumer running in the background.
type started struct {
	t      testing.TB
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
	err    error
}

func start(t testing.TB, src adapters.Source, h consumer.Handler, opts ...consumer.Option) *started {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithLogger(testlog.New(t))}, opts...)
	c, err := consumer.New(src, h, opts...)
	if err != nil {
		t.Fatalf("consumer.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &started{t: t, cancel: cancel, done: make(chan error, 1)}
	go func() { s.done <- c.Run(ctx) }()
	t.Cleanup(func() { s.stop() })
	return s
}

// stop cancels Run and waits for it to return.
func (s *started) stop() error {
	s.once.Do(func() {
		s.cancel()
		select {
		case s.err = <-s.done:
		case <-time.After(time.Minute):
			s.t.Errorf("Run did not return within a minute of its cancellation")
		}
	})
	return s.err
}

// waitFor polls cond until it holds, failing the test after a minute.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after a minute waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
