package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/adapters/memory"
	"github.com/custody-go/custody/consumer"
	"github.com/custody-go/custody/internal/testkit/testlog"
)

func TestFailedHandlerIsRedelivered(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("a", "b")
	c := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if c.inc(m.Body) < 3 {
			return errors.New("not yet")
		}
		return nil
	}, fastRetry(5))
	waitFor(t, "both acked", func() bool { return e.stats("q").Acked == 2 })
	r.stop()
	if c.get("a") != 3 || c.get("b") != 3 {
		t.Fatalf("handled a %d and b %d times, want 3 each", c.get("a"), c.get("b"))
	}
}

func TestCrashedConsumerLosesNothing(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 100 * time.Millisecond})
	const n = 50
	for i := 0; i < n; i++ {
		e.publish(fmt.Sprint(i))
	}
	effects := newCounter()
	crashing := e.source()
	// The handler decides when the process dies, not the test: the consumer
	// handles all 50 messages before a test polling for progress sees ten.
	var calls, stuck atomic.Int32
	block := make(chan struct{})
	r1 := run(t, crashing, func(ctx context.Context, m *consumer.Message) error {
		if calls.Add(1) > 10 {
			stuck.Add(1)
			<-block // the dead process never finishes
			return errors.New("dead")
		}
		effects.inc(m.Body)
		return nil
	}, consumer.WithConcurrency(4), consumer.WithShutdownTimeout(10*time.Millisecond))
	unblock := sync.OnceFunc(func() { close(block) })
	t.Cleanup(unblock) // before r1's stop, should the test fail
	waitFor(t, "every worker stuck", func() bool { return stuck.Load() == 4 })
	crashing.Crash()
	survivor := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		effects.inc(m.Body)
		return nil
	}, consumer.WithConcurrency(4))
	waitFor(t, "every message's effect", func() bool { return effects.distinct() == n })
	waitFor(t, "queue empty", func() bool { s := e.stats("q"); return s.Visible == 0 && s.InFlight == 0 })
	unblock()
	r1.stop()
	survivor.stop()
}

// extendLog records every extension the broker sees, per message body.
type extendLog struct {
	mu    sync.Mutex
	times map[string][]time.Time
}

func (l *extendLog) hook(d *adapters.Delivery) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.times[string(d.Body)] = append(l.times[string(d.Body)], time.Now())
	return nil
}

func TestLongHandlerKeepsItsLeaseAndNeverOverlaps(t *testing.T) {
	// A second, not less: renewals come every third of it, and a keeper
	// woken a few hundred milliseconds late on a loaded machine must still
	// renew before the lease runs out.
	const lease = time.Second
	e := newEnv(t, memory.QueueOptions{Lease: lease})
	e.publish("slow")
	log := &extendLog{times: map[string][]time.Time{}}
	var (
		active, maxActive atomic.Int32
		calls             atomic.Int32
		returned          atomic.Int64
	)
	h := func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		if a := active.Add(1); a > maxActive.Load() {
			maxActive.Store(a)
		}
		defer active.Add(-1)
		select {
		case <-time.After(3 * lease):
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		returned.Store(time.Now().UnixNano())
		return nil
	}
	// Two consumers on the queue: an expired lease would hand the message to
	// the other one.
	a := run(t, e.source(memory.WithFaults(memory.Faults{Extend: log.hook})), h)
	b := run(t, e.source(memory.WithFaults(memory.Faults{Extend: log.hook})), h)
	waitFor(t, "ack", func() bool { return e.stats("q").Acked == 1 })
	time.Sleep(2 * lease)
	a.stop()
	b.stop()
	if calls.Load() != 1 || maxActive.Load() != 1 {
		t.Fatalf("handler ran %d times, %d at once; want once", calls.Load(), maxActive.Load())
	}
	log.mu.Lock()
	defer log.mu.Unlock()
	ext := log.times["slow"]
	if len(ext) < 2 {
		t.Fatalf("lease extended %d times while a handler ran 3x the lease; want at least 2", len(ext))
	}
	end := time.Unix(0, returned.Load())
	for _, at := range ext {
		if at.After(end) {
			t.Fatalf("lease extended at %v, after the handler returned at %v", at, end)
		}
	}
}

func TestFailedExtensionCancelsHandlerAsLeaseLost(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 60 * time.Millisecond})
	e.publish("x")
	src := e.source(memory.WithFaults(memory.Faults{Extend: func(*adapters.Delivery) error {
		return errors.New("broker refused the extension")
	}}))
	cause := make(chan error, 1)
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt > 1 {
			return nil
		}
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}, fastRetry(3))
	select {
	case err := <-cause:
		if !errors.Is(err, adapters.ErrLeaseLost) {
			t.Fatalf("cause = %v, want adapters.ErrLeaseLost", err)
		}
	case <-time.After(patience):
		t.Fatal("handler context not cancelled after a failed extension")
	}
	r.stop()
}

