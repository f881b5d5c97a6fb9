package jetstream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

// reconnecting are the connection options of a consumer that must ride
// out a killed connection and a server restart.
func reconnecting() []nats.Option {
	return []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond), nats.ReconnectJitter(0, 0)}
}

// TestConnectionKilledAndServerRestarted runs a consumer through a proxy
// whose connections are killed mid-stream, and later through a restart of
// the server (file storage). Every message must be handled successfully,
// and the consumer must end with nothing pending and nothing unacked: an
// ack that landed on a message other than the one handled would leave that
// one acked unhandled (lost), and one lost would never be handled.
func TestConnectionKilledAndServerRestarted(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	px := newProxy(t, fmt.Sprintf("127.0.0.1:%d", srv.port))
	pub := connect(t, srv.url(), reconnecting()...)
	name := uniqueName(t)
	pub.stream(name, true)
	const n = 400
	for i := range n {
		pub.publish(name+".k"+fmt.Sprint(i%7), []byte(fmt.Sprint("m-", i)), nil)
	}
	sub := connect(t, px.url(), reconnecting()...)
	src, err := New(sub.ctx(), sub.js, name, "restart", WithCreate(jetstream.ConsumerConfig{AckWait: 3 * time.Second}),
		WithPollWait(200*time.Millisecond), WithRequestTimeout(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu       sync.Mutex
		ok       = map[string]int{}
		attempts atomic.Int64
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		attempts.Add(1)
		time.Sleep(2 * time.Millisecond)
		if m.Attempt == 1 && len(m.Body)%3 == 0 {
			return errors.New("first attempts of some messages fail")
		}
		mu.Lock()
		ok[string(m.Body)]++
		mu.Unlock()
		return nil
	})
	handled := func() int { mu.Lock(); defer mu.Unlock(); return len(ok) }
	c, err := consumer.New(src, h, consumer.WithConcurrency(16), consumer.WithLogger(testlog.New(t)),
		consumer.WithRetry(consumer.Retry{MaxAttempts: 1000, Backoff: consumer.ConstantBackoff(20 * time.Millisecond)}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, "a third handled", func() bool { return handled() >= n/3 })
	px.cut()
	t.Logf("connections killed with %d of %d handled", handled(), n)
	waitFor(t, "two thirds handled", func() bool { return handled() >= 2*n/3 })
	srv.restart()
	t.Logf("server restarted with %d of %d handled", handled(), n)
	waitFor(t, "every message handled", func() bool { return handled() == n })

	info, err := pub.js.Consumer(pub.ctx(), name, "restart")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "nothing left pending or unacked", func() bool {
		ci, err := info.Info(pub.ctx())
		return err == nil && ci.NumPending == 0 && ci.NumAckPending == 0 && ci.NumRedelivered == 0
	})
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	done <- nil
	mu.Lock()
	defer mu.Unlock()
	if len(ok) != n {
		t.Fatalf("%d of %d messages handled", len(ok), n)
	}
	dups := 0
	for _, c := range ok {
		dups += c - 1
	}
	st := src.Stats()
	t.Logf("%d handler calls, %d successes repeated (acks lost with the connection); %+v", attempts.Load(), dups, st)
}

// TestLeaseRenewedAcrossOutage runs a handler for three AckWaits while the
// consumer's connection is down for half an AckWait in the middle: renewals
// fail meanwhile and resume once the connection is back, so a second
// consumer on the same durable consumer, connected all along, never gets
// the message while the handler runs.
func TestLeaseRenewedAcrossOutage(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	px := newProxy(t, fmt.Sprintf("127.0.0.1:%d", srv.port))
	direct := connect(t, srv.url())
	name := uniqueName(t)
	direct.stream(name, true)
	const ackWait = 2 * time.Second
	direct.publish(name+".slow", []byte("slow"), nil)
	sub := connect(t, px.url(), reconnecting()...)
	opts := []Option{WithCreate(jetstream.ConsumerConfig{AckWait: ackWait}), WithPollWait(200 * time.Millisecond), WithRequestTimeout(300 * time.Millisecond)}
	srcA, err := New(sub.ctx(), sub.js, name, "lease", opts...)
	if err != nil {
		t.Fatal(err)
	}
	srcB, err := New(direct.ctx(), direct.js, name, "lease", opts...)
	if err != nil {
		t.Fatal(err)
	}
	var (
		calls   atomic.Int64
		running = make(chan struct{})
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) == 1 {
			close(running)
		}
		select {
		case <-time.After(3 * ackWait):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	run := func(src *Source) (stop func() error) {
		c, err := consumer.New(src, h, consumer.WithLogger(testlog.New(t)))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		return func() error { cancel(); return <-done }
	}
	stopA := run(srcA)
	<-running
	stopB := run(srcB)
	time.Sleep(ackWait / 2)
	px.outage(ackWait / 2)
	// Acked: nothing pending or unacked is left to redeliver to B.
	waitFor(t, "the handler to finish and its ack to land", func() bool {
		ci, err := srcB.cons.Info(direct.ctx())
		return err == nil && ci.NumAckPending == 0 && ci.NumPending == 0
	})
	if err := stopA(); err != nil {
		t.Errorf("Run A: %v", err)
	}
	if err := stopB(); err != nil {
		t.Errorf("Run B: %v", err)
	}
	st := srcA.Stats()
	t.Logf("consumer A: %+v", st)
	if n := calls.Load(); n != 1 {
		t.Fatalf("the message was handled %d times, want once: its lease was not kept across the outage", n)
	}
	if st.Renewals-st.RenewalsFailed < 3 {
		t.Errorf("%d renewals answered, want at least 3 over three AckWaits", st.Renewals-st.RenewalsFailed)
	}
}

// TestOutageLongerThanAckWaitLosesTheLease: renewals ask for the server's
// reply, so while the consumer's connection is down none counts, and once
// the lease can no longer be vouched for the runtime cancels the handler
// (adapters.ErrLeaseLost), before the server hands the message to a second
// consumer, connected all along.
func TestOutageLongerThanAckWaitLosesTheLease(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	px := newProxy(t, fmt.Sprintf("127.0.0.1:%d", srv.port))
	direct := connect(t, srv.url())
	name := uniqueName(t)
	direct.stream(name, true)
	const ackWait = 2 * time.Second // the runtime gives the lease up a twelfth of it before it runs out
	direct.publish(name+".slow", []byte("slow"), nil)
	sub := connect(t, px.url(), reconnecting()...)
	opts := []Option{WithCreate(jetstream.ConsumerConfig{AckWait: ackWait}), WithPollWait(200 * time.Millisecond), WithRequestTimeout(200 * time.Millisecond)}
	srcA, err := New(sub.ctx(), sub.js, name, "outage", opts...)
	if err != nil {
		t.Fatal(err)
	}
	srcB, err := New(direct.ctx(), direct.js, name, "outage", opts...)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		cancelled time.Time // when A's handler saw its context end
		cause     error
		started   []time.Time // when each handler call began
		running   = make(chan struct{})
	)
	h := consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		started = append(started, time.Now())
		first := len(started) == 1
		mu.Unlock()
		if !first {
			return nil
		}
		close(running)
		select {
		case <-time.After(6 * ackWait):
			return nil
		case <-ctx.Done():
			mu.Lock()
			cancelled, cause = time.Now(), context.Cause(ctx)
			mu.Unlock()
			return cause
		}
	})
	run := func(src *Source) (stop func() error) {
		c, err := consumer.New(src, h, consumer.WithLogger(testlog.New(t)))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- c.Run(ctx) }()
		return func() error { cancel(); return <-done }
	}
	stopA := run(srcA)
	<-running
	stopB := run(srcB)
	// The outage lasts until the server has handed the message to B.
	end := px.down()
	waitFor(t, "the message handled by the second consumer", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(started) >= 2
	})
	stopB()
	end()
	stopA()
	mu.Lock()
	defer mu.Unlock()
	if cancelled.IsZero() || !errors.Is(cause, adapters.ErrLeaseLost) {
		t.Fatalf("the first handler's context ended with %v at %v; want it cancelled with adapters.ErrLeaseLost", cause, cancelled)
	}
	if !cancelled.Before(started[1]) {
		t.Fatalf("the first handler was cancelled at %v, after the second consumer began the message at %v: they ran together", cancelled, started[1])
	}
}