func TestPoisonMessageReachesDeadLetterWithDiagnostics(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("poison", "fine")
	c := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		c.inc(m.Body)
		if string(m.Body) == "poison" {
			return fmt.Errorf("attempt %d: bad input", m.Attempt)
		}
		return nil
	}, fastRetry(4), consumer.WithDeadLetter(e.dlq()), consumer.WithName("orders-worker"))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	ms, _ := e.b.Messages("dlq")
	h := ms[0].Headers
	if string(ms[0].Body) != "poison" || h[adapters.HeaderAttempts] != "4" ||
		h[adapters.HeaderError] != "attempt 4: bad input" || h[adapters.HeaderConsumer] != "orders-worker" ||
		h[adapters.HeaderOriginalQueue] != "q" || h[adapters.HeaderFirstFailure] == "" {
		t.Fatalf("dead letter = %q %v", ms[0].Body, h)
	}
	if c.get("poison") != 4 || c.get("fine") != 1 {
		t.Fatalf("poison handled %d times (want 4), fine %d (want 1)", c.get("poison"), c.get("fine"))
	}
	if s := e.stats("q"); s.Visible != 0 || s.InFlight != 0 {
		t.Fatalf("original queue still holds messages: %+v", s)
	}
}

func TestPermanentErrorDeadLettersOnFirstAttempt(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("{not json")
	c := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		c.inc(m.Body)
		return consumer.Permanent(errors.New("cannot parse"))
	}, fastRetry(5), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	if c.get("{not json") != 1 {
		t.Fatalf("handled %d times, want 1", c.get("{not json"))
	}
}

func TestDeadLetterFailureDoesNotAckOriginal(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("x")
	dlq := e.dlq()
	var refusals atomic.Int32
	dlq.SetFault(func(*adapters.Delivery) error {
		refusals.Add(1)
		return errors.New("dlq down")
	})
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		return consumer.Permanent(errors.New("bad"))
	}, fastRetry(2), consumer.WithDeadLetter(dlq))
	waitFor(t, "refused dead-letter writes", func() bool { return refusals.Load() >= 3 })
	r.stop()
	if s := e.stats("q"); s.Acked != 0 || s.Visible+s.InFlight != 1 {
		t.Fatalf("original acked or gone after failed dead-letter writes: %+v", s)
	}
	if e.stats("dlq").Visible != 0 {
		t.Fatal("refused write arrived anyway")
	}
}

func TestPanicIsRetried(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("p")
	c := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if c.inc(m.Body) == 1 {
			panic("boom")
		}
		return nil
	}, fastRetry(3))
	waitFor(t, "ack", func() bool { return e.stats("q").Acked == 1 })
	r.stop()
	if c.get("p") != 2 {
		t.Fatalf("handled %d times, want 2 (panic, then success)", c.get("p"))
	}
}

func TestPanicsDeadLetterWithTheirValue(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("p")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		panic("nil map write")
	}, fastRetry(2), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	ms, _ := e.b.Messages("dlq")
	if !strings.Contains(ms[0].Headers[adapters.HeaderError], "nil map write") {
		t.Fatalf("error header %q does not carry the panic", ms[0].Headers[adapters.HeaderError])
	}
}

// uncountedSource is a memory source whose broker, as far as the runtime
// can tell, delays redelivery but does not count deliveries: every delivery
// reports a first attempt.
type uncountedSource struct{ *memory.Source }

func (s uncountedSource) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.CountsDeliveries = false
	return c
}

func (s uncountedSource) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	ds, err := s.Source.Receive(ctx, max)
	for _, d := range ds {
		d.Attempt = 1
	}
	return ds, err
}

// Where the broker delays redelivery but counts no deliveries, a message that
// always fails still reaches MaxAttempts and the dead-letter destination: the
// runtime retries it in place, counting the attempts itself, instead of
// nacking it into redeliveries that each look like a first attempt.
func TestPoisonLeavesTheStreamWhereTheBrokerCountsNoDeliveries(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("poison")
	var calls atomic.Int32
	r := runOn(t, uncountedSource{e.source()}, func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		return errors.New("always fails")
	}, fastRetry(3), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the poison message dead-lettered", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	if n := calls.Load(); n != 3 {
		t.Errorf("handler ran %d times, want MaxAttempts (3)", n)
	}
	ms, _ := e.b.Messages("dlq")
	if got := ms[0].Headers[adapters.HeaderAttempts]; got != "3" {
		t.Errorf("attempts header %q, want 3", got)
	}
}

// panickyError is an error whose Error method panics.
type panickyError struct{}

func (panickyError) Error() string { panic("Error() of a nil field") }

// A handler error whose Error method panics is a handler failure like a
// panic, not a crash: the runtime formats errors for its logs, spans and
// dead-letter diagnostics outside the handler's recover.
func TestErrorWhoseErrorMethodPanicsIsAFailureNotACrash(t *testing.T) {
	reader, mp := newMeter()
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("p")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		return panickyError{}
	}, fastRetry(2), consumer.WithDeadLetter(e.dlq()), consumer.WithMeterProvider(mp))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	if got := sums(t, reader)["custody.handler.panics"]; got != 2 {
		t.Errorf("custody.handler.panics = %d, want 2 (one per attempt)", got)
	}
	ms, _ := e.b.Messages("dlq")
	if h := ms[0].Headers[adapters.HeaderError]; !strings.Contains(h, "Error() of a nil field") || !strings.Contains(h, "panickyError") {
		t.Fatalf("error header %q does not say which error panicked and how", h)
	}
}

// nilWrapError is returned as a typed nil pointer: its Error method does
// not touch the receiver, its Unwrap method does.
type nilWrapError struct{ inner error }

func (*nilWrapError) Error() string   { return "wrapped" }
func (e *nilWrapError) Unwrap() error { return e.inner }

// So is a handler error whose Unwrap method panics: the runtime classifies
// errors (Permanent, RetryAfter, Defer) outside the handler's recover too.
// It used to crash the process.
func TestErrorWhoseUnwrapMethodPanicsIsAFailureNotACrash(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("p")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		var err *nilWrapError
		return err
	}, fastRetry(2), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	ms, _ := e.b.Messages("dlq")
	if h := ms[0].Headers[adapters.HeaderError]; !strings.Contains(h, "nilWrapError") || !strings.Contains(h, "Unwrap") {
		t.Fatalf("error header %q does not say which error panicked and how", h)
	}
}

func TestShutdownFinishesInFlightAndAcksThem(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("1", "2", "3", "4", "5", "6")
	var started atomic.Int32
	release := make(chan struct{})
	var finished atomic.Int32
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		started.Add(1)
		<-release
		if ctx.Err() != nil {
			return ctx.Err()
		}
		finished.Add(1)
		return nil
	}, consumer.WithConcurrency(3), consumer.WithMaxInFlight(6), consumer.WithShutdownTimeout(patience))
	waitFor(t, "three running", func() bool { return started.Load() == 3 })
	done := make(chan error)
	go func() { done <- r.stop() }()
	// Release the handlers only once the drain has begun, which gives the
	// three waiting deliveries back: released earlier (a sleep was used, and
	// a loaded machine can start the stop later), the workers run those
	// three as well.
	waitFor(t, "the three waiting deliveries given back", func() bool { return e.stats("q").Visible == 3 })
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s := e.stats("q")
	if finished.Load() != 3 || s.Acked != 3 {
		t.Fatalf("finished %d, acked %d; want the 3 in flight finished and acked", finished.Load(), s.Acked)
	}
	if s.Visible != 3 {
		t.Fatalf("%d messages visible after shutdown; the 3 never started must be given back at once (%+v)", s.Visible, s)
	}
}

func TestShutdownTimeoutCancelsAndReleases(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("stuck")
	cause := make(chan error, 1)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}, consumer.WithShutdownTimeout(50*time.Millisecond))
	waitFor(t, "received", func() bool { return e.stats("q").InFlight == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if err := <-cause; !errors.Is(err, consumer.ErrShutdownTimeout) {
		t.Fatalf("cause = %v, want ErrShutdownTimeout", err)
	}
	// Released at once rather than left to a one-minute lease.
	if s := e.stats("q"); s.Visible != 1 {
		t.Fatalf("stats %+v: the unfinished message was not given back", s)
	}
}

// Deliveries waiting for a worker when shutdown begins are given back at
// once, not when a worker frees up (which may be the whole shutdown timeout
// away); one queued behind a running message of its key waits for it, so
// that the key's order holds.
func TestShutdownGivesBackWaitingDeliveriesAtOnce(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	err := e.b.Publish(context.Background(), "q",
		memory.Message{Key: "k", Body: []byte("slow")}, memory.Message{Key: "k", Body: []byte("behind")},
		memory.Message{Body: []byte("free1")}, memory.Message{Body: []byte("free2")})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	release := make(chan struct{})
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "slow" {
			close(started)
			<-release
		}
		return nil
	}, consumer.WithOrdering(consumer.OrderByKey), consumer.WithShutdownTimeout(patience))
	<-started
	waitFor(t, "all four received", func() bool { return e.stats("q").InFlight == 4 })
	done := make(chan error, 1)
	go func() { done <- r.stop() }()
	waitFor(t, "the two waiting for a worker given back", func() bool { return e.stats("q").Visible == 2 })
	if s := e.stats("q"); s.InFlight != 2 {
		t.Fatalf("stats %+v: the message behind the running one of its key must stay until it ends", s)
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Acked != 1 || s.Visible != 3 || s.InFlight != 0 {
		t.Fatalf("stats %+v after shutdown: want the running message acked and the other three given back", s)
	}
}

// nackCounter counts the deliveries a source is asked to nack.
type nackCounter struct {
	*memory.Source
	nacked atomic.Int64
}

func (s *nackCounter) Nack(ctx context.Context, ns []adapters.Nack) error {
	s.nacked.Add(int64(len(ns)))
	return s.Source.Nack(ctx, ns)
}

// In at-most-once mode every delivery was acked on receipt: shutdown cannot
// give one back, so it still handles those received, and never nacks.
func TestAtMostOnceShutdownHandlesWhatItReceived(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("slow", "b1", "b2")
	src := &nackCounter{Source: e.source()}
	started := make(chan struct{})
	release := make(chan struct{})
	c := newCounter()
	cons, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		c.inc(m.Body)
		if string(m.Body) == "slow" {
			close(started)
			<-release
		}
		return nil
	}), consumer.WithAtMostOnceAckBeforeProcessingUnsafe(), consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- cons.Run(ctx) }()
	<-started
	waitFor(t, "all three acked on receipt", func() bool { return e.stats("q").Acked == 3 })
	cancel()
	// Let the receiver see the cancellation (its poll waits 10ms) and the
	// drain begin before the two waiting messages can reach the worker.
	time.Sleep(100 * time.Millisecond)
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := src.nacked.Load(); n != 0 {
		t.Fatalf("%d deliveries already acked on receipt were nacked at shutdown", n)
	}
	if c.distinct() != 3 {
		t.Fatalf("%d of the 3 messages received were handled; the rest were dropped at shutdown", c.distinct())
	}
}

// zeroBackoff is a policy that asks for no wait at all.
type zeroBackoff struct{}

func (zeroBackoff) Delay(int) time.Duration { return 0 }

// Whatever a Backoff returns, a retry or deferral waits: a deferral never
// runs out of attempts, so a policy returning zero would otherwise call the
// handler in a hot loop.
func TestBackoffNeverRetriesWithoutWaiting(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x")
	var calls atomic.Int64
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		return consumer.Defer(errors.New("not yet"), 0)
	}, consumer.WithRetry(consumer.Retry{Backoff: zeroBackoff{}}))
	waitFor(t, "a few attempts", func() bool { return calls.Load() >= 3 })
	start, before := time.Now(), calls.Load()
	time.Sleep(100 * time.Millisecond)
	n, elapsed := calls.Load()-before, time.Since(start)
	r.stop()
	// Each call waits at least a millisecond after the one before.
	if most := int64(elapsed/time.Millisecond) + 1; n > most {
		t.Fatalf("%d handler calls in %v: retries did not wait", n, elapsed)
	}
}

func TestOrderByKeyUnderConcurrency(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	const perKey = 40
	for i := 0; i < perKey; i++ {
		for _, k := range []string{"x", "y", "z", "w"} {
			e.b.Publish(context.Background(), "q", memory.Message{Key: k, Body: []byte(fmt.Sprintf("%s%03d", k, i))})
		}
	}
	var (
		mu      sync.Mutex
		last    = map[string]string{}
		busy    = map[string]bool{}
		errs    []string
		handled int
	)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		if busy[m.Key] {
			errs = append(errs, "overlap on "+m.Key)
		}
		busy[m.Key] = true
		if string(m.Body) <= last[m.Key] {
			errs = append(errs, fmt.Sprintf("%s after %s", m.Body, last[m.Key]))
		}
		last[m.Key] = string(m.Body)
		mu.Unlock()
		time.Sleep(100 * time.Microsecond)
		mu.Lock()
		busy[m.Key] = false
		handled++
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(16), consumer.WithOrdering(consumer.OrderByKey))
	waitFor(t, "all handled", func() bool { mu.Lock(); defer mu.Unlock(); return handled == 4*perKey })
	r.stop()
	if len(errs) > 0 {
		t.Fatalf("ordering broken: %v", errs[:min(5, len(errs))])
	}
}

// A busy lane does not keep a worker to itself: with one worker, a key
// queued behind sixty messages of another key runs long before they are done.
func TestLanesShareWorkers(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := 0; i < 60; i++ {
		e.b.Publish(context.Background(), "q", memory.Message{Key: "busy", Body: []byte("busy")})
	}
	e.b.Publish(context.Background(), "q", memory.Message{Key: "other", Body: []byte("other")})
	var (
		mu    sync.Mutex
		order []string
		first sync.Once
	)
	src := &receiveCounter{Source: e.source()}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		// Hold the first message until the receiver has handed out the
		// whole batch and asked for more: then the other key's message waits
		// beside the busy lane whatever the receiver's pace (a receiver
		// starved of CPU would otherwise let the worker finish the busy lane
		// before the other key is even dispatched).
		first.Do(func() {
			waitFor(t, "the batch dispatched", func() bool { return src.calls.Load() >= 2 })
		})
		mu.Lock()
		order = append(order, m.Key)
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(1), consumer.WithMaxInFlight(200), consumer.WithOrdering(consumer.OrderByKey))
	waitFor(t, "all handled", func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 61 })
	r.stop()
	at := slices.Index(order, "other")
	if at > 30 {
		t.Fatalf("the other key ran at position %d of 61: the busy lane kept the only worker", at)
	}
}

// A finished message's ack does not wait for the next handler: with one
// worker busy on a long handler, the message before it is acked meanwhile.
func TestAckDoesNotWaitForTheNextHandler(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.b.Publish(context.Background(), "q", memory.Message{Body: []byte("quick")}, memory.Message{Body: []byte("long")})
	release := make(chan struct{})
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "long" {
			<-release
		}
		return nil
	}, consumer.WithConcurrency(1))
	waitFor(t, "the quick message acked while the long one runs", func() bool { return e.stats("q").Acked == 1 })
	close(release)
	waitFor(t, "both acked", func() bool { return e.stats("q").Acked == 2 })
	r.stop()
}

// A message deferred more often than MaxAttempts is not dead-lettered, on a
// broker that redelivers after a delay and in an ordered lane that waits in
// place; in the lane the deferrals leave the attempt number alone.
func TestDeferNeverExhaustsAttempts(t *testing.T) {
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("ordered=%v", ordered), func(t *testing.T) {
			e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
			e.b.Publish(context.Background(), "q", memory.Message{Key: "k", Body: []byte("x")})
			var calls atomic.Int32
			lastAttempt := make(chan int, 1)
			opts := []consumer.Option{fastRetry(2), consumer.WithDeadLetter(e.dlq())}
			if ordered {
				opts = append(opts, consumer.WithOrdering(consumer.OrderByKey))
			}
			r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
				if calls.Add(1) <= 5 {
					return consumer.Defer(errors.New("the original still runs"), 5*time.Millisecond)
				}
				lastAttempt <- m.Attempt
				return nil
			}, opts...)
			waitFor(t, "the message acked", func() bool { return e.stats("q").Acked == 1 })
			r.stop()
			if n := e.stats("dlq").Visible; n != 0 {
				t.Fatalf("%d messages dead-lettered; deferrals must not use up attempts", n)
			}
			if got := <-lastAttempt; ordered && got != 1 {
				t.Errorf("attempt %d after deferrals in place, want 1", got)
			}
		})
	}
}

// A deferral without a delay waits the policy's backoff rather than coming
// straight back: it has no attempt limit to end a hot loop.
func TestDeferWithoutDelayWaitsTheBackoff(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.b.Publish(context.Background(), "q", memory.Message{Key: "k", Body: []byte("x")})
	var calls atomic.Int32
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		return consumer.Defer(errors.New("not yet"), 0)
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 3, Backoff: consumer.ConstantBackoff(50 * time.Millisecond)}),
		consumer.WithOrdering(consumer.OrderByKey))
	time.Sleep(300 * time.Millisecond)
	r.stop()
	// About 6 calls at one per 50 ms; a hot loop makes thousands.
	if n := calls.Load(); n > 30 {
		t.Fatalf("%d handler calls in 300 ms: a deferral without a delay came straight back", n)
	}
}

func TestRetryAfterIsHonoured(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("r")
	var first time.Time
	var gap atomic.Int64
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if m.Attempt == 1 {
			first = time.Now()
			return consumer.RetryAfter(errors.New("rate limited"), 200*time.Millisecond)
		}
		gap.Store(int64(time.Since(first)))
		return nil
	}, fastRetry(3))
	waitFor(t, "ack", func() bool { return e.stats("q").Acked == 1 })
	r.stop()
	if d := time.Duration(gap.Load()); d < 200*time.Millisecond {
		t.Fatalf("retried after %v, before the 200ms asked for", d)
	}
}

// TestRetryAfterIsHonouredOnceAttemptsRunOut: without a dead-letter
// destination, a message that used up its attempts is given back to the
// broker, and the delay its handler asked for with RetryAfter still holds.
// It was given back after the policy's backoff instead (5 ms here, for an
// hour asked), so a rate-limited dependency was called again at once, and
// on every later delivery too.
func TestRetryAfterIsHonouredOnceAttemptsRunOut(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("limited")
	src := &nackRecorder{Source: e.source()}
	r := runOn(t, src, func(ctx context.Context, m *consumer.Message) error {
		return consumer.RetryAfter(errors.New("rate limited"), time.Hour)
	}, fastRetry(1))
	waitFor(t, "the message given back", func() bool { b, _ := src.nacked(); return len(b) > 0 })
	r.stop()
	if _, delays := src.nacked(); delays[0] < time.Hour {
		t.Fatalf("given back with a redelivery delay of %v; the handler asked for an hour", delays[0])
	}
}

func TestHandlerTimeout(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("t")
	cause := make(chan error, 3)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return ctx.Err()
	}, consumer.WithHandlerTimeout(20*time.Millisecond), fastRetry(1), consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	r.stop()
	if err := <-cause; !errors.Is(err, consumer.ErrHandlerTimeout) {
		t.Fatalf("cause = %v, want ErrHandlerTimeout", err)
	}
}

func TestFailedAckIsRedelivered(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 100 * time.Millisecond})
	e.publish("a")
	src := e.sourceLosingFirstAck()
	c := newCounter()
	r := run(t, src, func(ctx context.Context, m *consumer.Message) error {
		c.inc(m.Body)
		return nil
	})
	waitFor(t, "acked on the second delivery", func() bool { return e.stats("q").Acked == 1 })
	r.stop()
	if c.get("a") != 2 {
		t.Fatalf("handled %d times, want 2: the failed ack must lead to a redelivery, not a loss", c.get("a"))
	}
}

func TestAtMostOnceLosesFailuresByDesign(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 20 * time.Millisecond})
	e.publish("sample")
	c := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		c.inc(m.Body)
		return errors.New("dropped")
	}, consumer.WithAtMostOnceAckBeforeProcessingUnsafe())
	waitFor(t, "handled", func() bool { return c.get("sample") == 1 })
	time.Sleep(100 * time.Millisecond)
	r.stop()
	if s := e.stats("q"); s.Acked != 1 || c.get("sample") != 1 {
		t.Fatalf("at-most-once: handled %d times, stats %+v; want acked before handling and never retried", c.get("sample"), s)
	}
}

func TestExhaustedWithoutDeadLetterIsGivenBack(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Second, MaxReceiveCount: 2})
	e.publish("x")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		return errors.New("always")
	}, consumer.WithRetry(consumer.Retry{MaxAttempts: 2, Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}))
	// No runtime dead letter: the queue's own redrive policy moves it.
	waitFor(t, "redrive", func() bool { return e.stats("q").Redriven == 1 })
	r.stop()
	if e.stats("dlq").Visible != 1 {
		t.Fatal("redriven message not in the dead-letter queue")
	}
}

// Without a dead-letter destination, a message of an ordered lane that runs
// out of attempts is retried in place rather than given back to the broker:
// given back, the messages behind it in its lane would run before its
// redelivery. Here a1 fails three times with MaxAttempts 2; a2, same key,
// must wait for it.
func TestExhaustedWithoutDeadLetterKeepsItsLaneInOrder(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publishKeyed("a", "a1", "a2")
	var mu sync.Mutex
	var done []string
	calls := newCounter()
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		if string(m.Body) == "a1" && calls.inc(m.Body) <= 3 {
			return errors.New("not yet")
		}
		mu.Lock()
		done = append(done, string(m.Body))
		mu.Unlock()
		return nil
	}, consumer.WithConcurrency(2), consumer.WithOrdering(consumer.OrderByKey), fastRetry(2))
	waitFor(t, "both messages acked", func() bool { return e.stats("q").Acked == 2 })
	r.stop()
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(done, []string{"a1", "a2"}) {
		t.Fatalf("effects %v, want a1 then a2: the exhausted a1 let a2 overtake it", done)
	}
}

// A retry policy that leaves MaxAttempts zero takes the default, five
// attempts, as WithRetry says of its zero fields: taken as it stands, a
// policy set only for its backoff dead-lettered every message at its first
// failure.
func TestRetryWithoutMaxAttemptsTakesTheDefault(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	e.publish("x")
	var calls atomic.Int32
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		calls.Add(1)
		return errors.New("always fails")
	}, consumer.WithRetry(consumer.Retry{Backoff: consumer.ConstantBackoff(5 * time.Millisecond)}),
		consumer.WithDeadLetter(e.dlq()))
	waitFor(t, "the dead letter", func() bool { return e.stats("dlq").Visible == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := calls.Load(); n != 5 {
		t.Errorf("handler ran %d times before the dead letter, want the default 5", n)
	}
}

func TestInvalidOptionsFailAtNewNamingTheOption(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	cases := []struct {
		opt  consumer.Option
		want string
	}{
		{consumer.WithConcurrency(0), "WithConcurrency"},
		{consumer.WithMaxInFlight(-1), "WithMaxInFlight"},
		{consumer.WithMaxInFlight(math.MaxInt), "WithMaxInFlight"}, // made Run panic
		{consumer.WithConcurrency(math.MaxInt), "WithConcurrency"}, // started that many goroutines
		{consumer.WithRetry(consumer.Retry{MaxAttempts: -1}), "WithRetry"},
		{consumer.WithRetry(consumer.Retry{Backoff: consumer.ExponentialBackoff{Initial: time.Second, Multiplier: 0.5}}), "WithRetry"},
		{consumer.WithDeadLetter(nil), "WithDeadLetter"},
		{consumer.WithDeadLetter((*memory.DeadLetterQueue)(nil)), "WithDeadLetter"}, // an ignored constructor error
		{consumer.WithOrdering(consumer.Ordering(9)), "WithOrdering"},
		{consumer.WithHandlerTimeout(-time.Second), "WithHandlerTimeout"},
		{consumer.WithShutdownTimeout(-time.Second), "WithShutdownTimeout"},
		{consumer.WithMaxProcessingTime(0), "WithMaxProcessingTime"},
		{consumer.WithLeaseRenewal(1.5), "WithLeaseRenewal"},
		{consumer.WithLeaseRenewal(1), "WithLeaseRenewal"}, // renewed only as the lease runs out
		{consumer.WithLeaseRenewal(0), "WithLeaseRenewal"},
		{consumer.WithLeaseRenewal(math.NaN()), "WithLeaseRenewal"},
		{consumer.WithRetry(consumer.Retry{Backoff: consumer.ConstantBackoff(0)}), "WithRetry"},
		{consumer.WithRetry(consumer.Retry{Backoff: &consumer.ExponentialBackoff{}}), "WithRetry"},
		{consumer.WithRetry(consumer.Retry{Backoff: (*consumer.ExponentialBackoff)(nil)}), "WithRetry"},
		{consumer.WithRetry(consumer.Retry{Backoff: consumer.ExponentialBackoff{Initial: time.Second, Multiplier: 2, Jitter: math.NaN()}}), "WithRetry"},
		{consumer.WithRetry(consumer.Retry{Backoff: consumer.ExponentialBackoff{Initial: time.Second, Multiplier: math.NaN()}}), "WithRetry"},
		{consumer.WithLogger(nil), "WithLogger"},
		{consumer.WithMeterProvider(nil), "WithMeterProvider"},
		{consumer.WithTracerProvider(nil), "WithTracerProvider"},
		{consumer.WithPropagator(nil), "WithPropagator"},
	}
	for _, tc := range cases {
		_, err := consumer.New(e.source(), h, tc.opt)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("option %s: New error = %v, want one naming it", tc.want, err)
		}
	}
	if _, err := consumer.New(e.source(), h, consumer.WithConcurrency(8), consumer.WithMaxInFlight(4)); err == nil || !strings.Contains(err.Error(), "WithMaxInFlight") {
		t.Errorf("max in flight below concurrency: %v", err)
	}
	if _, err := consumer.New(nil, h); err == nil {
		t.Error("nil source accepted")
	}
	if _, err := consumer.New(e.source(), nil); err == nil {
		t.Error("nil handler accepted")
	}
}

// leaseWithoutExtender declares a lease it cannot extend.
type leaseWithoutExtender struct{ adapters.Source }

func (s leaseWithoutExtender) Capabilities() adapters.Capabilities {
	return adapters.Capabilities{Name: "broken", Lease: time.Second}
}

func TestLeaseWithoutExtenderFailsAtNew(t *testing.T) {
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := consumer.New(leaseWithoutExtender{}, h); err == nil || !strings.Contains(err.Error(), "Extender") {
		t.Fatalf("New = %v, want an error about the missing Extender", err)
	}
}

func TestRunTwiceFails(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	c, err := consumer.New(e.source(), consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Run(ctx); err == nil {
		t.Fatal("second Run accepted")
	}
}

func TestAsReachesTheNativeMessage(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	e.publish("n")
	got := make(chan memory.Message, 1)
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		var native memory.Message
		if m.As(&native) {
			got <- native
		}
		var wrong *int
		if m.As(&wrong) {
			t.Error("As accepted a wrong type")
		}
		return nil
	})
	select {
	case n := <-got:
		if string(n.Body) != "n" || n.Receives != 1 {
			t.Fatalf("native = %+v", n)
		}
	case <-time.After(patience):
		t.Fatal("As did not reach the native message")
	}
	r.stop()
}

func TestSourceClosedUnderRunEndsRunWithError(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	src := e.source()
	r := run(t, src, func(context.Context, *consumer.Message) error { return nil })
	src.Crash()
	select {
	case err := <-r.done:
		if !errors.Is(err, adapters.ErrClosed) {
			t.Fatalf("Run = %v, want ErrClosed", err)
		}
		r.once.Do(func() {})
	case <-time.After(patience):
		t.Fatal("Run kept going on a dead source")
	}
}

// noNackDelay is a memory source posing as a broker without delayed
// redelivery (as Kafka is): the runtime must wait in place.
type noNackDelay struct{ *memory.Source }

func (s noNackDelay) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.NackDelay = false
	c.CountsDeliveries = false
	return c
}

func TestRetriesWaitInPlaceWithoutBrokerDelay(t *testing.T) {
	// Four waits of 300 ms outlast the lease, renewed every third of it: a
	// renewal may come hundreds of milliseconds late on a loaded machine
	// before the lease runs out (with a 60 ms lease, 40 ms late lost it).
	e := newEnv(t, memory.QueueOptions{Lease: time.Second})
	e.publish("x")
	var attempts []int
	var mu sync.Mutex
	src := noNackDelay{e.source()}
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		mu.Lock()
		defer mu.Unlock()
		attempts = append(attempts, m.Attempt)
		if len(attempts) < 5 {
			return errors.New("dependency down")
		}
		return nil
	}), consumer.WithRetry(consumer.Retry{MaxAttempts: 2, Backoff: consumer.ConstantBackoff(300 * time.Millisecond)}),
		consumer.WithLogger(testlog.New(t)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, "ack", func() bool { return e.stats("q").Acked == 1 })
	cancel()
	<-done
	// One receive: every retry ran in place, the lease kept alive across
	// waits longer than the lease, and without a dead-letter destination the
	// handler kept being retried past MaxAttempts rather than dropped.
	if s := e.stats("q"); s.Received != 1 {
		t.Fatalf("received %d times; retries did not wait in place (%+v)", s.Received, s)
	}
	mu.Lock()
	defer mu.Unlock()
	for i, a := range attempts {
		if a != i+1 {
			t.Fatalf("attempts = %v, want 1..5 counted by the runtime", attempts)
		}
	}
}

// prefetched is a memory source posing as a broker that hands out at most 4
// unacked deliveries.
type prefetched struct{ *memory.Source }

func (s prefetched) Capabilities() adapters.Capabilities {
	c := s.Source.Capabilities()
	c.MaxUnacked = 4
	return c
}

func TestConcurrencyAboveThePrefetchFailsAtNew(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	_, err := consumer.New(prefetched{e.source()}, h, consumer.WithConcurrency(8))
	if err == nil || !strings.Contains(err.Error(), "WithConcurrency") || !strings.Contains(err.Error(), "prefetch") {
		t.Fatalf("New = %v, want an error naming WithConcurrency and the prefetch", err)
	}
	if _, err := consumer.New(prefetched{e.source()}, h, consumer.WithConcurrency(4)); err != nil {
		t.Fatalf("concurrency equal to the prefetch refused: %v", err)
	}
}

// askingPrefetched is a prefetched source that records the most deliveries
// one Receive asked for.
type askingPrefetched struct {
	prefetched
	largest atomic.Int32
}

func (s *askingPrefetched) Receive(ctx context.Context, max int) ([]*adapters.Delivery, error) {
	for {
		old := s.largest.Load()
		if int32(max) <= old || s.largest.CompareAndSwap(old, int32(max)) {
			break
		}
	}
	return s.prefetched.Receive(ctx, max)
}

// The default in-flight bound keeps to the adapter's prefetch
// (Capabilities.MaxUnacked): the runtime never asks for more deliveries
// than the broker lets one consumer hold unacked, here 4, where the default
// would otherwise be 20, asked for 10 at a time.
func TestDefaultMaxInFlightKeepsToThePrefetch(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: time.Minute})
	for i := 0; i < 10; i++ {
		e.publish(fmt.Sprint(i))
	}
	src := &askingPrefetched{prefetched: prefetched{e.source()}}
	r := runOn(t, src, func(context.Context, *consumer.Message) error { return nil })
	waitFor(t, "every message acked", func() bool { return e.stats("q").Acked == 10 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if n := src.largest.Load(); n > 4 {
		t.Fatalf("a Receive asked for %d deliveries; the prefetch allows 4 unacked", n)
	}
}

func TestLeaveUnfinishedOnShutdownKeepsTheLease(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 300 * time.Millisecond})
	e.publish("stuck")
	r := run(t, e.source(), func(ctx context.Context, m *consumer.Message) error {
		<-ctx.Done()
		return ctx.Err()
	}, consumer.WithShutdownTimeout(20*time.Millisecond), consumer.WithLeaveUnfinishedOnShutdown())
	waitFor(t, "received", func() bool { return e.stats("q").InFlight == 1 })
	if err := r.stop(); err != nil {
		t.Fatal(err)
	}
	if s := e.stats("q"); s.Visible != 0 || s.InFlight != 1 {
		t.Fatalf("stats %+v: the unfinished message was given back; it should wait out its lease", s)
	}
	waitFor(t, "the lease to run out", func() bool { return e.stats("q").Visible == 1 })
}

// TestLeaseRenewalInALoopFailsAtNew: a renewal fraction so small that the
// lease would be renewed more often than every millisecond (WithLeaseRenewal
// of 1e-9 on a 30s lease: every 30ns) had the lease keeper call Extend in a
// loop for every held delivery, each call with a timeout of that interval.
func TestLeaseRenewalInALoopFailsAtNew(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 30 * time.Second})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := consumer.New(e.source(), h, consumer.WithLeaseRenewal(1e-9)); err == nil || !strings.Contains(err.Error(), "WithLeaseRenewal") {
		t.Fatalf("New = %v, want an error naming WithLeaseRenewal", err)
	}
	if _, err := consumer.New(e.source(), h, consumer.WithLeaseRenewal(0.01)); err != nil {
		t.Fatalf("a renewal every 300ms refused: %v", err)
	}
}

// TestLeaseRenewalEveryMillisecondIsAccepted: New refuses renewals more often
// than every millisecond, not renewals exactly that far apart.
func TestLeaseRenewalEveryMillisecondIsAccepted(t *testing.T) {
	e := newEnv(t, memory.QueueOptions{Lease: 2 * time.Millisecond})
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	if _, err := consumer.New(e.source(), h, consumer.WithLeaseRenewal(0.5)); err != nil {
		t.Fatalf("a renewal every 1ms refused: %v", err)
	}
}
